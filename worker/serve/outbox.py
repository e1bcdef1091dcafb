"""What ``probeguard serve`` sends to Kafka, off the request path: review requests
(``PROBEGUARD_SERVE_REVIEW``) and verdicts (``PROBEGUARD_SERVE_VERDICTS``).

The scoring thread hands each judged batch to :meth:`Outbox.put`, which never blocks: a
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
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from schemas import ChatMessage
from worker.kafka.clients import close_producer, ensure_topics, make_producer
from worker.scoring.engine import Judged
from worker.settings import Settings

__all__ = ["Outbox"]

log = logging.getLogger(__name__)
QUEUE_RECORDS = 10_000


class Outbox:
    def __init__(self, settings: Settings, collector: CollectorRegistry) -> None:
        self.settings = settings
        self.reviews = settings.serve_review
        self.verdicts = settings.serve_verdicts
        self._queue: queue.Queue[tuple[str, bytes, bytes] | None] = queue.Queue(QUEUE_RECORDS)
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
    def enabled(self) -> bool:
        return self.reviews or self.verdicts

    def start(self) -> Outbox:
        if not self.enabled:
            return self
        s = self.settings
        wanted = ((s.topic_review, self.reviews), (s.topic_verdicts, self.verdicts))
        ensure_topics(s, [topic for topic, on in wanted if on])
        self._producer = make_producer(s)
        self._thread = threading.Thread(target=self._run, name="serve-outbox", daemon=True)
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
                self.dropped.labels(record[0]).inc()

    def put(self, judged: Judged, messages: list[ChatMessage]) -> None:
        """Queue the batch's records (never blocks; drops and counts when full)."""
        if self._thread is None or self._stopping.is_set():
            return
        s = self.settings
        records: list[tuple[str, bytes, bytes]] = []
        if self.verdicts:
            records += [
                (s.topic_verdicts, v.message_id.encode(), v.encode())
                for v in judged.verdicts.values()
            ]
        if self.reviews:
            records += [
                (s.topic_review, r.message_id.encode(), r.encode()) for _, r in judged.reviews
            ]
        for record in records:
            try:
                self._queue.put_nowait(record)
            except queue.Full:
                self.dropped.labels(record[0]).inc()

    def _run(self) -> None:
        while not self._stopping.is_set():
            record = self._queue.get()
            if record is None or self._stopping.is_set():
                if record is not None:
                    self.dropped.labels(record[0]).inc()
                self._drop_queued()
                return
            topic, key, value = record
            try:
                future = self._producer.send(topic, key=key, value=value)
                future.add_callback(lambda _m, t=topic: self.sent.labels(t).inc())
                future.add_errback(lambda exc, t=topic: self._failed(t, exc))
            except Exception as exc:  # a record the producer refuses costs only itself
                self._failed(topic, exc)

    def _failed(self, topic: str, exc: BaseException) -> None:
        self.dropped.labels(topic).inc()
        log.warning("could not send a record to %s (%s)", topic, type(exc).__name__)
