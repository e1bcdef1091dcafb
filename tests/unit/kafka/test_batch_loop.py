"""The batch loop's failure rules, on an in-memory stand-in for the consumer and producer.

The real broker is in tests/integration/test_stream.py; here each rule is checked on its
own, quickly: what is produced, dead-lettered and committed when the handler or the
broker fails.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import TopicPartition
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from prometheus_client import CollectorRegistry

from schemas import ChatMessage, DeadLetter
from schemas.messages import DEAD_LETTER_PAYLOAD_BYTES
from worker.errors import TransientError
from worker.kafka.batch_loop import BatchLoop, Between, Item, Outgoing, Reject
from worker.kafka.runtime import RoleRuntime
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.settings import Settings

TOPIC = "chat"


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int = 0


def chat(i: int, text: str = "") -> bytes:
    return json.dumps(
        {
            "message_id": f"m-{i}",
            "conversation_id": "c",
            "text": text or f"message {i}",
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


class Consumer:
    """One partition; ``poll`` hands out records from the position, ``seek`` rewinds."""

    def __init__(self, values: list[bytes]) -> None:
        self.records = [Record(TOPIC, 0, i, f"k-{i}".encode(), v) for i, v in enumerate(values)]
        self.position = 0
        self.commits: list[int] = []
        self.tp = TopicPartition(TOPIC, 0)

    def poll(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Record]]:
        batch = self.records[self.position : self.position + max_records]
        self.position += len(batch)
        return {self.tp: batch} if batch else {}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.position = offset

    def assignment(self) -> set[TopicPartition]:
        return {self.tp}

    def commit(self, offsets: dict[TopicPartition, Any]) -> None:
        self.commits.append(offsets[self.tp].offset)


class Future:
    """What ``KafkaProducer.send`` returns, already resolved."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def get(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error


class Producer:
    """Acknowledges records up to ``limit`` bytes; larger ones raise like kafka-python 3.x.
    ``fail_next`` makes that many sends time out (a broker that does not answer)."""

    def __init__(self, limit: int = 1_048_576) -> None:
        self.limit = limit
        self.sent: list[tuple[str, bytes]] = []
        self.fail_next = 0

    def send(self, topic: str, key: bytes | None, value: bytes) -> Future:
        if len(value) > self.limit:
            raise MessageSizeTooLargeError(f"the message is {len(value)} bytes")
        if self.fail_next:
            self.fail_next -= 1
            return Future(KafkaTimeoutError("no answer"))
        self.sent.append((topic, value))
        return Future()

    def flush(self, timeout: float | None = None) -> None:
        pass

    def topic(self, topic: str) -> list[bytes]:
        return [v for t, v in self.sent if t == topic]


def make_loop(
    consumer: Consumer, producer: Producer, handler: Any, **kw: Any
) -> tuple[BatchLoop[ChatMessage], list[str]]:
    events: list[str] = []
    loop: BatchLoop[ChatMessage] = BatchLoop(
        consumer=consumer,
        producer=producer,
        model=ChatMessage,
        handler=handler,
        dead_letter_topic="dlq",
        worker_id="w",
        backoff_s=0.0,
        on_event=events.append,
        **kw,
    )
    return loop, events


def verdicts(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
    return [Outgoing("verdicts", i.key, i.value.message_id.encode(), source=i) for i in items]


def letters(producer: Producer) -> list[DeadLetter]:
    return [DeadLetter.decode(v) for v in producer.topic("dlq")]


def test_garbage_near_a_megabyte_is_a_bounded_letter_and_the_batch_commits_once() -> None:
    garbage = b"\xfe" * 900_000
    consumer = Consumer([chat(0), garbage, chat(2)])
    producer = Producer()
    loop, _ = make_loop(consumer, producer, verdicts)
    for _ in range(5):
        loop.run_once()
    assert producer.topic("verdicts") == [b"m-0", b"m-2"]  # sent once, never re-sent
    assert consumer.commits == [3]
    (letter,) = letters(producer)
    assert letter.payload_size == 900_000 and letter.truncated
    assert len(producer.topic("dlq")[0]) < 100_000


def test_a_refused_output_dead_letters_its_input_and_is_not_retried() -> None:
    long = chat(1, "x" * 2000)
    consumer = Consumer([chat(0), long, chat(2), chat(3)])
    producer = Producer(limit=1000)

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        return [
            Outgoing("verdicts", i.key, b"v" * (5000 if i.offset == 1 else 10), source=i)
            for i in items
        ]

    loop, events = make_loop(consumer, producer, handler)
    for _ in range(3):
        loop.run_once()
    assert len(producer.topic("verdicts")) == 3 and consumer.commits == [4]
    # The letter itself is over this producer's tiny limit: its bare fallback is sent.
    (letter,) = letters(producer)
    assert letter.error_kind == "refused" and letter.source_offset == 1
    assert letter.payload_b64 == "" and letter.payload_size == len(long)
    assert events.count("refused") == 2 and not any(e.startswith("retry") for e in events)


def test_unacknowledged_records_are_sent_again_alone_without_rerunning_the_handler() -> None:
    consumer = Consumer([chat(i) for i in range(4)])
    producer = Producer()
    producer.fail_next = 2
    calls: list[int] = []

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        calls.append(len(items))
        return verdicts(items)

    loop, events = make_loop(consumer, producer, handler)
    loop.run_once()
    assert calls == [4]
    assert sorted(producer.topic("verdicts")) == [b"m-0", b"m-1", b"m-2", b"m-3"]
    assert consumer.commits == [4] and events == ["retry_produce"]
    assert loop.stalled_s() == 0.0  # progressing again


def test_one_bad_record_costs_only_itself() -> None:
    consumer = Consumer([chat(i) for i in range(8)])
    producer = Producer()

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        if any(i.offset == 5 for i in items):
            raise ValueError("non-finite loss")
        return verdicts(items)

    loop, _ = make_loop(consumer, producer, handler, max_batch=8)
    loop.run_once()
    assert sorted(producer.topic("verdicts")) == [f"m-{i}".encode() for i in range(8) if i != 5]
    (letter,) = letters(producer)
    assert letter.error_kind == "processing" and letter.source_offset == 5
    assert "non-finite loss" in letter.error_message
    assert consumer.commits == [8]


def test_after_stop_a_failure_is_left_to_the_next_owner_not_dead_lettered() -> None:
    consumer = Consumer([chat(i) for i in range(3)])
    producer = Producer()

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        raise RuntimeError("device lost")

    loop, _ = make_loop(consumer, producer, handler)
    loop.stop()  # SIGTERM arrived
    loop.run_once()
    assert producer.sent == [] and consumer.commits == []
    assert consumer.position == 0  # rewound


def test_a_transient_failure_rewinds_and_the_loop_reports_a_stall() -> None:
    consumer = Consumer([chat(0)])
    producer = Producer()

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        raise TransientError("Redis down")

    loop, events = make_loop(consumer, producer, handler)
    loop.run_once()
    loop.run_once()
    assert producer.sent == [] and consumer.commits == [] and consumer.position == 0
    assert events == ["retry_transient", "retry_transient"]
    assert loop.stalled_s() > 0 and "Redis down" in loop.last_failure


def test_no_batch_after_between_batches_stops_the_loop() -> None:
    consumer = Consumer([chat(0)])
    producer = Producer()
    loop, _ = make_loop(consumer, producer, verdicts)
    loop.between_batches = loop.stop  # e.g. the lease was lost
    loop.run()
    assert consumer.position == 0 and producer.sent == []


def test_a_handler_rejects_by_value_and_each_reject_is_one_letter() -> None:
    consumer = Consumer([chat(0), chat(1), chat(2)])
    producer = Producer()
    kinds: list[str] = []
    attempts: list[int] = []

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing | Reject]:
        attempts.append(len(items))
        if len(attempts) == 1:
            raise RuntimeError("flaky")  # a failed attempt leaves no letter behind
        keep = [i for i in items if i.offset != 1]
        return [*verdicts(keep), Reject(items[1], "unknown_label", "no such label")]

    loop, _ = make_loop(consumer, producer, handler, on_dead_letter=kinds.append)
    loop.run_once()
    assert attempts == [3, 3]
    assert producer.topic("verdicts") == [b"m-0", b"m-2"] and consumer.commits == [3]
    (letter,) = letters(producer)
    assert letter.error_kind == "unknown_label" and letter.source_offset == 1
    assert letter.error_message == "no such label" and letter.worker_id == "w"
    assert kinds == ["unknown_label"] and loop.stats.dead_letters == 1


def test_a_rejected_large_input_is_a_bounded_letter() -> None:
    huge = chat(1, "\U0001f600" * 30_000)
    consumer = Consumer([huge])
    producer = Producer()

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing | Reject]:
        return [Reject(i, "unscorable", "too long to read " * 1000) for i in items]

    loop, _ = make_loop(consumer, producer, handler)
    loop.run_once()
    (letter,) = letters(producer)
    assert letter.error_kind == "unscorable" and letter.truncated
    assert letter.payload_size == len(huge) > DEAD_LETTER_PAYLOAD_BYTES
    assert base64.b64decode(letter.payload_b64) == huge[:DEAD_LETTER_PAYLOAD_BYTES]
    assert len(letter.error_message) == 4000 and consumer.commits == [1]


def _answers(*answers: Between | None) -> Iterator[Between | None]:
    yield from answers
    while True:
        yield Between.STOP


def test_deferred_offsets_are_committed_when_between_batches_says_so() -> None:
    consumer = Consumer([chat(i) for i in range(6)])
    producer = Producer()
    answers = _answers(Between.POLL, None, Between.COMMIT, Between.POLL)
    loop, _ = make_loop(consumer, producer, verdicts, max_batch=2, defer_commits=True)
    commits_seen: list[list[int]] = []

    def between() -> Between | None:
        commits_seen.append(list(consumer.commits))
        return next(answers)

    loop.between_batches = between
    loop.run()
    # Three batches polled; the commit comes only when asked, and covers all of them so far.
    assert commits_seen == [[], [], [], [4], [4]]
    assert consumer.commits == [4] and consumer.position == 6
    assert loop.pending  # the third batch: left for whoever publishes it (or redelivered)


def test_stop_from_between_batches_polls_no_more_and_commits_nothing() -> None:
    consumer = Consumer([chat(i) for i in range(4)])
    producer = Producer()
    answers = _answers(Between.POLL)
    loop, _ = make_loop(consumer, producer, verdicts, max_batch=2, defer_commits=True)
    loop.between_batches = lambda: next(answers)
    loop.run()
    assert consumer.position == 2 and consumer.commits == [] and loop.stop_event.is_set()


@dataclass
class Faulty:
    """A role's runtime and batch loop whose handler runs the tiny LLM, with its forward
    pass raising like torch on a device fault until :meth:`heal`."""

    runtime: RoleRuntime
    loop: BatchLoop[ChatMessage]
    producer: Producer
    extractor: HiddenStateExtractor
    healthy: Any

    def heal(self) -> None:
        self.extractor._run = self.healthy  # type: ignore[method-assign]


def device_fault(message: str, **settings: Any) -> Faulty:
    extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=16, batch_size=4)
    healthy = extractor._run

    def fault(*args: object, **kw: object) -> None:
        raise RuntimeError(message)

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        extractor.extract([i.value.text for i in items], (1,))
        return verdicts(items)

    s = Settings(metrics_port=0).model_copy(update=settings)
    runtime = RoleRuntime(s, CollectorRegistry(), role="scorer", worker_id="w")
    producer = Producer()
    loop, _ = make_loop(Consumer([chat(0), chat(1)]), producer, handler)
    runtime.loop = loop
    extractor._run = fault  # type: ignore[method-assign]
    return Faulty(runtime, loop, producer, extractor, healthy)


def test_a_sticky_device_fault_fails_liveness_after_the_configured_attempts() -> None:
    """M4: a CUDA error that lasts until the process restarts used to stall the
    partitions for good while every retry refreshed liveness. After
    ``device_faults_to_restart`` failures in a row of the batch, /healthz fails (so the
    orchestrator restarts the pod) and /readyz says why; the batch is still retried."""
    illegal = "CUDA error: an illegal memory access was encountered"
    f = device_fault(illegal, device_faults_to_restart=3)
    for attempt in range(1, 4):
        assert f.runtime.health.alive()[0], f"restarted before attempt {attempt}"
        f.runtime.health.beat()  # as the roles do before every attempt
        f.loop.run_once()
    alive, why = f.runtime.health.alive()
    assert not alive and illegal in why and "3 attempts in a row" in why
    assert f.runtime.stall() == why  # /readyz says why
    assert f.producer.sent == []  # nothing was dead-lettered: the device is at fault
    f.heal()
    f.loop.run_once()
    assert f.runtime.health.alive()[0] and f.runtime.stall() is None
    assert len(f.producer.topic("verdicts")) == 2


def test_out_of_device_memory_never_fails_liveness() -> None:
    # Out of memory may pass (another process on the device): the loop waits, not ready.
    f = device_fault("CUDA out of memory", device_faults_to_restart=1)
    for _ in range(5):
        f.loop.run_once()
    assert f.runtime.health.alive()[0] and f.loop.stalled_s() > 0


def pairs(items: list[Item[ChatMessage]], full: bool) -> list[list[Item[ChatMessage]]]:
    return [items[k : k + 2] for k in range(0, len(items), 2)]


def test_each_micro_batch_is_sent_before_the_next_is_handled_and_the_poll_commits_once() -> None:
    consumer = Consumer([chat(i) for i in range(5)])
    producer = Producer()
    sent_before: list[int] = []

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        sent_before.append(len(producer.topic("verdicts")))
        return verdicts(items)

    loop, _ = make_loop(consumer, producer, handler, split=pairs)
    assert loop.run_once() == 5
    assert sent_before == [0, 2, 4]  # micro-batches of 2, 2, 1: each out before the next
    assert consumer.commits == [5] and loop.stats.produced == 5


def test_a_transient_failure_in_a_later_micro_batch_rewinds_the_whole_poll() -> None:
    consumer = Consumer([chat(i) for i in range(4)])
    producer = Producer()
    failures = [TransientError("redis is down")]  # once, on the second micro-batch

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        if items[0].offset == 2 and failures:
            raise failures.pop()
        return verdicts(items)

    loop, _ = make_loop(consumer, producer, handler, split=pairs)
    assert loop.run_once() == 0
    assert consumer.commits == [] and consumer.position == 0  # nothing committed, rewound
    assert loop.run_once() == 4 and consumer.commits == [4]
    # At least once: the first micro-batch's verdicts went out twice, none was lost.
    assert sorted(producer.topic("verdicts")) == [b"m-0", b"m-0", b"m-1", b"m-1", b"m-2", b"m-3"]


def test_a_poison_record_in_a_micro_batch_costs_only_itself() -> None:
    consumer = Consumer([chat(i) for i in range(6)])
    producer = Producer()

    def handler(items: list[Item[ChatMessage]]) -> Sequence[Outgoing]:
        if any(i.offset == 3 for i in items):
            raise ValueError("non-finite loss")
        return verdicts(items)

    loop, _ = make_loop(consumer, producer, handler, split=pairs)
    loop.run_once()
    assert sorted(producer.topic("verdicts")) == [b"m-0", b"m-1", b"m-2", b"m-4", b"m-5"]
    assert [letter.source_offset for letter in letters(producer)] == [3]
    assert consumer.commits == [6]


def test_split_is_told_whether_the_poll_came_back_full() -> None:
    consumer = Consumer([chat(i) for i in range(5)])
    seen: list[bool] = []

    def split(items: list[Item[ChatMessage]], full: bool) -> list[list[Item[ChatMessage]]]:
        seen.append(full)
        return [items]

    loop, _ = make_loop(consumer, Producer(), verdicts, split=split, max_batch=3)
    loop.run_once()
    loop.run_once()
    assert seen == [True, False]  # 3 of 3, then the 2 left
