"""The demo's live view: a small rich table on a terminal, plain log lines elsewhere.

On a terminal the log goes to a file while the table is up (``log_file``; only warnings
and errors are still printed, above the table), so no line lands inside the frame.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["LiveView"]

log = logging.getLogger(__name__)


def _fmt(v: Any, spec: str = "") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    return format(v, spec)


def _served(s: dict[str, Any]) -> str:
    """The served F1 of the flag policy, then of each head the labels judged, over the last
    labeled messages scored (:mod:`worker.demo.quality`)."""
    if not s["window"]:
        return "– (no labeled message scored yet)"
    heads = "".join(f"   head {n} {_fmt(f1, '.2f')}" for n, f1 in s["served_f1_heads"].items())
    return f"flag policy {_fmt(s['served_f1'], '.2f')}{heads}   (last {s['window']} labeled)"


def rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """``(name, value)`` pairs that fit an 80-column terminal."""
    done = s["scored"] / s["total"] if s["total"] else 0.0
    bar = "█" * int(30 * done) + "·" * (30 - int(30 * done))
    live = s["live"]
    origin = "  (the packaged default)" if live == 0 else ""
    return [
        ("replay", f"{bar} {s['sent']}/{s['total']} sent, {s['scored']} scored"),
        ("throughput", f"{s['msg_per_s']:.1f} msg/s (last 10 s)"),
        ("latency", f"p50 {_fmt(s['p50_ms'], '.0f')} ms   p99 {_fmt(s['p99_ms'], '.0f')} ms"),
        ("probe", f"live v{_fmt(live)}{origin}   canary {_fmt(s['canary'])}"),
        ("served F1", _served(s)),
        ("labels", f"{s['labels_learned']} learned of {s['labels_sent']} sent in this run"),
        ("queues", f"review {s['reviews']}   dead letters {s['dead_letters']}"),
        ("elapsed", f"{s['elapsed_s']:.0f} s"),
    ]


class LiveView:
    """Refreshes ``snapshot()`` while the demo runs; ``tty=None`` detects the terminal."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        tty: bool | None = None,
        every_s: float = 5.0,
        log_file: Path | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.every_s = every_s
        self.log_file = log_file
        self._live: Any = None
        self._last_log = 0.0
        self._rerouted: list[tuple[logging.StreamHandler[Any], Any]] = []
        self._quieted: list[tuple[logging.Handler, int]] = []
        self._file: logging.FileHandler | None = None
        self._streams_before = (sys.stderr, sys.stdout)  # before Live replaces them

    def __enter__(self) -> LiveView:
        if self.tty:
            from rich.live import Live

            if self.log_file is not None:
                self._log_to_file(self.log_file)
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
        self._log_to_terminal()

    def _log_to_file(self, path: Path) -> None:
        """Every record to ``path`` (owner-only, appended); the terminal's handlers keep
        warnings and errors only, until :meth:`_log_to_terminal`."""
        root = logging.getLogger()
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600))
        handler = logging.FileHandler(path, encoding="utf-8")
        fmt = next((h.formatter for h in root.handlers if h.formatter is not None), None)
        handler.setFormatter(
            fmt or logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        for h in root.handlers:
            if not isinstance(h, logging.FileHandler):
                self._quieted.append((h, h.level))
                h.setLevel(max(h.level, logging.WARNING))
        root.addHandler(handler)
        self._file = handler

    def _log_to_terminal(self) -> None:
        for h, level in self._quieted:
            h.setLevel(level)
        self._quieted.clear()
        if self._file is not None:
            logging.getLogger().removeHandler(self._file)
            self._file.close()
            self._file = None

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
        if self._file is not None:
            table.add_row("log", f"{self.log_file} (warnings also above)")
        return table
