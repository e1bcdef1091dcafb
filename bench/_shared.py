"""Helpers every bench script shares (imported as ``from _shared import ...``: the scripts
run as ``python bench/NAME.py``, so ``bench/`` is on ``sys.path``)."""

from __future__ import annotations

import sys
import time

__all__ = ["log"]


def log(msg: str) -> None:
    """Progress on stderr, stamped with the time: stdout ends with the one JSON line."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
