"""The at-least-once batch loop shared by the scorer and the updater.

    poll (bounded by count and wait) -> decode each record with its schema
      -> invalid ones become DeadLetters (with the reason and the raw bytes)
      -> the valid ones go to the handler, which returns records to produce
      -> produce everything, wait for the broker's acknowledgements
      -> only then commit the polled offsets

If producing fails, nothing is committed: the consumer seeks back to the first
offset of the batch and the batch is retried after a backoff, so a broker
outage delays work but loses none. A handler exception is retried the same
way, ``max_attempts`` times, then the batch's records are dead-lettered as
``processing`` errors and the loop moves on (one poisoned batch must not stop
the stream). Heartbeats run on kafka-python's background thread; keep
``max_batch`` small enough that a batch finishes well inside
``max_poll_interval_ms``.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import OffsetAndMetadata
from pydantic import ValidationError

from schemas import DeadLetter, DeadLetterKind, WireModel, describe_error, utcnow
from worker.errors import TransientError

__all__ = ["BatchLoop", "Item", "LoopStats", "Outgoing"]

log = logging.getLogger(__name__)

T = TypeVar("T", bound=WireModel)


@dataclass(frozen=True)
class Item(Generic[T]):
    """A decoded record and where it came from."""

    value: T
    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int


@dataclass(frozen=True)
class Outgoing:
    """A record the handler wants produced before the batch is committed."""

    topic: str
    key: bytes | None
    value: bytes


@dataclass
class LoopStats:
    batches: int = 0
    records: int = 0
    handled: int = 0
    dead_letters: int = 0
    produced: int = 0
    retries: int = 0
    commit_failures: int = 0
    last_batch_s: float = 0.0
    dead_letter_kinds: dict[str, int] = field(default_factory=dict)


class BatchLoop(Generic[T]):
    """Consume ``topic`` in a group, hand valid records to ``handler`` in batches."""

    def __init__(
        self,
        *,
        consumer: KafkaConsumer,
        producer: KafkaProducer,
        model: type[T],
        handler: Callable[[list[Item[T]]], Sequence[Outgoing]],
        dead_letter_topic: str,
        worker_id: str,
        decode: Callable[[bytes], T] | None = None,
        max_batch: int = 16,
        max_wait_ms: int = 200,
        max_attempts: int = 3,
        backoff_s: float = 1.0,
        produce_timeout_s: float = 60.0,
        between_batches: Callable[[], None] | None = None,
        on_dead_letter: Callable[[str], None] | None = None,
        defer_commits: bool = False,
    ) -> None:
        self.consumer = consumer
        self.producer = producer
        self.model = model
        self.handler = handler
        self.decode = decode or model.decode
        self.dead_letter_topic = dead_letter_topic
        self.worker_id = worker_id
        self.max_batch = max_batch
        self.max_wait_ms = max_wait_ms
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.produce_timeout_s = produce_timeout_s
        self.between_batches = between_batches
        self.on_dead_letter = on_dead_letter
        # Deferred: offsets accumulate until commit_pending() (the updater commits only
        # once a published checkpoint reflects the labels).
        self.defer_commits = defer_commits
        self.pending: dict[TopicPartition, OffsetAndMetadata] = {}
        self.stats = LoopStats()
        self.stop_event = threading.Event()

    @classmethod
    def for_topic(
        cls,
        settings: Any,
        *,
        group_id: str,
        topic: str,
        model: type[T],
        handler: Callable[[list[Item[T]]], Sequence[Outgoing]],
        worker_id: str,
        **options: Any,
    ) -> BatchLoop[T]:
        """A loop on ``topic`` in ``group_id`` with a consumer and producer from ``settings``,
        decoding with ``settings.limits`` and dead-lettering to ``settings.topic_dead_letter``."""
        from worker.kafka.clients import make_consumer, make_producer

        return cls(
            consumer=make_consumer(settings, group_id, [topic]),
            producer=make_producer(settings),
            model=model,
            decode=lambda raw: model.decode(raw, settings.limits),
            handler=handler,
            dead_letter_topic=settings.topic_dead_letter,
            worker_id=worker_id,
            max_wait_ms=settings.poll_wait_ms,
            **options,
        )

    def close(self) -> None:
        """Leave the group at once (commits nothing more) and drain the producer."""
        self.consumer.close()
        self.producer.flush(30)
        self.producer.close(30)

    # --- the loop ------------------------------------------------------------

    def run(self) -> None:
        """Run until :meth:`stop`; the batch in hand is finished and committed first."""
        while not self.stop_event.is_set():
            if self.between_batches is not None:
                self.between_batches()  # e.g. hot-swap a probe: only ever between batches
            self.run_once()

    def stop(self) -> None:
        self.stop_event.set()

    def run_once(self) -> int:
        """Poll one batch and process it to a commit. Returns the number of records."""
        polled = self.consumer.poll(timeout_ms=self.max_wait_ms, max_records=self.max_batch)
        records = [r for rs in polled.values() for r in rs]
        if not records:
            return 0
        start = time.perf_counter()
        items, dead = self._decode(records)
        attempt = 0
        while True:
            attempt += 1
            try:
                out = list(self.handler(items)) if items else []
            except TransientError as exc:
                log.warning("dependency unavailable (%s); retrying the batch later", exc)
                self.stats.retries += 1
                self._rewind(records)
                self.stop_event.wait(self.backoff_s)
                return 0
            except Exception as exc:  # the handler's failure must not kill the loop
                if attempt < self.max_attempts and not self.stop_event.is_set():
                    log.warning("handler failed (attempt %d): %s; retrying", attempt, exc)
                    self.stats.retries += 1
                    time.sleep(self.backoff_s)
                    continue
                log.exception("handler failed %d times; dead-lettering the batch", attempt)
                dead.extend(
                    self._dead(i, "processing", f"{type(exc).__name__}: {exc}") for i in items
                )
                out = []
            if self._produce([*out, *dead]):
                break
            # Not acknowledged: nothing is committed; rewind and try the whole batch again.
            self.stats.retries += 1
            self._rewind(records)
            time.sleep(self.backoff_s)
            return 0
        self._track(records)
        if not self.defer_commits:
            self.commit_pending()
        self.stats.batches += 1
        self.stats.records += len(records)
        self.stats.handled += len(items)
        self.stats.produced += len(out)
        self.stats.last_batch_s = time.perf_counter() - start
        return len(records)

    # --- steps ---------------------------------------------------------------

    def _decode(self, records: list[Any]) -> tuple[list[Item[T]], list[Outgoing]]:
        items: list[Item[T]] = []
        dead: list[Outgoing] = []
        for r in records:
            if r.value is None:
                dead.append(self._dead_record(r, "schema", "record has no value (tombstone)"))
                continue
            try:
                value = self.decode(r.value)
            except ValidationError as exc:
                kind, message = describe_error(exc)
                dead.append(self._dead_record(r, kind, message))  # type: ignore[arg-type]
                continue
            items.append(Item(value, r.topic, r.partition, r.offset, r.key, r.timestamp))
        return items, dead

    def _dead_record(self, r: Any, kind: DeadLetterKind, message: str) -> Outgoing:
        return self.dead_letter(
            r.topic, r.partition, r.offset, r.key, r.value or b"", kind, message
        )

    def _dead(self, item: Item[T], kind: DeadLetterKind, message: str) -> Outgoing:
        return self.dead_letter(
            item.topic, item.partition, item.offset, item.key, item.value.encode(), kind, message
        )

    def dead_letter(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        payload: bytes,
        kind: DeadLetterKind,
        message: str,
    ) -> Outgoing:
        """A DeadLetter record for the dead-letter topic (handlers use it for their own rejects)."""
        self.stats.dead_letters += 1
        self.stats.dead_letter_kinds[kind] = self.stats.dead_letter_kinds.get(kind, 0) + 1
        if self.on_dead_letter is not None:
            self.on_dead_letter(kind)
        letter = DeadLetter(
            source_topic=topic,
            source_partition=partition,
            source_offset=offset,
            key_b64=base64.b64encode(key).decode() if key is not None else None,
            payload_b64=base64.b64encode(payload).decode(),
            error_kind=kind,
            error_message=message[:4000],
            worker_id=self.worker_id,
            created_at=utcnow(),
        )
        log.info("dead letter %s:%d@%d %s: %s", topic, partition, offset, kind, message[:200])
        return Outgoing(self.dead_letter_topic, key, letter.encode())

    def _produce(self, out: list[Outgoing]) -> bool:
        """Send everything and wait for acknowledgements; False if any send failed."""
        if not out:
            return True
        try:
            futures = [self.producer.send(o.topic, key=o.key, value=o.value) for o in out]
            self.producer.flush(self.produce_timeout_s)
            for f in futures:
                f.get(timeout=self.produce_timeout_s)
            return True
        except KafkaError as exc:
            log.error("producing %d records failed: %s; the batch will be retried", len(out), exc)
            return False

    def _track(self, records: list[Any]) -> None:
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            nxt = r.offset + 1
            if tp not in self.pending or self.pending[tp].offset < nxt:
                self.pending[tp] = OffsetAndMetadata(nxt, "", -1)

    def commit_pending(self) -> bool:
        """Commit every offset processed so far; False if the group had moved on."""
        if not self.pending:
            return True
        offsets, self.pending = self.pending, {}
        try:
            self.consumer.commit(offsets=offsets)
            return True
        except (CommitFailedError, KafkaError) as exc:
            # The partitions moved to another member (rebalance): it re-reads from the last
            # commit, so these records may be processed twice -- never lost.
            self.stats.commit_failures += 1
            log.warning("commit failed (%s); records will be redelivered", exc)
            return False

    def _rewind(self, records: list[Any]) -> None:
        first: dict[TopicPartition, int] = {}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            first[tp] = min(first.get(tp, r.offset), r.offset)
        assigned = self.consumer.assignment()
        for tp, offset in first.items():
            if tp in assigned:
                self.consumer.seek(tp, offset)
