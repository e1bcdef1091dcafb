"""A chat app written against librdkafka (``confluent-kafka``), probeguard in between.

Every other integration test talks to the broker with kafka-python, the client probeguard
itself uses, so a habit of that one client could pass unnoticed. Here the chat-app side is
librdkafka, as many production services are: it produces chat messages with keys,
headers (repeated, empty, null and binary values) and lz4 compression, plus a garbage
payload, a message whose text is over the limit and a record over a megabyte; a Scorer
(in-process, on a tiny random LLM) scores them; a librdkafka consumer in a group of its
own reads what probeguard produced: one verdict per valid message keyed by its message
id, and a dead letter naming the reason for each bad one.

What this found:

- kafka-python decompresses lz4, snappy and zstd only when the codec's Python package is
  installed, and probeguard did not depend on them. With ``lz4`` (or ``zstandard``, or
  ``python-snappy``) hidden, this test's scorer raised ``UnsupportedCodecError: Libraries
  for lz4 compression codec not found`` out of ``poll`` on the first such batch and the
  role ended: a chat app producing lz4 or zstd (librdkafka's and the Java client's common
  choices) would take every scorer down, on tansu and Apache Kafka alike. That was ours,
  not the broker's: probeguard now depends on ``kafka-python[lz4,snappy,zstd]``, and each
  codec (and none) is produced below.
- Headers: probeguard neither reads nor copies them (verdicts and dead letters carry
  none); librdkafka's repeated, empty, null and binary header values round-trip through
  tansu and leave decoding alone.
- tansu handled every codec and a 1.2 MB record (larger than kafka-python's 1 MiB
  per-partition fetch size: the broker still returns it) as Apache Kafka does, once
  librdkafka's own ``message.max.bytes`` (1,000,000 by default) was raised. No broker
  limitation had to be worked around; as everywhere with tansu, the chat app's consumer
  starts from ``earliest`` with explicit commits (its "latest" offsets are wrong, see the
  broker notes).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer

from schemas import DeadLetter, Verdict
from tests.conftest import RedisNamespace
from tests.kafka_helpers import committed_total, drain
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe
from worker.kafka.clients import ensure_topics
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

CODECS = ("lz4", "zstd", "snappy", "gzip", "none")
PER_CODEC = 6  # valid messages produced with each codec
HEADERS: list[tuple[str, str | bytes | None]] = [
    ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ("content-type", b"application/json"),
    ("empty", b""),
    ("null", None),
    ("binary", bytes(range(256))),
    ("dup", b"1"),
    ("dup", b"2"),
]


def chat(message_id: str, text: str) -> bytes:
    return json.dumps(
        {
            "message_id": message_id,
            "conversation_id": "c-1",
            "text": text,
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


class ChatApp:
    """The chat app's librdkafka producer: one per compression codec, errors collected."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.errors: list[str] = []
        self.delivered = 0

    def _report(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self.errors.append(f"{msg.key()!r}: {err}")
        else:
            self.delivered += 1

    def produce(self, topic: str, codec: str, records: list[tuple[bytes, bytes]]) -> None:
        producer = Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "client.id": f"chat-app-{codec}",
                "compression.type": codec,
                "enable.idempotence": True,
                "linger.ms": 20,  # several records per batch: the batch is compressed
                "message.max.bytes": 4_000_000,
            }
        )
        for key, value in records:
            producer.produce(topic, value=value, key=key, headers=HEADERS, on_delivery=self._report)
        assert producer.flush(30) == 0, "the chat app's records were not all delivered"


@pytest.fixture
def scorer(settings: Settings, redis_ns: RedisNamespace) -> Iterator[Scorer]:
    extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=8)
    publish_probe(
        CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"), extractor.fingerprint
    )
    s = Scorer(settings, extractor, redis_ns.client, metrics_port=0)
    running = Threaded(s.run, s.stop)
    yield s
    running.stop()


Record = tuple[bytes, bytes]  # key, value


def read_back(
    settings: Settings, want_verdicts: int, want_dead: int, timeout_s: float = 90
) -> tuple[list[Record], list[Record]]:
    """The chat app's consumer, in a group of its own, on the verdicts and dead letters."""
    consumer = Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "group.id": f"chat-app-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000,
        }
    )
    verdicts: list[Record] = []
    dead: list[Record] = []
    try:
        consumer.subscribe([settings.topic_verdicts, settings.topic_dead_letter])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (
            len({key for key, _ in verdicts}) < want_verdicts or len(dead) < want_dead
        ):
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            key, value = msg.key(), msg.value()
            assert isinstance(key, bytes) and isinstance(value, bytes), (key, value)
            (verdicts if msg.topic() == settings.topic_verdicts else dead).append((key, value))
            consumer.commit(message=msg, asynchronous=False)
    finally:
        consumer.close()
    return verdicts, dead


def test_a_librdkafka_chat_app_gets_verdicts_and_dead_letters(
    settings: Settings, scorer: Scorer
) -> None:
    ensure_topics(settings)
    app = ChatApp(settings.kafka_bootstrap)
    valid: dict[str, str] = {}
    for codec in CODECS:
        batch = []
        for i in range(PER_CODEC):
            mid = f"m-{codec}-{i}"
            valid[mid] = f"hello from {codec}, number {i} · ünïcödé 🙂"
            batch.append((mid.encode(), chat(mid, valid[mid])))
        app.produce(settings.topic_chat, codec, batch)
    garbage = b"\x00\xffnot json at all"
    over_limit = chat("m-long", "spam " * 8000)  # 40,000 characters: over MAX_TEXT_CHARS
    # Over a megabyte and barely compressible (base64 of random bytes): a record larger
    # than kafka-python's per-partition fetch size, in an lz4 batch.
    huge = chat("m-huge", base64.b64encode(os.urandom(900_000)).decode())
    bad = {b"garbage": garbage, b"m-long": over_limit, b"m-huge": huge}
    app.produce(settings.topic_chat, "lz4", list(bad.items()))
    assert not app.errors, app.errors
    total = len(valid) + len(bad)
    assert app.delivered == total

    verdicts, dead = read_back(settings, len(valid), len(bad))

    # One verdict per valid message, keyed by its message id.
    by_key = {key: Verdict.decode(value) for key, value in verdicts}
    assert sorted(by_key) == sorted(mid.encode() for mid in valid)
    assert len(verdicts) == len(valid)  # no duplicates in a clean run
    assert all(v.message_id.encode() == key for key, v in by_key.items())

    # A dead letter for each bad record, keyed like it, naming the reason.
    letters = {key: DeadLetter.decode(value) for key, value in dead}
    assert sorted(letters) == sorted(bad)
    for key, letter in letters.items():
        assert letter.source_topic == settings.topic_chat
        assert letter.payload_sha256 == hashlib.sha256(bad[key]).hexdigest()
        assert letter.payload_size == len(bad[key])
        assert letter.key_b64 == base64.b64encode(key).decode()
    assert letters[b"garbage"].error_kind == "invalid_json"
    assert letters[b"m-long"].error_kind == "schema"
    assert "text" in letters[b"m-long"].error_message
    assert letters[b"m-huge"].error_kind == "schema" and letters[b"m-huge"].truncated
    # What probeguard's own client (kafka-python) saw of the headers: all of them, in order.
    sent = [(k, v.encode() if isinstance(v, str) else v) for k, v in HEADERS]
    seen = drain(settings, settings.topic_chat, lambda rs: len(rs) >= total, 30)
    assert len(seen) == total and all(r.headers == sent for r in seen)
    # The scorer committed past every record: nothing is left to redeliver.
    wait_until(
        lambda: committed_total(settings, settings.group_scorer, settings.topic_chat) == total,
        "the scorer to commit every record",
        30,
    )
    assert scorer.loop is not None and scorer.loop.stats.retries == 0
