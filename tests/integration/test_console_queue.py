"""The console's review queue on the real broker and Redis, without a browser:
claim timeouts, redelivery after a restart, bad payloads, leaving."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaTimeoutError

from schemas import DeadLetter, HumanLabel, ReviewRequest, utcnow
from tests.conftest import RedisNamespace
from tests.kafka_helpers import committed_total, drain, produce_raw
from tests.process_helpers import wait_until
from worker.errors import ReviewError
from worker.review.queue import ReviewItem, ReviewQueue
from worker.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def qsettings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"group_console": f"console-{uuid.uuid4().hex[:8]}", "console_undo_s": 0.0}
    )


@pytest.fixture
def queues(qsettings: Settings, redis_ns: RedisNamespace) -> Iterator[list[ReviewQueue]]:
    made: list[ReviewQueue] = []
    yield made
    for q in made:
        q.stop()


def start(settings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]) -> ReviewQueue:
    from worker.kafka.clients import ensure_topics

    ensure_topics(settings, partitions=2)
    q = ReviewQueue(settings, redis_ns.client).start()
    queues.append(q)
    assert q.ready.wait(30)
    return q


def put(settings: Settings, n: int) -> list[str]:
    ids = [f"q-{uuid.uuid4().hex[:6]}-{i}" for i in range(n)]
    produce_raw(
        settings,
        settings.topic_review,
        [
            (
                mid.encode(),
                ReviewRequest(
                    message_id=mid,
                    text=f"text {i}",
                    probe="toxicity",
                    version=1,
                    scores={"ok": 0.4, "toxic": 0.6},
                    reason="uncertain",
                    created_at=utcnow(),
                ).encode(),
            )
            for i, mid in enumerate(ids)
        ],
    )
    return ids


def labels(settings: Settings, n: int) -> list[HumanLabel]:
    records = drain(settings, settings.topic_labels, lambda rs: len(rs) >= n, timeout_s=20)
    return [HumanLabel.decode(r.value) for r in records]


def test_a_timed_out_claim_moves_on_and_the_late_answer_is_refused(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    put(qsettings, 1)
    q = start(qsettings, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 1, "the item to arrive")
    item = q.next_item("ann")
    assert item is not None and q.next_item("ben") is None  # claimed: nothing for ben
    redis_ns.client.delete(redis_ns.keys.review_claim(item.key))  # ann's claim expires
    assert q.next_item("ben") is None  # ann still has it on screen in this console...
    q.current.pop("ann")  # ...until her page goes (as after another console's restart)
    got = q.next_item("ben")
    assert got is not None and got.key == item.key
    with pytest.raises(ReviewError, match="no longer yours"):
        q.answer("ann", item.key, ["toxic"])
    assert q.answer("ben", item.key, ["ok"]).labeler_id == "ben"
    (label,) = labels(qsettings, 1)
    assert label.labeler_id == "ben" and label.label == "ok"
    assert label.probe == item.request.probe  # addressed: only that probe's updater learns it


def test_claim_lost_to_another_console_is_refused_on_answer(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    put(qsettings, 1)
    q = start(qsettings, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 1, "the item to arrive")
    item = q.next_item("ann")
    assert item is not None
    # ann's claim expired and a reviewer on another console took the item.
    redis_ns.client.set(redis_ns.keys.review_claim(item.key), "cat")
    with pytest.raises(ReviewError, match="with cat now"):
        q.answer("ann", item.key, ["toxic"])
    with pytest.raises(ReviewError):
        q.answer("ann", item.key, ["nonsense"])


def test_labels_are_checked_against_the_choices(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    put(qsettings, 1)
    q = start(qsettings, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 1, "the item to arrive")
    item = q.next_item("ann")
    assert item is not None and item.choices == ("ok", "toxic")
    with pytest.raises(ReviewError, match="unknown label"):
        q.answer("ann", item.key, ["spam"])
    with pytest.raises(ReviewError, match="exactly one"):
        q.answer("ann", item.key, ["ok", "toxic"])


def test_answered_items_are_not_asked_again_after_a_restart(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    ids = put(qsettings, 4)
    q = start(qsettings, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 4, "the items to arrive")
    answered = []
    for _ in range(2):
        item = q.next_item("ann")
        assert item is not None
        q.answer("ann", item.key, ["ok"])
        answered.append(item.request.message_id)
    wait_until(lambda: q.sent == 2, "the labels to be acknowledged")
    # A console that never committed (a new group reads everything again): the two
    # answered items are recognised by their done markers and not offered.
    fresh = start(
        qsettings.model_copy(update={"group_console": f"console-{uuid.uuid4().hex[:8]}"}),
        redis_ns,
        queues,
    )
    wait_until(lambda: fresh.stats().waiting == 2, "the unanswered items in the new console")
    offered = []
    while (item := fresh.next_item("ben")) is not None:
        offered.append(item.request.message_id)
        fresh.skip("ben", item.key)
    assert sorted(offered) == sorted(set(ids) - set(answered))


def test_bad_payloads_are_dead_lettered_and_committed(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    produce_raw(qsettings, qsettings.topic_review, [(b"bad", b"{not json"), (b"b2", b"{}")])
    put(qsettings, 1)
    q = start(qsettings, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 1, "the good item")
    dead = drain(qsettings, qsettings.topic_dead_letter, lambda rs: len(rs) >= 2, timeout_s=20)
    kinds = sorted(DeadLetter.decode(r.value).error_kind for r in dead)
    assert kinds == ["invalid_json", "schema"]
    group, topic = qsettings.group_console, qsettings.topic_review
    assert committed_total(qsettings, group, topic) < 3  # the good item is still open
    item = q.next_item("ann")
    assert item is not None
    q.answer("ann", item.key, ["ok"])
    wait_until(lambda: committed_total(qsettings, group, topic) == 3, "all three committed")


def test_leaving_releases_the_claim_and_sends_held_answers(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    s = qsettings.model_copy(update={"console_undo_s": 300.0})
    put(s, 2)
    q = start(s, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 2, "the items to arrive")
    first = q.next_item("ann")
    assert first is not None
    q.answer("ann", first.key, ["toxic"])  # held for the undo window (300 s)
    second = q.next_item("ann")
    assert second is not None and q.stats().held == 1
    q.leave("ann")
    assert redis_ns.client.get(redis_ns.keys.review_claim(second.key)) is None
    (label,) = labels(s, 1)  # sent at once, not after 300 s
    assert label.message_id == first.request.message_id
    assert q.next_item("ben") is not None  # the released item is free


def request(mid: str, text: str = "some text") -> ReviewRequest:
    return ReviewRequest(
        message_id=mid,
        text=text,
        probe="toxicity",
        version=1,
        scores={"ok": 0.4, "toxic": 0.6},
        reason="uncertain",
        created_at=utcnow(),
    )


class _FlakyProducer:
    """``send`` raises the first ``failures`` times (as kafka-python does when the
    topic's metadata cannot be fetched within ``max_block_ms``), then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[tuple[str, bytes]] = []

    def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> Any:
        if self.failures:
            self.failures -= 1
            raise KafkaTimeoutError("Failed to update metadata after 60.0 secs.")
        self.sent.append((topic, value))
        return self

    def get(self, timeout: float | None = None) -> None:
        return None


def test_the_flusher_keeps_answers_whose_send_raised(
    qsettings: Settings, redis_ns: RedisNamespace
) -> None:
    """M7: an answer whose ``send()`` raised stays held and is sent on a later round."""
    q = ReviewQueue(qsettings, redis_ns.client)
    q.producer = _FlakyProducer(failures=1)
    req = request("m7-1")
    key = f"{req.probe}:{req.message_id}"
    q.items[key] = ReviewItem(
        key, req, ("ok", "toxic"), False, (), [(TopicPartition("t", 0), 0)], time.time()
    )
    assert q.next_item("ann") is not None
    q.answer("ann", key, ["toxic"])
    q._send_due()  # raises inside send(): the answer must not be lost
    assert not q.sending and q.stats().held == 1 and q.send_failures == 1
    for stack in q.held.values():  # skip the retry backoff
        for h in stack:
            h.due = 0.0
    q._send_due()
    assert len(q.producer.sent) == 1 and q.sent == 1
    assert not q.sending and q.stats().held == 0 and key not in q.items
