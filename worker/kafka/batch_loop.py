"""The at-least-once batch loop shared by the scorer and the updater.

    poll (bounded by count and wait) -> decode each record with its schema
      -> invalid ones become DeadLetters (with the reason and a bounded payload prefix)
      -> the valid ones go to the handler, one micro-batch at a time (``split``; default:
         the whole poll), which returns records to produce (:class:`Outgoing`) and the
         inputs it rejects (:class:`Reject`: dead letters)
      -> each micro-batch's records are sent as soon as it is handled (a verdict leaves
         before the rest of the poll is scored)
      -> wait for the broker's acknowledgements of everything the poll produced
      -> only then commit the polled offsets

The loop calls its role, never the other way round: a handler returns values, and
``between_batches`` answers what the loop does next (:class:`Between`: poll on, commit
what is pending, or stop).

Failures cost only what failed:

- Producing: records the broker did not acknowledge are sent again, in place (the
  handler does not run again, so nothing it produced or counted is repeated), after a
  backoff, until they are acknowledged or the loop is stopped (then nothing is
  committed and the batch is left to the next owner). A record still in flight is waited
  on, not sent twice. A broker outage delays work but loses none.
- A record the broker *refuses* (too large, invalid: :data:`REFUSED`) is never retried:
  the input it answered is dead-lettered as ``refused`` instead (and a dead letter that
  is refused is replaced by one without its payload prefix), so no input can make the
  loop rewind forever.
- A handler exception is retried ``max_attempts`` times; then the batch is split in
  halves and each half handled on its own, down to single records, so one bad record
  is dead-lettered as ``processing`` and the others are handled. After :meth:`stop`, a
  failure is not dead-lettered at all: the batch is rewound for the next owner.
- :class:`~worker.errors.TransientError` (a dependency is down): the batch is rewound
  and retried after a backoff, never dead-lettered. Sticky ones (a device fault that
  lasts until the process restarts) are counted in :attr:`BatchLoop.sticky_faults`, so
  the role can fail its liveness probe and be restarted.

While a batch cannot be completed the loop is *stalled* (:meth:`BatchLoop.stalled_s`;
roles report it on ``/readyz``); retries, refusals and commit failures are counted
in :class:`LoopStats` and passed to ``on_event`` (roles export them as metrics).
Heartbeats run on kafka-python's background thread; keep ``max_batch`` small enough
that a batch finishes well inside ``max_poll_interval_ms``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import OffsetAndMetadata
from pydantic import ValidationError

from schemas import DeadLetterKind, WireModel, describe_error
from worker.errors import TransientError
from worker.kafka.clients import close_producer
from worker.kafka.delivery import Delivery, where
from worker.kafka.records import (
    REFUSED,
    Between,
    Item,
    LoopStats,
    Outgoing,
    Reject,
    dead_letter,
)

# The record types are defined in worker.kafka.records; roles import them from here too.
__all__ = ["REFUSED", "BatchLoop", "Between", "Item", "LoopStats", "Outgoing", "Reject"]

log = logging.getLogger(__name__)

T = TypeVar("T", bound=WireModel)


class _Rewind(Exception):
    """The batch in hand is given up (to be polled again): nothing is committed."""


class BatchLoop(Generic[T]):
    """Consume ``topic`` in a group, hand valid records to ``handler`` in batches."""

    def __init__(
        self,
        *,
        consumer: KafkaConsumer,
        producer: KafkaProducer,
        model: type[T],
        handler: Callable[[list[Item[T]]], Sequence[Outgoing | Reject]],
        dead_letter_topic: str,
        worker_id: str,
        decode: Callable[[bytes], T] | None = None,
        max_batch: int = 16,
        max_wait_ms: int = 200,
        max_attempts: int = 3,
        backoff_s: float = 1.0,
        produce_timeout_s: float = 60.0,
        between_batches: Callable[[], Between | None] | None = None,
        on_dead_letter: Callable[[str], None] | None = None,
        on_event: Callable[[str], None] | None = None,
        defer_commits: bool = False,
        split: Callable[[list[Item[T]], bool], list[list[Item[T]]]] | None = None,
    ) -> None:
        """``split``: cuts a poll's valid items into micro-batches (given whether the poll
        came back full), handled and sent one after the other; None: the poll is one."""
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
        # "retry_produce", "retry_handler", "retry_transient", "commit_failure", "refused",
        # "dropped": roles count them as metrics.
        self.on_event = on_event
        # Deferred: offsets accumulate until between_batches answers Between.COMMIT (the
        # updater commits only once a published checkpoint reflects the labels).
        self.defer_commits = defer_commits
        self.split = split
        self.pending: dict[TopicPartition, OffsetAndMetadata] = {}
        self.stats = LoopStats()
        self.stop_event = threading.Event()
        # Since when the batch in hand (on these partitions) has failed to complete.
        self._stalled_since: float | None = None
        self._stalled_on: set[TopicPartition] = set()
        self.last_failure = ""
        # Sticky transient failures (see TransientError.sticky) of the batch in hand.
        self.sticky_faults = 0
        self.delivery = Delivery(
            producer,
            timeout_s=produce_timeout_s,
            backoff_s=backoff_s,
            stop_event=self.stop_event,
            stats=self.stats,
            failed=self._failed,
            event=self._event,
            dead=self._dead,
        )

    @classmethod
    def for_topic(
        cls,
        settings: Any,
        *,
        group_id: str,
        topic: str,
        model: type[T],
        handler: Callable[[list[Item[T]]], Sequence[Outgoing | Reject]],
        worker_id: str,
        consumer: KafkaConsumer | None = None,
        **options: Any,
    ) -> BatchLoop[T]:
        """A loop on ``topic`` in ``group_id`` with a consumer and producer from ``settings``,
        decoding with ``settings.limits`` and dead-lettering to ``settings.topic_dead_letter``.
        ``consumer``: one already subscribed to ``topic`` in ``group_id`` (an early join)."""
        from worker.kafka.clients import make_consumer, make_producer

        if consumer is None:
            consumer = make_consumer(settings, group_id, [topic])
        return cls(
            consumer=consumer,
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
        """Leave the group at once (commits nothing more) and drain the producer.

        Never raises for a broker that does not answer (flush times out): what was not
        acknowledged was not committed either, so the next owner redoes it; the role
        that closes the loop (e.g. an updater whose lease ended) must outlive the outage.
        """
        steps: list[Callable[[], object]] = [
            self.consumer.close,
            lambda: close_producer(self.producer, 30),
        ]
        for step in steps:
            try:
                step()
            except KafkaError as exc:
                log.warning("closing the batch loop: %s (nothing more was committed)", exc)

    # --- the loop ------------------------------------------------------------

    def run(self) -> None:
        """Run until :meth:`stop`; the batch in hand is finished and committed first."""
        while not self.stop_event.is_set():
            if self.between_batches is not None:
                # e.g. hot-swap a probe or publish a version: only ever between batches
                after = self.between_batches()
                if after is Between.STOP:
                    self.stop()
                elif after is Between.COMMIT:
                    self.commit_pending()
                if self.stop_event.is_set():
                    break  # e.g. the lease was lost: not one more batch
            self.run_once()

    def stop(self) -> None:
        """Finish the batch in hand (nothing more is dead-lettered) and poll no more.
        Safe from another thread or a signal handler."""
        self.stop_event.set()

    def stalled_s(self) -> float:
        """Seconds the batch in hand has failed to complete (0 while the loop progresses)."""
        if self._stalled_since is None:
            return 0.0
        return time.monotonic() - self._stalled_since

    def run_once(self) -> int:
        """Poll one batch and process it to a commit. Returns the number of records."""
        polled = self.consumer.poll(timeout_ms=self.max_wait_ms, max_records=self.max_batch)
        records = [r for rs in polled.values() for r in rs]
        if not records:
            self._unstall_if_revoked()
            return 0
        start = time.perf_counter()
        items, dead = self._decode(records)
        try:
            inflight = self.delivery.launch(dead)
            produced = 0
            for chunk in self._micro_batches(items, len(records) >= self.max_batch):
                out = self._handle(chunk, self.max_attempts)
                produced += len(out)
                inflight += self.delivery.launch(out)  # sent now; acknowledged before the commit
            if not self.delivery.deliver(inflight):
                raise _Rewind
        except _Rewind:
            self._rewind(records)
            return 0
        self._track(records)
        if not self.defer_commits:
            self.commit_pending()
        self._stalled_since, self._stalled_on = None, set()
        self.sticky_faults = 0
        self.stats.batches += 1
        self.stats.records += len(records)
        self.stats.handled += len(items)
        self.stats.produced += produced
        self.stats.last_batch_s = time.perf_counter() - start
        return len(records)

    # --- steps ---------------------------------------------------------------

    def _micro_batches(self, items: list[Item[T]], full: bool) -> list[list[Item[T]]]:
        if self.split is None or len(items) <= 1:
            return [items]
        return [chunk for chunk in self.split(items, full) if chunk]

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
            headers = tuple(getattr(r, "headers", None) or ())
            items.append(
                Item(
                    value,
                    r.topic,
                    r.partition,
                    r.offset,
                    r.key,
                    r.timestamp,
                    raw=r.value,
                    headers=headers,
                )
            )
        return items, dead

    def _handle(self, items: list[Item[T]], attempts: int) -> list[Outgoing]:
        """The handler's records for ``items``, its rejects as dead letters; a record it
        keeps failing on is dead-lettered alone (halving the batch until the failure is
        isolated).

        Raises :class:`_Rewind` on a :class:`TransientError`, and on any failure once the
        loop is stopping (the next owner retries; nothing is dead-lettered).
        """
        if not items:
            return []
        for attempt in range(1, attempts + 1):
            try:
                results = list(self.handler(items))
            except TransientError as exc:
                if exc.sticky:
                    self.sticky_faults += 1
                self._failed("retry_transient", f"dependency unavailable: {exc}")
                log.warning("dependency unavailable (%s); retrying the batch later", exc)
                self.stop_event.wait(self.backoff_s)
                raise _Rewind from exc
            except Exception as exc:  # the handler's failure must not kill the loop
                why = f"{type(exc).__name__}: {exc}"
                if self.stop_event.is_set():
                    self._failed("retry_handler", why)
                    log.warning("handler failed while stopping (%s); left for the next owner", why)
                    raise _Rewind from exc
                if len(items) == 1 and attempt == attempts:
                    log.exception("handler failed on %s; dead-lettering it", where(items[0]))
                    return [self._dead(items[0], "processing", why)]
                if attempt < attempts:
                    self._failed("retry_handler", why)
                    log.warning("handler failed (attempt %d): %s; retrying", attempt, why)
                    self.stop_event.wait(self.backoff_s)
                else:
                    log.warning("handler failed on %d records: %s; isolating", len(items), why)
            else:
                return [
                    self._dead(r.item, r.kind, r.reason) if isinstance(r, Reject) else r
                    for r in results
                ]
        half = len(items) // 2
        return self._handle(items[:half], 1) + self._handle(items[half:], 1)

    def _dead_record(self, r: Any, kind: DeadLetterKind, message: str) -> Outgoing:
        return self._dead_letter(
            r.topic, r.partition, r.offset, r.key, r.value or b"", kind, message
        )

    def _dead(self, item: Item[Any], kind: DeadLetterKind, message: str) -> Outgoing:
        return self._dead_letter(
            item.topic, item.partition, item.offset, item.key, item.payload, kind, message
        )

    def _dead_letter(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        payload: bytes,
        kind: DeadLetterKind,
        message: str,
    ) -> Outgoing:
        """A dead letter (decode failures, handler failures, :class:`Reject` results,
        refused outputs), counted; built by :func:`~worker.kafka.records.dead_letter`."""
        self.stats.dead_letters += 1
        self.stats.dead_letter_kinds[kind] = self.stats.dead_letter_kinds.get(kind, 0) + 1
        if self.on_dead_letter is not None:
            self.on_dead_letter(kind)
        log.info("dead letter %s:%d@%d %s: %s", topic, partition, offset, kind, message[:200])
        source = (topic, partition, offset)
        return dead_letter(
            self.dead_letter_topic, source, key, payload, kind, message, self.worker_id
        )

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
            self._event("commit_failure")
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
        self._stalled_on |= set(first)

    # --- failure accounting --------------------------------------------------

    def _failed(self, event: str, why: str) -> None:
        self.stats.retries += 1
        self._event(event)
        self.last_failure = why[:500]
        if self._stalled_since is None:
            self._stalled_since = time.monotonic()

    def _unstall_if_revoked(self) -> None:
        """Nothing in hand: not stalled any more once the stalled partitions are gone."""
        if self._stalled_since is not None and not (self._stalled_on & self.consumer.assignment()):
            self._stalled_since, self._stalled_on = None, set()
            self.sticky_faults = 0

    def _event(self, name: str) -> None:
        if self.on_event is not None:
            self.on_event(name)
