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
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["NICE", "NicedThreads", "lower_priority"]

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

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
