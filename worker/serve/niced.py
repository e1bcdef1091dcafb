"""Threads at a lower CPU priority for work that a client can make the server do before it
is known to be anyone: the scrypt check of an unseen API key (~0.1 s of CPU and 16 MiB).

scrypt releases the GIL, so what a flood of wrong keys takes from the valid callers is CPU
time, not the interpreter; on Linux each thread has its own nice value, and these run at
``NICE`` above the process's, so the scoring thread and the event loop win the cores
while checks wait (``bench/serve_abuse.py --kinds wrong``). Elsewhere they run at the
process's priority.
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

__all__ = ["NICE", "NicedThreads"]

log = logging.getLogger(__name__)
NICE = 10
T = TypeVar("T")


def _lower_priority(nice: int) -> None:
    if sys.platform != "linux":  # PRIO_PROCESS names a thread only on Linux
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # e.g. a sandbox without setpriority: run at the usual priority
        log.warning("could not lower the priority of thread %s: %s", tid, exc)


class NicedThreads:
    """At most ``threads`` calls at once, each on a thread ``nice`` steps below the
    process's CPU priority."""

    def __init__(self, threads: int, name: str, nice: int = NICE) -> None:
        self._pool = ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,)
        )

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
