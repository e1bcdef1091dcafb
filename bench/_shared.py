"""Helpers every bench script shares (imported as ``from _shared import ...``: the scripts
run as ``python bench/NAME.py``, so ``bench/`` is on ``sys.path``; pytest's ``pythonpath``
adds it for the tests that load a bench in-process)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas import LLMFingerprint, ProbeSpec
    from worker.store.checkpoints import CheckpointRegistry

__all__ = ["load_average", "log", "publish_random_probe", "rss_mb"]


def log(msg: str) -> None:
    """Progress on stderr, stamped with the time: stdout ends with the one JSON line."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages, rounded: how busy other jobs kept it."""
    return [round(x, 2) for x in os.getloadavg()]


def rss_mb(pid: int | str = "self") -> float:
    """A process's resident memory in MB (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def publish_random_probe(
    registry: CheckpointRegistry,
    spec: ProbeSpec,
    llm: LLMFingerprint,
    *,
    seed: int | None = 0,
    live: bool = True,
) -> int:
    """Publish a randomly initialised probe of ``spec`` (``seed=None``: from torch's global
    generator) on ``llm`` as the registry's next version, live unless ``live=False``;
    returns the version."""
    from probes.checkpoint import checkpoint_to_bytes
    from probes.probe import build_probe

    version = registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(build_probe(spec, seed=seed), llm=llm, version=version)
    registry.publish(blob, manifest, set_live=live)
    return version
