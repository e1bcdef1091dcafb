"""Concurrent HTTP requests, scored together: one thread owns the scoring engine.

Each request submits its messages and gets a :class:`concurrent.futures.Future`. The
scoring thread takes the oldest request, waits until that request is ``max_wait_s`` old
for others to join it (an idle server's bounded delay; a request that already waited,
because a batch was being scored, waits no more), fills the batch up to ``max_batch``
inputs in arrival order and scores it with one pass of the LLM
(:meth:`~worker.scoring.engine.ScoringEngine.judge`; the extractor sorts by length and
splits by token budget inside). A request never splits across batches: one larger than
``max_batch`` is scored alone. A failing batch fails its requests (a 503), not the thread.

A request past its deadline when its batch starts is failed with :class:`Expired`, never
scored: its caller has been answered 503, and scoring it anyway would cache and count
inputs the caller will send again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram

from schemas import ChatMessage, ReviewRequest, Verdict
from worker.scoring.engine import Judged, Retain

__all__ = ["Expired", "MicroBatcher", "Scored"]

log = logging.getLogger(__name__)


class Expired(Exception):
    """The request's deadline passed before its batch started: it was not scored."""


@dataclass
class Scored:
    """One request's share of a batch, by its own input positions."""

    verdicts: dict[int, Verdict]
    errors: dict[int, str]
    reviews: list[ReviewRequest] = field(default_factory=list)


@dataclass
class _Pending:
    messages: Sequence[ChatMessage]
    retain: Sequence[Retain]
    future: concurrent.futures.Future[Scored]
    deadline: float = float("inf")  # time.monotonic() after which it must not be scored
    at: float = field(default_factory=time.monotonic)


class MicroBatcher:
    def __init__(
        self,
        judge: Callable[[list[ChatMessage], list[Retain]], Judged],
        collector: CollectorRegistry,
        *,
        max_batch: int,
        max_wait_s: float,
        after: Callable[[Judged, list[ChatMessage]], None] | None = None,
    ) -> None:
        """``judge`` scores a batch; ``after`` sees every judged batch (the Kafka outbox)."""
        self.judge = judge
        self.after = after
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._carry: _Pending | None = None  # taken from the queue, did not fit the batch
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batch_inputs = Histogram(
            "probeguard_serve_batch_inputs",
            "Inputs per LLM pass",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=collector,
        )
        self.queue_seconds = Histogram(
            "probeguard_serve_queue_seconds",
            "Time from a request's arrival to the start of its batch",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=collector,
        )
        self.beat = time.monotonic()  # the thread's last iteration (liveness)

    def submit(
        self,
        messages: Sequence[ChatMessage],
        retain: Sequence[Retain],
        deadline: float = float("inf"),
    ) -> concurrent.futures.Future[Scored]:
        """Queue a request; its future fails with :class:`Expired` if its batch starts after
        ``deadline`` (``time.monotonic()``), and is skipped if cancelled before."""
        pending = _Pending(messages, retain, concurrent.futures.Future(), deadline)
        self._queue.put(pending)
        return pending.future

    def start(self) -> MicroBatcher:
        self._thread = threading.Thread(target=self._run, name="serve-scoring", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- the scoring thread --------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat = time.monotonic()
            batch = self._collect()
            if batch:
                self._score(batch)
        for pending in self._drain():
            pending.future.cancel()

    def _next(self, timeout_s: float) -> _Pending | None:
        if self._carry is not None:
            pending, self._carry = self._carry, None
            return pending
        try:
            if timeout_s > 0:
                return self._queue.get(timeout=timeout_s)
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def _collect(self) -> list[_Pending]:
        first = self._next(0.5)
        if first is None:
            return []
        batch, size = [first], len(first.messages)
        deadline = first.at + self.max_wait_s
        while size < self.max_batch:
            nxt = self._next(deadline - time.monotonic())
            if nxt is None:
                break
            if size + len(nxt.messages) > self.max_batch:
                self._carry = nxt  # the next batch's first
                break
            batch.append(nxt)
            size += len(nxt.messages)
        return batch

    def _drain(self) -> list[_Pending]:
        out = [self._carry] if self._carry is not None else []
        self._carry = None
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _score(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        batch = [p for p in batch if p.future.set_running_or_notify_cancel()]
        for p in batch:
            if now > p.deadline:
                p.future.set_exception(Expired())
        batch = [p for p in batch if not p.future.done()]
        if not batch:
            return
        messages = [m for p in batch for m in p.messages]
        retain = [r for p in batch for r in p.retain]
        for p in batch:
            self.queue_seconds.observe(now - p.at)
        self.batch_inputs.observe(len(messages))
        try:
            judged = self.judge(messages, retain)
        except Exception as exc:  # one bad batch fails its requests, never the server
            log.exception("scoring a batch of %d inputs failed", len(messages))
            for p in batch:
                p.future.set_exception(exc)
            return
        offset = 0
        for p in batch:
            n = len(p.messages)
            own = range(offset, offset + n)
            p.future.set_result(
                Scored(
                    verdicts={i - offset: v for i, v in judged.verdicts.items() if i in own},
                    errors={i - offset: e for i, e in judged.errors.items() if i in own},
                    reviews=[r for i, r in judged.reviews if i in own],
                )
            )
            offset += n
        if self.after is not None:
            try:
                self.after(judged, messages)
            except Exception:
                log.exception("handing a judged batch on failed")
