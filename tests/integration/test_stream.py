"""The shared at-least-once batch loop against the real broker."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Sequence

import pytest

from schemas import ChatMessage, DeadLetter
from tests.kafka_helpers import drain, produce_raw
from worker.kafka.batch_loop import BatchLoop, Item, Outgoing
from worker.kafka.clients import ensure_topics, make_consumer, make_producer
from worker.settings import Settings

pytestmark = pytest.mark.integration


def chat(i: int, text: str | None = None) -> bytes:
    return json.dumps(
        {
            "message_id": f"m-{i}",
            "conversation_id": "c-1",
            "text": text if text is not None else f"message {i}",
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


POISON: list[tuple[str, bytes]] = [
    ("not json", b"this is not json"),
    ("not utf-8", b"\xff\xfe\xfd"),
    ("empty payload", b""),
    ("json array", b"[1, 2, 3]"),
    (
        "missing text",
        b'{"message_id": "p-1", "conversation_id": "c", "created_at": "2026-01-01T00:00:00Z"}',
    ),
    ("empty text", chat(10_001, "   ")),
    ("oversized text", chat(10_002, "x" * 40_000)),
    ("bad id", chat(10_003).replace(b'"m-10003"', b'"has space"')),
    ("unknown field", chat(10_004).replace(b"{", b'{"extra": 1, ', 1)),
    ("naive timestamp", chat(10_005).replace(b"12:00:00Z", b"12:00:00")),
]


def run_loop(loop: BatchLoop, until: threading.Event) -> threading.Thread:
    def target() -> None:
        while not until.is_set():
            loop.run_once()
        loop.consumer.close()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_poison_goes_to_dead_letters_and_good_messages_are_handled(settings: Settings) -> None:
    ensure_topics(
        settings, [settings.topic_chat, settings.topic_verdicts, settings.topic_dead_letter]
    )
    good = list(range(20))
    records: list[tuple[bytes | None, bytes]] = []
    for i in good:
        records.append((f"m-{i}".encode(), chat(i)))
        if i < len(POISON):
            records.append((f"p-{i}".encode(), POISON[i][1]))
    produce_raw(settings, settings.topic_chat, records)

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        return [
            Outgoing(settings.topic_verdicts, i.key, i.value.message_id.encode()) for i in items
        ]

    loop: BatchLoop[ChatMessage] = BatchLoop(
        consumer=make_consumer(settings, settings.group_scorer, [settings.topic_chat]),
        producer=make_producer(settings),
        model=ChatMessage,
        handler=handler,
        dead_letter_topic=settings.topic_dead_letter,
        worker_id="test-worker",
        max_batch=7,
    )
    done = threading.Event()
    t = run_loop(loop, done)
    try:
        out = drain(settings, settings.topic_verdicts, lambda rs: len(rs) >= len(good))
        dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= len(POISON))
    finally:
        done.set()
        t.join(20)
    assert sorted(r.value.decode() for r in out) == sorted(f"m-{i}" for i in good)
    letters = [DeadLetter.decode(r.value) for r in dead]
    assert len(letters) == len(POISON)
    payloads = {base64.b64decode(d.payload_b64) for d in letters}
    assert payloads == {p for _, p in POISON}
    by_payload = {base64.b64decode(d.payload_b64): d for d in letters}
    assert by_payload[b"this is not json"].error_kind == "invalid_json"
    assert "text" in by_payload[chat(10_001, "   ")].error_message
    assert "extra" in by_payload[POISON[8][1]].error_message
    assert all(
        d.source_topic == settings.topic_chat and d.worker_id == "test-worker" for d in letters
    )
    assert loop.stats.dead_letters == len(POISON) and loop.stats.handled == len(good)


def test_failing_handler_is_retried_then_dead_lettered(settings: Settings) -> None:
    ensure_topics(
        settings, [settings.topic_chat, settings.topic_verdicts, settings.topic_dead_letter]
    )
    produce_raw(settings, settings.topic_chat, [(b"k", chat(i)) for i in range(3)])
    calls: list[int] = []

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        calls.append(len(items))
        if any(i.value.message_id == "m-1" for i in items):
            raise RuntimeError("model exploded")
        return [Outgoing(settings.topic_verdicts, None, i.value.message_id.encode()) for i in items]

    loop: BatchLoop[ChatMessage] = BatchLoop(
        consumer=make_consumer(settings, settings.group_scorer, [settings.topic_chat]),
        producer=make_producer(settings),
        model=ChatMessage,
        handler=handler,
        dead_letter_topic=settings.topic_dead_letter,
        worker_id="w",
        max_batch=1,
        backoff_s=0.01,
    )
    done = threading.Event()
    t = run_loop(loop, done)
    try:
        out = drain(settings, settings.topic_verdicts, lambda rs: len(rs) >= 2)
        dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= 1)
    finally:
        done.set()
        t.join(20)
    assert sorted(r.value for r in out) == [b"m-0", b"m-2"]
    (letter,) = [DeadLetter.decode(r.value) for r in dead]
    assert letter.error_kind == "processing" and "model exploded" in letter.error_message
    assert calls.count(1) == 2 + 3  # two good batches, the bad one tried three times


def _per_partition(settings: Settings, topic: str, records: list[tuple[int, bytes, bytes]]) -> None:
    """Produce ``(partition, key, value)`` records, with room for values near 1 MB."""
    producer = make_producer(settings, max_request_size=2 * 1024 * 1024)
    try:
        futures = [producer.send(topic, key=k, value=v, partition=p) for p, k, v in records]
        producer.flush(30)
        for f in futures:
            f.get(timeout=30)
    finally:
        producer.close()


def test_oversized_payloads_on_every_partition_are_bounded_letters_and_no_partition_stalls(
    settings: Settings,
) -> None:
    # The operator's scenario: 900 KB of text (valid JSON, over the text limit)
    # and 900 KB of garbage on each partition, then ordinary messages. Their letters used
    # to exceed the producer's 1 MiB limit, and the loop rewound forever.
    ensure_topics(
        settings, [settings.topic_chat, settings.topic_verdicts, settings.topic_dead_letter]
    )
    parts = settings.topic_partitions
    huge_json = chat(900_000, "x" * 900_000)
    huge_garbage = b"\xff" + b"garbage " * 112_500
    records = []
    for p in range(parts):
        records.append((p, f"big-{p}".encode(), huge_json))
        records.append((p, f"junk-{p}".encode(), huge_garbage))
    good = list(range(60))
    records += [(i % parts, f"m-{i}".encode(), chat(i)) for i in good]
    _per_partition(settings, settings.topic_chat, records)

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        return [
            Outgoing(settings.topic_verdicts, i.key, i.value.message_id.encode()) for i in items
        ]

    loop: BatchLoop[ChatMessage] = BatchLoop(
        consumer=make_consumer(settings, settings.group_scorer, [settings.topic_chat]),
        producer=make_producer(settings),
        model=ChatMessage,
        handler=handler,
        dead_letter_topic=settings.topic_dead_letter,
        worker_id="w",
        max_batch=16,
        backoff_s=0.2,
    )
    done = threading.Event()
    t = run_loop(loop, done)
    try:
        out = drain(settings, settings.topic_verdicts, lambda rs: len(rs) >= len(good), 60)
        dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= 2 * parts, 30)
    finally:
        done.set()
        t.join(20)
    assert sorted(r.value.decode() for r in out) == sorted(f"m-{i}" for i in good)
    assert len(dead) == 2 * parts
    for r in dead:
        assert len(r.value) < 100_000  # bounded whatever the input
        letter = DeadLetter.decode(r.value)
        original = huge_json if r.key.startswith(b"big-") else huge_garbage
        assert letter.payload_size == len(original)
        assert letter.payload_sha256 == hashlib.sha256(original).hexdigest()
        assert original.startswith(base64.b64decode(letter.payload_b64))
    assert loop.stats.retries == 0


def test_an_output_the_broker_refuses_costs_its_own_input_only(settings: Settings) -> None:
    # A verdict larger than the producer allows (MessageSizeTooLargeError) is never a
    # reason to rewind: its input is dead-lettered as "refused", the rest is delivered
    # once, and the offsets are committed.
    ensure_topics(
        settings, [settings.topic_chat, settings.topic_verdicts, settings.topic_dead_letter]
    )
    produce_raw(settings, settings.topic_chat, [(b"k", chat(i)) for i in range(8)])

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        return [
            Outgoing(
                settings.topic_verdicts,
                i.key,
                b"x" * 2_000_000 if i.value.message_id == "m-3" else i.value.message_id.encode(),
                source=i,
            )
            for i in items
        ]

    loop: BatchLoop[ChatMessage] = BatchLoop(
        consumer=make_consumer(settings, settings.group_scorer, [settings.topic_chat]),
        producer=make_producer(settings),
        model=ChatMessage,
        handler=handler,
        dead_letter_topic=settings.topic_dead_letter,
        worker_id="w",
        max_batch=8,
        backoff_s=0.2,
    )
    done = threading.Event()
    t = run_loop(loop, done)
    try:
        dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= 1, 30)
        out = drain(settings, settings.topic_verdicts, lambda rs: len(rs) >= 7, 30)
        # Nothing more arrives: the batch was not retried.
        out = drain(settings, settings.topic_verdicts, lambda rs: len(rs) > 7, 3)
    finally:
        done.set()
        t.join(20)
    assert sorted(r.value for r in out) == sorted(f"m-{i}".encode() for i in range(8) if i != 3)
    (letter,) = [DeadLetter.decode(r.value) for r in dead]
    assert letter.error_kind == "refused" and "MessageSizeTooLarge" in letter.error_message
    assert chat(3) == base64.b64decode(letter.payload_b64)
    assert loop.stats.retries == 0 and loop.stats.refused == 1
