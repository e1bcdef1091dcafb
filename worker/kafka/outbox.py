"""What the front doors without a batch loop send to Kafka, off the request path: the
verdicts and review requests of ``probeguard serve`` (``PROBEGUARD_SERVE_VERDICTS``,
``PROBEGUARD_SERVE_REVIEW``) and of the inline guard (``PROBEGUARD_GUARD_VERDICTS``,
``PROBEGUARD_GUARD_REVIEW``), encoded by :func:`~worker.kafka.judged.judged_records`.

The scoring thread hands each judged batch to :meth:`Outbox.put_judged`, which never blocks: a
bounded queue feeds one sender thread and its idempotent producer, and when the queue is
full (the broker away for long) records are dropped and counted
(``probeguard_serve_outbox_dropped_total``): an HTTP answer never waits on the broker. A
record the producer refuses (too large, say) costs only itself. Delivery is at most once:
an HTTP call has no offset to replay.

Stopping takes at most its ``timeout_s`` whatever the broker does: records still queued
are dropped and counted, the sender stops between records, and the producer is flushed
and closed within what is left of the time (a send to a broker that is away blocks up to
``max_block_ms``; the sender thread is a daemon and is not waited for beyond the bound).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from schemas import ReviewRequest, Verdict
from worker.kafka.clients import close_producer, ensure_topics, make_producer
from worker.kafka.judged import judged_records
from worker.kafka.records import Outgoing
from worker.settings import Settings

__all__ = ["Outbox"]

log = logging.getLogger(__name__)
QUEUE_RECORDS = 10_000


class Outbox:
    """``verdicts``, ``reviews``: whether each kind is sent (the role's own settings);
    ``name``: its sender thread's."""

    def __init__(
        self,
        settings: Settings,
        collector: CollectorRegistry,
        *,
        verdicts: bool,
        reviews: bool,
        name: str = "outbox",
    ) -> None:
        self.settings = settings
        self.verdict_topic = settings.topic_verdicts if verdicts else None
        self.review_topic = settings.topic_review if reviews else None
        self.name = name
        self._queue: queue.Queue[Outgoing | None] = queue.Queue(QUEUE_RECORDS)
        self._thread: threading.Thread | None = None
        self._producer: Any = None
        self._stopping = threading.Event()
        self.sent = Counter(
            "probeguard_serve_outbox_sent", "Records sent to Kafka", ["topic"], registry=collector
        )
        self.dropped = Counter(
            "probeguard_serve_outbox_dropped",
            "Records not sent to Kafka: the queue was full, the broker refused, or too large",
            ["topic"],
            registry=collector,
        )

    @property
    def topics(self) -> list[str]:
        return [t for t in (self.review_topic, self.verdict_topic) if t is not None]

    @property
    def enabled(self) -> bool:
        return bool(self.topics)

    def start(self) -> Outbox:
        if not self.enabled:
            return self
        ensure_topics(self.settings, self.topics)
        self._producer = make_producer(self.settings)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Drop what is still queued (counted), then give the sender and the producer what
        is left of ``timeout_s``: never longer, even with the broker away."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout_s
        self._stopping.set()
        self._drop_queued()
        # Wake a sender waiting for a record (when full, it sees _stopping after its send).
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        # A broker away: what was not sent is lost (at most once), and the producer is
        # closed all the same (left open, its __del__ would raise later, anywhere).
        close_producer(self._producer, max(0.0, deadline - time.monotonic()))

    def _drop_queued(self) -> None:
        while True:
            try:
                record = self._queue.get_nowait()
            except queue.Empty:
                return
            if record is not None:
                self.dropped.labels(record.topic).inc()

    def put_judged(
        self, verdicts: Mapping[int, Verdict], reviews: Iterable[tuple[int, ReviewRequest]]
    ) -> None:
        """Queue a judged batch's records, of the kinds this outbox sends (never blocks)."""
        if self._thread is None or self._stopping.is_set():
            return
        self.put(
            judged_records(
                verdicts, reviews, verdict_topic=self.verdict_topic, review_topic=self.review_topic
            )
        )

    def put(self, records: Iterable[Outgoing]) -> None:
        """Queue records (never blocks; drops and counts when full)."""
        if self._thread is None or self._stopping.is_set():
            return
        for record in records:
            try:
                self._queue.put_nowait(record)
            except queue.Full:
                self.dropped.labels(record.topic).inc()

    def _run(self) -> None:
        while not self._stopping.is_set():
            record = self._queue.get()
            if record is None or self._stopping.is_set():
                if record is not None:
                    self.dropped.labels(record.topic).inc()
                self._drop_queued()
                return
            topic = record.topic
            try:
                future = self._producer.send(topic, key=record.key, value=record.value)
                future.add_callback(lambda _m, t=topic: self.sent.labels(t).inc())
                future.add_errback(lambda exc, t=topic: self._failed(t, exc))
            except Exception as exc:  # a record the producer refuses costs only itself
                self._failed(topic, exc)

    def _failed(self, topic: str, exc: BaseException) -> None:
        self.dropped.labels(topic).inc()
        log.warning("could not send a record to %s (%s)", topic, type(exc).__name__)
