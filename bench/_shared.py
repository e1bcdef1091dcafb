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
    import torch

    from probes.offline.dataset import ProbeDataset

__all__ = ["load_average", "log", "rss_mb", "updater_states"]


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


def updater_states(data: ProbeDataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [L, B, T, D], mask [B, T])`` of rows ``idx`` of a cache's dataset, as the
    updater's extractor gives them to :meth:`OnlineLearner.learn`. Per-layer mean summaries
    come as one token each: a mean over one token is the summary itself, so a mean-pool
    probe learns exactly what it would from the tokens."""
    import torch

    hidden, mask, _ = data.batch(idx)
    if mask is None:  # summaries [L, B, D]
        return hidden[:, :, None, :], torch.ones(hidden.shape[1], 1, dtype=torch.bool)
    return hidden, mask
