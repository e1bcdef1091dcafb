"""Small helpers for tests that touch Kafka: produce raw records, drain a topic, a verdict
to send."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from kafka import KafkaConsumer

from schemas import ProbeResult, Verdict, utcnow
from worker.kafka.clients import client_config, make_producer, reader_config
from worker.settings import Settings


def produce_raw(
    settings: Settings,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes]],
    headers: Callable[[bytes], list[tuple[str, bytes]] | None] | None = None,
) -> int:
    """Produce ``(key, value)`` pairs and wait for every acknowledgement; ``headers``: each
    record's headers, from its value."""
    producer = make_producer(settings)
    try:
        futures = [
            producer.send(topic, key=k, value=v, headers=headers(v) if headers else None)
            for k, v in records
        ]
        producer.flush(30)
        for f in futures:
            f.get(timeout=30)
        return len(futures)
    finally:
        producer.close()


def drain(
    settings: Settings,
    topic: str,
    until: Callable[[list[Any]], bool],
    timeout_s: float = 60.0,
) -> list[Any]:
    """Read ``topic`` from the beginning (no group) until ``until(records)`` or the timeout."""
    consumer = KafkaConsumer(topic, **reader_config(settings))
    records: list[Any] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not until(records):
            for rs in consumer.poll(timeout_ms=200).values():
                records.extend(rs)
        return records
    finally:
        consumer.close()


def committed_total(settings: Settings, group: str, topic: str) -> int:
    """The offsets ``group`` has committed on ``topic``, summed over its partitions."""
    from kafka import TopicPartition

    consumer = KafkaConsumer(**client_config(settings), group_id=group, enable_auto_commit=False)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        return sum(consumer.committed(TopicPartition(topic, p)) or 0 for p in parts)
    finally:
        consumer.close()


def allow_verdict(message_id: str) -> Verdict:
    """A verdict that allows ``message_id`` (one probe ``p`` v1, label ``ok``)."""
    result = ProbeResult(probe="p", version=1, scores={"ok": 1.0}, predicted=["ok"], flagged=False)
    return Verdict(
        verdict_id=Verdict.make_id(message_id, [result]),
        message_id=message_id,
        conversation_id="c",
        decision="allow",
        results=[result],
        latency_ms=1.0,
        worker_id="w",
        scored_at=utcnow(),
    )
