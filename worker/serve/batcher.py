"""Concurrent HTTP requests, scored together: one thread owns the scoring engine.

Each request submits its messages and gets a :class:`concurrent.futures.Future`. The
scoring thread takes the oldest request, waits until that request is ``max_wait_s`` old
for others to join it (an idle server's bounded delay; a request that already waited,
because a batch was being scored, waits no more), fills the batch up to ``max_batch``
inputs in arrival order and scores it with one pass of the LLM
(:meth:`~worker.scoring.engine.ScoringEngine.judge`; the extractor sorts by length and
splits by token budget inside). A batch holds at most ``pass_tokens`` LLM tokens (as the
caller counted them), whatever its first request: a request that costs more is scored in
passes of at most that, and what is left of it goes to the back of the queue after each
pass, behind what arrived during the pass: a request that arrived meanwhile (another
key's short one) waits for one pass, not for the whole large request. A request otherwise
never splits: one larger than ``max_batch`` inputs is scored alone. A failing batch fails
its requests (a 503), not the thread; the passes of a request that failed or expired are
dropped.

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
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry, Histogram

from schemas import ChatMessage, ProbeSpec, ReviewRequest, Verdict
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
    # (probe, version) -> the spec of each version that scored it (what its labels mean)
    specs: dict[tuple[str, int], ProbeSpec] = field(default_factory=dict)


@dataclass
class _Whole:
    """A request's results, gathered over its passes."""

    size: int
    started: bool = False
    scored: Scored = field(default_factory=lambda: Scored({}, {}))
    done: int = 0  # inputs scored so far


@dataclass
class _Pending:
    messages: Sequence[ChatMessage]
    retain: Sequence[Retain]
    future: concurrent.futures.Future[Scored]
    deadline: float = float("inf")  # time.monotonic() after which it must not be scored
    at: float = field(default_factory=time.monotonic)
    costs: Sequence[int] = ()  # LLM tokens per input (empty: one each)
    whole: _Whole = field(default_factory=lambda: _Whole(0))
    base: int = 0  # the position of messages[0] in the whole request

    @property
    def cost(self) -> int:
        return sum(self.costs) if self.costs else len(self.messages)


class MicroBatcher:
    def __init__(
        self,
        judge: Callable[[list[ChatMessage], list[Retain]], Judged],
        collector: CollectorRegistry,
        *,
        max_batch: int,
        max_wait_s: float,
        pass_tokens: int = 0,
        after: Callable[[Judged, list[ChatMessage]], None] | None = None,
    ) -> None:
        """``judge`` scores a batch; ``after`` sees every judged batch (the Kafka outbox);
        ``pass_tokens``: most tokens in one pass (0: no bound)."""
        self.judge = judge
        self.after = after
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.pass_tokens = pass_tokens
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._carry: _Pending | None = None  # taken from the queue, did not fit the batch
        self._rest: list[_Pending] = []  # what is left of a request split for this pass
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
        costs: Sequence[int] = (),
    ) -> concurrent.futures.Future[Scored]:
        """Queue a request; its future fails with :class:`Expired` if its batch starts after
        ``deadline`` (``time.monotonic()``), and is skipped if cancelled before. ``costs``:
        each input's LLM tokens, for the pass bound."""
        pending = _Pending(
            messages,
            retain,
            concurrent.futures.Future(),
            deadline,
            costs=costs,
            whole=_Whole(len(messages)),
        )
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
            for rest in self._rest:  # behind what arrived during the pass
                self._queue.put(rest)
            self._rest.clear()
        for pending in self._drain():
            if not pending.future.cancel() and not pending.future.done():
                # a later pass of a request under way: its caller must not wait forever
                pending.future.set_exception(RuntimeError("the server is stopping"))

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
        first = self._first_pass(first)
        batch, size, cost = [first], len(first.messages), first.cost
        deadline = first.at + self.max_wait_s
        while size < self.max_batch:
            nxt = self._next(deadline - time.monotonic())
            if nxt is None:
                break
            over = self.pass_tokens and cost + nxt.cost > self.pass_tokens
            if size + len(nxt.messages) > self.max_batch or over:
                self._carry = nxt  # the next batch's first
                break
            batch.append(nxt)
            size += len(nxt.messages)
            cost += nxt.cost
        return batch

    def _first_pass(self, pending: _Pending) -> _Pending:
        """``pending``'s inputs that fit one pass (at least one); the rest of it goes to
        the back of the queue once the pass is scored."""
        if not self.pass_tokens or not pending.costs or pending.cost <= self.pass_tokens:
            return pending
        k, cost = 1, pending.costs[0]
        while k < len(pending.costs) and cost + pending.costs[k] <= self.pass_tokens:
            cost += pending.costs[k]
            k += 1
        if k < len(pending.messages):
            rest = replace(
                pending,
                messages=pending.messages[k:],
                retain=pending.retain[k:],
                costs=pending.costs[k:],
                base=pending.base + k,
                at=time.monotonic(),
            )
            self._rest.append(rest)
        return replace(
            pending,
            messages=pending.messages[:k],
            retain=pending.retain[:k],
            costs=pending.costs[:k],
        )

    @staticmethod
    def _starts(p: _Pending, now: float) -> bool:
        """Whether ``p`` is scored now: its request's first pass starts (unless cancelled
        or past its deadline), or a later pass of a request still going."""
        if p.future.done():  # cancelled, or an earlier pass failed or expired
            return False
        if p.whole.started:
            return True
        if not p.future.set_running_or_notify_cancel():
            return False
        p.whole.started = True
        if now > p.deadline:
            p.future.set_exception(Expired())
            return False
        return True

    def _drain(self) -> list[_Pending]:
        out = [self._carry] if self._carry is not None else []
        out += self._rest
        self._carry = None
        self._rest = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _score(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        batch = [p for p in batch if self._starts(p, now)]
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
            n, shift = len(p.messages), p.base - offset
            own = range(offset, offset + n)
            whole = p.whole.scored
            whole.verdicts.update({i + shift: v for i, v in judged.verdicts.items() if i in own})
            whole.errors.update({i + shift: e for i, e in judged.errors.items() if i in own})
            whole.reviews += [r for i, r in judged.reviews if i in own]
            whole.specs.update(judged.scores.specs if judged.scores is not None else {})
            p.whole.done += n
            if p.whole.done >= p.whole.size:
                p.future.set_result(whole)
            offset += n
        if self.after is not None:
            try:
                self.after(judged, messages)
            except Exception:
                log.exception("handing a judged batch on failed")
