"""Run probeguard roles as real subprocesses (for kill/restart tests)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from worker.llm.load import LoadedLLM


def spawn(
    command: str, env: dict[str, str], log: Path, module: str = "worker.cli"
) -> subprocess.Popen[bytes]:
    """``probeguard <command>`` with output appended to ``log`` (``module``: a wrapper of
    the CLI, e.g. ``tests.faults.die_at_commit``)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, command],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def tiny_model_dir(tmp_path: Path) -> tuple[Path, LoadedLLM]:
    """Save the tiny LLM under ``tmp_path``; returns its directory and the loaded LLM."""
    from worker.llm.tiny import make_tiny_llm

    llm = make_tiny_llm(tmp_path)
    return next(p for p in tmp_path.iterdir() if p.name.startswith("tiny-")), llm


class Threaded:
    """A role (scorer, updater) on a thread; :meth:`stop` joins it and re-raises nothing
    silently: an exception in the role fails the test."""

    def __init__(self, target: Callable[[], None], stop: Callable[[], None]) -> None:
        self.stop_fn = stop
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self.thread.start()

    def _run(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.stop_fn()
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None, self.error


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
