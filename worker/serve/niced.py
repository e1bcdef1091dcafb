"""Work that a client can make the server do before it is known to be anyone, at the
lowest CPU priority: the scrypt check of an unseen API key (~0.1 s of CPU and 16 MiB), and
the first check of a large body (:mod:`worker.serve.bodies`, in worker processes).

Such work runs under Linux's ``SCHED_IDLE`` policy, which takes a core only when nothing
else of the machine's wants it: the scoring thread, the event loop and the valid callers'
requests preempt it the moment they wake. Plain niceness (``NICE`` steps) still gave it
slices of a few milliseconds that the valid callers' requests waited behind
(``bench/serve_abuse.py``). Each thread has its own policy and nice value on Linux; where
``SCHED_IDLE`` is refused, the work runs ``NICE`` steps below the process, and elsewhere at
the process's priority. Under a saturated server such work waits until the server has a
moment: a flood of large bodies is what waits, not the callers who send small ones.

Such work is also rationed (:class:`Rationed`): a bounded number of pieces waiting or
running, each waited for at most ``PROBEGUARD_SERVE_TIMEOUT_S``. While other processes keep
every core busy (a scorer, a build beside the server), ``SCHED_IDLE`` work gets no CPU at
all: without the deadline, its callers waited as long as the machine stayed busy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from worker.serve.errors import ApiError

__all__ = ["NICE", "NicedThreads", "Rationed", "lower_priority"]

log = logging.getLogger(__name__)
NICE = 10
T = TypeVar("T")


def lower_priority(nice: int = NICE) -> None:
    """Put the calling thread under ``SCHED_IDLE`` and ``nice`` steps below its priority
    (a thread pool's or a worker process's initializer)."""
    if sys.platform != "linux":  # PRIO_PROCESS names a thread only on Linux
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # e.g. a sandbox without setpriority: run at the usual priority
        log.warning("could not lower the priority of thread %s: %s", tid, exc)


class NicedThreads:
    """At most ``threads`` calls at once, each on a thread ``nice`` steps below the
    process's CPU priority."""

    def __init__(self, threads: int, name: str, nice: int = NICE) -> None:
        self._pool = ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=lower_priority, initargs=(nice,)
        )

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Rationed:
    """Places for the work above: at most ``places`` pieces waiting for, or running on,
    the lowered threads or processes (one more is a 503 ``busy``), each waited for at most
    ``timeout_s`` (then a 503 ``timeout``). A piece gives its place back when it ends, not
    when its caller stops waiting: one not started is dropped, one started runs out and
    holds its place meanwhile, so what such work holds stays bounded."""

    def __init__(self, places: int, timeout_s: float, *, what: str, busy: str) -> None:
        self.places = places
        self.timeout_s = timeout_s
        self._what = what  # "the body": what was not checked in time
        self._busy = busy  # the message of the 503 when every place is taken
        self._lock = threading.Lock()  # places are given back on the pools' threads
        self.taken = 0

    def take(self, *, hold: bool = True) -> None:
        """A place, or a 503 ``busy`` (``hold=False``: the same answer, no place taken)."""
        with self._lock:
            if self.taken >= self.places:
                raise ApiError(503, self._busy, code="busy", retry_after_s=1.0)
            self.taken += int(hold)

    def give(self, _: object = None) -> None:
        """A place back (a future's done-callback)."""
        with self._lock:
            self.taken -= 1

    async def run(self, submit: Callable[[], Future[T]]) -> T:
        """In a place: ``submit()``'s future (it starts the work on a lowered pool), waited
        for as :meth:`wait` does; the place is given back if ``submit`` fails."""
        self.take()
        try:
            future = submit()
        except BaseException:
            self.give()
            raise
        return await self.wait(future)

    async def wait(self, future: Future[T]) -> T:
        """``future``'s result (it holds a place :meth:`take` gave), or a 503 ``timeout``."""
        future.add_done_callback(self.give)  # also when cancelled below
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise ApiError(
                503,
                f"{self._what} was not checked within {self.timeout_s:g}s "
                "(PROBEGUARD_SERVE_TIMEOUT_S): the server is busy; try again",
                code="timeout",
                retry_after_s=1.0,
            ) from None
