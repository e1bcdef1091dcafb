"""Producing a batch's records until the broker acknowledges every one (the batch loop's
send side, :class:`Delivery`).

Apart from :mod:`worker.kafka.batch_loop` (polling, handling, committing) because its
rules stand on their own: a record not acknowledged is sent again, in place, after a
backoff; one still in flight is waited on, never sent twice; one the broker refuses
(:data:`~worker.kafka.records.REFUSED`) is replaced by its fallback or its input's dead
letter, never retried. The loop owns the counters and the dead letters; this calls back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError

from schemas import DeadLetterKind
from worker.kafka.records import REFUSED, Item, LoopStats, Outgoing

__all__ = ["Delivery", "where"]

log = logging.getLogger(__name__)


def where(item: Item[Any]) -> str:
    """``topic:partition@offset`` of an input, for logs."""
    return f"{item.topic}:{item.partition}@{item.offset}"


class Delivery:
    """Sends records and waits for their acknowledgements (see the module docstring).

    ``failed(event, why)``: a retry (it counts and stalls the loop); ``event(name)``: a
    refusal or a drop, for metrics; ``dead(item, kind, why)``: the dead letter of an input
    whose output the broker refused."""

    def __init__(
        self,
        producer: KafkaProducer,
        *,
        timeout_s: float,
        backoff_s: float,
        stop_event: threading.Event,
        stats: LoopStats,
        failed: Callable[[str, str], None],
        event: Callable[[str], None],
        dead: Callable[[Item[Any], DeadLetterKind, str], Outgoing],
    ) -> None:
        self.producer = producer
        self.timeout_s = timeout_s  # wait per acknowledgement, then retry or wait again
        self.backoff_s = backoff_s
        self.stop_event = stop_event
        self.stats = stats
        self.failed = failed
        self.event = event
        self.dead = dead

    def launch(self, out: list[Outgoing]) -> list[tuple[Outgoing, Any]]:
        """Send ``out`` without waiting (the producer's sender thread delivers it within
        its linger); each record with its future, or None where the send itself failed
        (:meth:`deliver` sends it again and says why)."""
        launched: list[tuple[Outgoing, Any]] = []
        for o in out:
            try:
                launched.append((o, self.producer.send(o.topic, key=o.key, value=o.value)))
            except KafkaError:
                launched.append((o, None))
        return launched

    def deliver(self, pending: list[tuple[Outgoing, Any]]) -> bool:
        """Wait for the acknowledgement of every record of ``pending`` (each with the future
        of its send, or None: not sent yet).

        Records the broker did not acknowledge are sent again (only they) after a backoff;
        refused ones are replaced (:meth:`_replacement`). A record still in flight after
        ``produce_timeout_s`` (the producer may yet deliver it: its own delivery timeout
        is longer) is waited on again, never sent a second time (review L9: a copy that
        was merely slow landed beside its re-send). False only when the loop was stopped
        before everything was acknowledged.
        """
        while pending:
            again: list[tuple[Outgoing, Any]] = []
            failures: list[str] = []
            for o, exc, future in self._send(pending):
                if future is not None:  # in flight: wait on the same send
                    again.append((o, future))
                    failures.append(f"still in flight after {self.timeout_s:.0f} s")
                elif isinstance(exc, REFUSED):
                    replacement = self._replacement(o, exc)
                    if replacement is not None:
                        again.append((replacement, None))
                else:
                    again.append((o, None))
                    failures.append(f"{type(exc).__name__}: {exc}")
            if failures:
                self.failed("retry_produce", failures[0])
                log.error(
                    "%d of %d records not acknowledged (%s); waiting or sending them again",
                    len(failures),
                    len(pending),
                    failures[0],
                )
                if self.stop_event.wait(self.backoff_s):
                    return False  # stopping: the next owner redoes the batch
            pending = again
        return True

    def _send(
        self, pending: list[tuple[Outgoing, Any]]
    ) -> list[tuple[Outgoing, KafkaError | None, Any]]:
        """Send the records of ``pending`` that have no send in flight yet, then wait for
        every one: those that failed, with why, and those still in flight, with their
        future (``(o, None, future)``)."""
        failed: list[tuple[Outgoing, KafkaError | None, Any]] = []
        sent = []
        for o, future in pending:
            if future is not None:
                sent.append((o, future))
                continue
            try:
                sent.append((o, self.producer.send(o.topic, key=o.key, value=o.value)))
            except KafkaError as exc:  # e.g. larger than max_request_size (3.x raises here)
                failed.append((o, exc, None))
        with contextlib.suppress(KafkaError):  # each future below says what became of its record
            self.producer.flush(self.timeout_s)
        for o, future in sent:
            try:
                future.get(timeout=self.timeout_s)
            except KafkaError as exc:
                if not getattr(future, "is_done", True):
                    failed.append((o, None, future))  # not failed: not acknowledged yet
                else:
                    failed.append((o, exc, None))
        return failed

    def _replacement(self, o: Outgoing, exc: KafkaError) -> Outgoing | None:
        """What to send instead of a record the broker refused (None: nothing can be)."""
        self.stats.refused += 1
        self.event("refused")
        why = f"{type(exc).__name__}: {exc}"
        if o.fallback is not None:
            log.error(
                "the broker refused a record for %s (%s); sending a smaller one", o.topic, why
            )
            return o.fallback
        if o.source is not None:
            log.error(
                "the broker refused a record for %s (%s); dead-lettering its input %s",
                o.topic,
                why,
                where(o.source),
            )
            return self.dead(
                o.source, "refused", f"{why} (a {len(o.value)}-byte record for {o.topic})"
            )
        self.stats.dropped += 1
        self.event("dropped")
        log.error("the broker refused a record for %s (%s); nothing to send instead", o.topic, why)
        return None
