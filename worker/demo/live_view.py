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
        self._rerouted: list[tuple[logging.StreamHandler[Any], Any]] = []
        self._streams_before = (sys.stderr, sys.stdout)  # before Live replaces them

    def __enter__(self) -> LiveView:
        if self.tty:
            from rich.live import Live

            self._live = Live(self._table(), refresh_per_second=2, transient=False)
            self._live.__enter__()
            self._reroute_logs()
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
            self._restore_logs()
            self._live.__exit__(None, None, None)

    def _reroute_logs(self) -> None:
        """Send log lines through the live display, which prints them above the frame.

        A handler writing to the terminal directly moves the cursor behind rich's back:
        the next refresh then redraws too few lines up, so every refresh left a partial
        frame behind, interleaved with the log lines. While ``Live`` runs,
        ``sys.stderr``/``sys.stdout`` are its proxies; pointing the handlers at them keeps
        every line and the frame in place. (``worker.logs.StderrHandler`` follows
        ``sys.stderr`` by itself; this catches handlers bound to the terminal, e.g. a
        library's own.)
        """
        terminals = {sys.__stderr__, sys.__stdout__, *self._streams_before}
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in terminals:
                proxy = sys.stderr if handler.stream is not sys.__stdout__ else sys.stdout
                self._rerouted.append((handler, handler.setStream(proxy)))

    def _restore_logs(self) -> None:
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted.clear()

    def _table(self) -> Any:
        from rich import get_console
        from rich.table import Table

        # Never wider than the terminal: a wider frame wraps, and a wrapped frame is taller
        # than rich thinks, so it cannot be redrawn in place either.
        width = max(20, min(78, get_console().width))
        table = Table(title="probeguard demo", width=width, show_header=False, box=None)
        table.add_column("what", style="bold", width=11, no_wrap=True)
        table.add_column("value", overflow="fold")
        for name, value in rows(self.snapshot()):
            table.add_row(name, value)
        return table
