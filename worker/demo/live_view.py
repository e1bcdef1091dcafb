"""The demo's live view: a small rich table on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LiveView"]

log = logging.getLogger(__name__)


def _fmt(v: Any, spec: str = "") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    return format(v, spec)


def rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """``(name, value)`` pairs that fit an 80-column terminal."""
    done = s["scored"] / s["total"] if s["total"] else 0.0
    bar = "█" * int(30 * done) + "·" * (30 - int(30 * done))
    return [
        ("replay", f"{bar} {s['sent']}/{s['total']} sent, {s['scored']} scored"),
        ("throughput", f"{s['msg_per_s']:.1f} msg/s (last 10 s)"),
        ("latency", f"p50 {_fmt(s['p50_ms'], '.0f')} ms   p99 {_fmt(s['p99_ms'], '.0f')} ms"),
        ("probe", f"live v{_fmt(s['live'])}   canary {_fmt(s['canary'])}"),
        (
            "learning",
            f"prequential F1 {_fmt(s['prequential_f1'], '.3f')}   "
            f"labels {s['labels_learned']}/{s['labels_sent']}",
        ),
        ("queues", f"review {s['reviews']}   dead letters {s['dead_letters']}"),
        ("elapsed", f"{s['elapsed_s']:.0f} s"),
    ]


class LiveView:
    """Refreshes ``snapshot()`` while the demo runs; ``tty=None`` detects the terminal."""

    def __init__(
        self, snapshot: Callable[[], dict[str, Any]], tty: bool | None = None, every_s: float = 5.0
    ) -> None:
        self.snapshot = snapshot
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.every_s = every_s
        self._live: Any = None
        self._last_log = 0.0

    def __enter__(self) -> LiveView:
        if self.tty:
            from rich.live import Live

            self._live = Live(self._table(), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def update(self) -> None:
        if self._live is not None:
            self._live.update(self._table())
        elif time.monotonic() - self._last_log >= self.every_s:
            self._last_log = time.monotonic()
            log.info(
                " | ".join(f"{k}: {v}" for k, v in rows(self.snapshot()) if k != "replay")
                + f" | sent {self.snapshot()['sent']}"
            )

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(title="probeguard demo", width=78, show_header=False, box=None)
        table.add_column("what", style="bold", width=11)
        table.add_column("value", width=65, overflow="fold")
        for name, value in rows(self.snapshot()):
            table.add_row(name, value)
        return table
