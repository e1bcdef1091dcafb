"""Round trip through the real broker: produce, consume in a group of two, commit, restart."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from kafka import KafkaConsumer

from schemas import ChatMessage
from worker.embedded import EmbeddedBroker
from worker.kafka.clients import (
    client_config,
    consumer_lag,
    ensure_topics,
    make_consumer,
    make_producer,
    reader_config,
)
from worker.settings import Settings

pytestmark = pytest.mark.integration


def _messages(n: int, tag: str) -> list[ChatMessage]:
    now = datetime.now(UTC)
    return [
        ChatMessage(
            message_id=f"{tag}-{i}",
            conversation_id=f"conv-{i % 7}",
            text=f"message {i} of {tag}: hello there",
            created_at=now,
        )
        for i in range(n)
    ]


def _produce(settings: Settings, topic: str, messages: list[ChatMessage]) -> None:
    producer = make_producer(settings)
    try:
        futures = [
            producer.send(topic, key=m.message_id.encode(), value=m.encode()) for m in messages
        ]
        producer.flush(30)
        for f in futures:
            f.get(timeout=30)  # raises if the broker did not acknowledge
    finally:
        producer.close()


class _Member(threading.Thread):
    """One group member: poll, decode, commit after each batch, until told to stop."""

    def __init__(self, consumer: KafkaConsumer) -> None:
        super().__init__(daemon=True)
        self.consumer = consumer
        self.seen: list[str] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = self.consumer.poll(timeout_ms=200, max_records=50)
                ids = [ChatMessage.decode(r.value).message_id for rs in batch.values() for r in rs]
                if ids:
                    self.consumer.commit()  # only after the batch was handled
                    with self.lock:
                        self.seen.extend(ids)
        except BaseException as exc:  # surfaced by the test thread
            self.error = exc
        finally:
            self.consumer.close()


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _stop(member: _Member) -> None:
    member.stop.set()
    member.join(15)
    assert not member.is_alive(), "a member did not close (still in the group)"
    assert member.error is None, member.error


@pytest.fixture
def own_broker(settings: Settings) -> Iterator[Settings]:
    """A broker of this test's own, so the group timings it checks are not shared with the
    many groups other tests leave behind on the session broker."""
    if os.environ.get("PROBEGUARD_TEST_KAFKA_BOOTSTRAP"):
        yield settings
        return
    with EmbeddedBroker() as broker:
        yield settings.model_copy(update={"kafka_bootstrap": broker.bootstrap})


def test_group_of_two_sees_everything_and_restart_resumes_at_commit(
    own_broker: Settings, group_id: str
) -> None:
    settings = own_broker
    topic = f"chat-{uuid.uuid4().hex[:8]}"
    ensure_topics(settings, [topic], partitions=4)
    members = [_Member(make_consumer(settings, group_id, [topic])) for _ in range(2)]
    for m in members:
        m.start()
    # Both members must hold partitions before we produce, so the work is really split.
    _wait(lambda: all(m.consumer.assignment() for m in members), 30, "the group to form")

    first = _messages(200, f"a{uuid.uuid4().hex[:6]}")
    _produce(settings, topic, first)
    expected = {m.message_id for m in first}
    _wait(lambda: expected <= {i for m in members for i in m.seen}, 30, "all 200 messages")
    # A rolling stop: the survivor must own every partition before it stops too. Stopping
    # the second member while the group is still rebalancing after the first left strands
    # the group on tansu (its leader stays the departed member, so a later joiner's
    # SyncGroup fails with REBALANCE_IN_PROGRESS forever); Apache Kafka elects a new leader.
    first_out, survivor = members
    _stop(first_out)
    _wait(lambda: len(survivor.consumer.assignment()) == 4, 30, "the survivor to take over")
    _stop(survivor)
    # Each member consumed a share; together they saw every message.
    assert all(m.seen for m in members)
    seen = [i for m in members for i in m.seen]
    assert set(seen) == expected

    # After commit + close, a restarted member reads only what came after.
    second = _messages(50, f"b{uuid.uuid4().hex[:6]}")
    _produce(settings, topic, second)
    consumer = make_consumer(settings, group_id, [topic])
    try:
        got: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(got) < 50:
            for rs in consumer.poll(timeout_ms=500).values():
                got.extend(ChatMessage.decode(r.value).message_id for r in rs)
        # Give any wrongly re-delivered old record a chance to show up.
        for rs in consumer.poll(timeout_ms=1000).values():
            got.extend(ChatMessage.decode(r.value).message_id for r in rs)
        assert consumer.assignment(), "the restarted member never joined the group"
        assert sorted(got) == sorted(m.message_id for m in second)
        assert sum(consumer_lag(consumer).values()) == 0
    finally:
        consumer.close()


def test_ensure_topics_is_idempotent(settings: Settings) -> None:
    topics = [settings.topic_chat, settings.topic_verdicts]
    assert sorted(ensure_topics(settings, topics, partitions=3)) == sorted(topics)
    assert ensure_topics(settings, topics, partitions=3) == []
    consumer = KafkaConsumer(**client_config(settings))
    try:
        assert consumer.partitions_for_topic(settings.topic_chat) == {0, 1, 2}
    finally:
        consumer.close()


def test_consumers_wait_for_data_as_configured(settings: Settings) -> None:
    """tansu holds a fetch for the whole wait even when a record arrives (each hop cost a
    median 129 ms at kafka-python's 500 ms default), so every consumer takes the setting."""
    assert Settings().kafka_fetch_max_wait_ms == 50
    tuned = settings.model_copy(update={"kafka_fetch_max_wait_ms": 37})
    grouped = make_consumer(tuned, f"{tuned.group_scorer}-wait", [tuned.topic_chat])
    reader = KafkaConsumer(tuned.topic_chat, **reader_config(tuned))
    try:
        assert grouped.config["fetch_max_wait_ms"] == 37
        assert reader.config["fetch_max_wait_ms"] == 37
        assert reader.config["auto_offset_reset"] == "earliest"
        assert not reader.config["enable_auto_commit"]
    finally:
        grouped.close()
        reader.close()
