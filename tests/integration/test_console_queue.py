"""The review queue on the real broker and Redis, without a browser: claim timeouts,
abandoned screens, skips, redelivery after a restart, bad payloads, failed sends, leaving."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kafka import TopicPartition
from kafka.errors import KafkaTimeoutError
from pydantic import SecretStr

from schemas import DeadLetter, HumanLabel, ReviewRequest, utcnow
from tests.conftest import RedisNamespace
from tests.kafka_helpers import committed_total, drain, produce_raw
from tests.process_helpers import wait_until
from worker.embedded import EmbeddedRedis, free_port
from worker.errors import ReviewError
from worker.kafka.clients import ensure_topics
from worker.learning.labelers import LabelerKeys
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


def put(settings: Settings, n: int, key: bytes | None = None) -> list[str]:
    """``n`` review requests, keyed by their ids (or all by ``key``: one partition)."""
    ids = [f"q-{uuid.uuid4().hex[:6]}-{i}" for i in range(n)]
    produce_raw(
        settings,
        settings.topic_review,
        [(key or mid.encode(), request(mid, f"text {i}").encode()) for i, mid in enumerate(ids)],
    )
    return ids


def offer(q: ReviewQueue, reviewer: str, what: str, timeout_s: float) -> ReviewItem:
    """The item ``q`` offers ``reviewer`` once it offers one (asking as a page would)."""
    got: list[ReviewItem] = []

    def asked() -> bool:
        item = q.next_item(reviewer)
        got.extend([item] if item is not None else [])
        return bool(got)

    wait_until(asked, what, timeout_s)
    return got[0]


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
    q.current.pop("ann")  # ...until her page goes (the lease: see the abandoned-screen test)
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


def test_one_oversized_bad_record_costs_only_itself(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    """H1: the valid items polled with a bad record larger than a dead letter may hold
    are still offered, and the bad one is dead-lettered bounded (a prefix, its size)."""
    key, topic = b"one-partition", qsettings.topic_review
    ids = [f"h1-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    r1, r2, r3 = (request(mid).encode() for mid in ids)
    produce_raw(qsettings, topic, [(key, r1), (key, b"x" * 70_000), (key, r2), (key, r3)])
    q = start(qsettings, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 3, "the three valid items", timeout_s=20)
    (dead,) = drain(qsettings, qsettings.topic_dead_letter, lambda rs: len(rs) >= 1, 20)
    letter = DeadLetter.decode(dead.value)
    assert letter.error_kind == "invalid_json" and letter.source_offset == 1
    assert letter.payload_size == 70_000 and letter.truncated
    offered = []
    while (item := q.next_item("ann")) is not None:
        offered.append(item.request.message_id)
        q.answer("ann", item.key, ["ok"])
    assert offered == ids
    group = qsettings.group_console
    wait_until(lambda: committed_total(qsettings, group, topic) == 4, "all four committed", 20)


def test_an_abandoned_screen_frees_its_item_when_the_claim_expires(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    """H2: a tab closed without signing out holds its item only as long as the claim."""
    s = qsettings.model_copy(update={"console_claim_ttl_s": 5})
    put(s, 1)
    q = start(s, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 1, "the item to arrive")
    item = q.next_item("ann")  # ...and ann's tab is closed: no heartbeat, no sign-out
    assert item is not None and q.next_item("ben") is None
    got = offer(q, "ben", "ben's offer", 15)
    assert got.key == item.key and q.stats().claims_expired == 1
    q.answer("ben", item.key, ["ok"])
    group, topic = s.group_console, s.topic_review
    wait_until(lambda: committed_total(s, group, topic) == 1, "its offset committed", 20)
    with pytest.raises(ReviewError, match="no longer yours"):
        q.answer("ann", item.key, ["toxic"])


def test_skipped_items_do_not_stop_the_queue_at_the_cap(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    """H2: items every reviewer skipped are set aside, not counted toward the cap."""
    s = qsettings.model_copy(update={"console_max_items": 2})
    ids = put(s, 2)
    q = start(s, redis_ns, queues)
    wait_until(lambda: len(q.items) == 2, "the first two items")
    ids += put(s, 1)
    time.sleep(1.0)
    assert len(q.items) == 2  # at the cap: the consumer is paused
    skipped = []
    for _ in range(2):
        item = q.next_item("ben")
        assert item is not None
        q.skip("ben", item.key)
        skipped.append(item.request.message_id)
    got = offer(q, "ben", "the third item", 30)
    assert got.request.message_id == (set(ids) - set(skipped)).pop()


def test_a_skipped_item_goes_back_to_the_tail_and_unpins_its_partition(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    """H2: a skip hides the item from that reviewer; after ``console_skip_s`` it is put
    back at the end of the review topic (commits move past it) and offered again."""
    s = qsettings.model_copy(update={"console_skip_s": 1.0})
    first, second = put(s, 2, key=b"one-partition")
    q = start(s, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 2, "the items to arrive")
    item = q.next_item("ben")
    assert item is not None and item.request.message_id == first
    q.skip("ben", item.key)
    assert q.skipped_by("ben") == 1 and q.skipped_by("ann") == 0  # the empty page says so
    other = q.next_item("ben")
    assert other is not None and other.request.message_id == second
    q.answer("ben", other.key, ["ok"])
    group, topic = s.group_console, s.topic_review
    wait_until(lambda: committed_total(s, group, topic) >= 2, "both first offsets committed", 20)
    assert q.stats().requeued == 1
    again = offer(q, "ben", "the item again", 20)
    assert again.request.message_id == first
    q.answer("ben", again.key, ["toxic"])
    wait_until(lambda: committed_total(s, group, topic) == 3, "the copy committed too", 20)
    assert sorted(lb.message_id for lb in labels(s, 2)) == sorted([second, first])


class _FlakyProducer:
    """``send`` raises the first ``failures`` times (as kafka-python does when the
    topic's metadata cannot be fetched within ``max_block_ms``), then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[tuple[str, bytes]] = []

    def send(
        self,
        topic: str,
        key: bytes | None = None,
        value: bytes = b"",
        headers: list[tuple[str, bytes]] | None = None,
    ) -> Any:
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


def test_a_multi_head_answer_judges_every_head(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    from schemas import HeadSpec, ProbeSpec
    from worker.kafka.clients import ensure_topics

    spec = ProbeSpec(
        name="moderation",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1],
        hidden_size=8,
        task="multilabel",
        labels=["non-toxic", "toxic", "hate", "violence"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
            HeadSpec(name="hate", task="multilabel", labels=["hate"]),
            HeadSpec(name="violence", task="multilabel", labels=["violence"]),
        ],
        flag_labels=["toxic", "hate", "violence"],
    )
    put(qsettings, 2)
    ensure_topics(qsettings, partitions=2)
    q = ReviewQueue(qsettings, redis_ns.client, spec_of=lambda *_: spec).start()
    queues.append(q)
    assert q.ready.wait(30)
    wait_until(lambda: q.stats().waiting == 2, "the items to arrive")
    first = q.next_item("ann")
    assert first is not None
    assert [(h.name, h.labels, h.multiclass) for h in first.heads] == [
        ("toxicity", ("non-toxic", "toxic"), True),
        ("hate", ("hate",), False),
        ("violence", ("violence",), False),
    ]
    with pytest.raises(ReviewError, match="toxicity: choose at most one"):
        q.answer("ann", first.key, ["non-toxic", "toxic"])
    q.answer("ann", first.key, ["toxic", "hate"])
    second = q.next_item("ann")
    assert second is not None
    q.answer("ann", second.key, [])  # nothing applies: a no for every head
    sent = {lb.message_id: lb for lb in labels(qsettings, 2)}
    assert sent[first.request.message_id].labels == ["toxic", "hate"]
    assert sent[second.request.message_id].labels == []
    assert all(lb.exhaustive for lb in sent.values())


def test_a_text_over_the_default_limit_can_be_labelled(
    qsettings: Settings, redis_ns: RedisNamespace
) -> None:
    """M1: with MAX_TEXT_CHARS raised, the label for a long text is built against it (it
    used to fail validation against the default 32,000: HTTP 500, never labelled)."""
    s = qsettings.model_copy(update={"max_text_chars": 100_000})
    q = ReviewQueue(s, redis_ns.client)
    text = "a long message " * 3000  # 45,000 characters
    fields = request("m1-long").model_dump() | {"text": text}
    req = ReviewRequest.build(s.limits, **fields)
    key = f"{req.probe}:{req.message_id}"
    q.items[key] = ReviewItem(
        key, req, ("ok", "toxic"), False, (), [(TopicPartition("t", 0), 0)], time.time()
    )
    assert q.next_item("ann") is not None
    label = q.answer("ann", key, ["toxic"])
    assert label.text == text
    assert HumanLabel.decode(label.encode(), s.limits) == label


def test_the_queue_outlives_a_redis_outage_and_says_so(qsettings: Settings) -> None:
    """While Redis does not answer, review requests cannot become items: the queue keeps
    retrying, reports not ready (the console's /readyz), and takes them in once Redis is
    back, without a restart."""
    port = free_port()  # nothing listens there yet: Redis is "down" from the start
    client = redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5, protocol=2
    )
    s = qsettings.model_copy(update={"stall_not_ready_s": 0.5})
    ensure_topics(s, partitions=2)
    q = ReviewQueue(s, client).start()
    try:
        assert q.ready.wait(30)
        put(s, 3)
        wait_until(lambda: not q.readiness()[0], "the queue to say it is stuck", 30)
        assert "not answering" in q.readiness()[1] and str(port) not in q.readiness()[1]
        assert q.stats().waiting == 0 and all(t.is_alive() for t in q._threads)
        with EmbeddedRedis(port=port):
            wait_until(lambda: q.stats().waiting == 3, "the requests taken in", 60)
            assert q.readiness() == (True, "ok")
    finally:
        q.stop()
        client.close()


def test_a_redis_failure_in_the_rebalance_callback_still_forgets_the_revoked_partitions(
    qsettings: Settings,
    redis_ns: RedisNamespace,
    queues: list[ReviewQueue],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """L15: ``revoked`` released the claims (Redis) before forgetting the partitions; a
    Redis error there left the offset tracker holding partitions another console now
    owns, and a later commit could commit positions for them. (Found while testing it: a
    rebalance run inside a position lookup left them in ``_read_to`` too.)"""
    put(qsettings, 8)
    q = start(qsettings, redis_ns, queues)
    wait_until(lambda: q.stats().waiting == 8, "the items to arrive")
    taken = [q.next_item(f"r{i}") for i in range(8)]  # every item on someone's screen
    spread = {tp for item in taken if item is not None for tp, _ in item.offsets}
    assert len(spread) >= 2, "the items landed on one partition"
    assigned = len(q.consumer.assignment())
    for i, item in enumerate(taken[:4]):  # L11: skipped keys of items that move away
        assert item is not None
        q.skip(f"r{i}", item.key)

    def unreachable(item: str, reviewer: str) -> None:
        raise redis.ConnectionError("Redis went away mid-rebalance")

    q.claims.release = unreachable  # type: ignore[method-assign]
    start(qsettings, redis_ns, queues)  # a second console: one partition moves to it
    wait_until(lambda: 0 < len(q.consumer.assignment()) < assigned, "the rebalance")
    kept = set(q.consumer.assignment())

    def tracked() -> set[Any]:
        with q.lock:
            return set(q.tracker.next) | set(q.tracker.open)

    # After the loop's next commit at the latest, only partitions it owns are tracked.
    wait_until(lambda: tracked() <= kept, "revoked partitions forgotten", timeout_s=10)
    with q.lock:
        assert all(tp in kept for item in q.items.values() for tp, _ in item.offsets)
        # Nothing is remembered of items that went to the other console.
        assert all(keys <= q.items.keys() for keys in q.skipped.values()), q.skipped
    # The callback itself no longer fails (kafka-python re-raised its error into poll).
    assert not [r for r in caplog.records if "failed on_partitions_revoked" in r.getMessage()]


def test_with_labeler_keys_the_console_signs_its_reviewers_labels(
    qsettings: Settings, redis_ns: RedisNamespace, queues: list[ReviewQueue]
) -> None:
    """Issue 45: a label carries the identity the console authenticated (its reviewer),
    signed, so the updater counts each reviewer as a labeler and no producer can forge
    one."""
    secret = "console-" + "k" * 24
    s = qsettings.model_copy(update={"labeler_keys": SecretStr(f"console/*:{secret}")})
    put(s, 1)
    q = start(s, redis_ns, queues)
    item = offer(q, "ann", "the item to arrive", 30)
    q.answer("ann", item.key, ["toxic"])
    (record,) = drain(s, s.topic_labels, lambda rs: len(rs) >= 1, timeout_s=20)
    label = HumanLabel.decode(record.value)
    keys = LabelerKeys.parse(f"console/*:{secret}")
    assert keys.labeler(label, record.value, list(record.headers)) == "console/ann"
    forged = label.model_copy(update={"labeler_id": "bob"}).encode()  # same headers
    assert keys.labeler(label, forged, list(record.headers)) == "anonymous"
