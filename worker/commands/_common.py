"""Small helpers shared by the commands: argument parsing, JSON output and offline error
translation for ``cache``, ``fit``, ``eval``, ``explain`` and ``probe``; ``settings_with`` and
``serve`` for the long-lived ``score``, ``train`` and ``console``."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from functools import wraps
from typing import Any

from worker.errors import OfflineError

__all__ = [
    "layer_list",
    "offline_errors",
    "print_json",
    "serve",
    "settings_with",
    "until_signalled",
]


def layer_list(value: str) -> list[int] | None:
    """``"4,8,12"`` or ``"2-5"`` -> layers; ``"auto"`` -> None (the command's default);
    ``"none"`` -> []."""
    value = value.strip().lower()
    if value == "auto":
        return None
    if value in ("none", ""):
        return []
    out: set[int] = set()
    try:
        for part in value.split(","):
            if "-" in part:
                a, b = part.split("-", 1)
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(part))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not a layer list: {value!r} (try 4,8,12 or 2-5)"
        ) from exc
    return sorted(out)


def offline_errors(
    func: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Turn the probe library's errors into :class:`OfflineError` for the CLI's handler."""

    @wraps(func)
    def run(args: argparse.Namespace) -> int:
        from probes.errors import ProbeError

        try:
            return func(args)
        except ProbeError as exc:
            raise OfflineError(str(exc)) from exc

    return run


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def print_json(obj: Any) -> None:
    """One JSON object on one line (NaN/inf as null, so any JSON parser reads it)."""
    print(json.dumps(_clean(obj), separators=(",", ":"), allow_nan=False))


def settings_with(**overrides: Any) -> Any:
    """Settings from the environment, with the command line's options (those given) winning."""
    from worker.settings import load_settings

    return load_settings(**{k: v for k, v in overrides.items() if v is not None})


def serve(role: Any, what: str) -> int:
    """Run a long-lived role (scorer, updater) until SIGTERM/SIGINT asks it to stop.

    ``role`` has ``run()`` and ``stop()``; ``stop`` must be safe from a signal handler.
    """
    import logging
    import signal

    def _stop(signum: int, _frame: object) -> None:
        logging.getLogger(__name__).info("%s: %s", signal.Signals(signum).name, what)
        role.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    role.run()
    return 0


def until_signalled() -> None:
    """Block until SIGINT or SIGTERM (for servers running on threads: console, serve)."""
    import signal
    import threading

    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
