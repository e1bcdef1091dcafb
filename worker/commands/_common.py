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
    "registry_redis",
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


def registry_redis(settings: Any, *, probe_given: bool = False) -> Any:
    """``make_redis(settings)`` for a command that serves, trains or operates probes.

    Refuses (:class:`~worker.errors.ConfigError`) a registry that holds versions of
    ``toxicity``, the default probe name before ``moderation``, and none of ``moderation``,
    while neither ``PROBEGUARD_PROBES`` nor ``PROBEGUARD_TRAIN_PROBE`` (nor ``probe_given``:
    a name on the command line) says which: the roles would set those versions aside and
    serve the packaged default again. An unreachable Redis is left to the command (its
    roles retry)."""
    import redis

    from worker.errors import ConfigError
    from worker.settings import DEFAULT_PROBE_NAME, LEGACY_PROBE_NAME
    from worker.store.redis import Keys, make_redis

    client = make_redis(settings)
    chosen = probe_given or {"probes", "train_probe"} & settings.model_fields_set
    if chosen or settings.probe_names != [DEFAULT_PROBE_NAME]:
        return client
    keys = Keys(settings.redis_prefix)
    try:
        legacy = client.exists(keys.next_version(LEGACY_PROBE_NAME))
        legacy = legacy and not client.exists(keys.next_version(DEFAULT_PROBE_NAME))
    except (redis.RedisError, OSError):
        return client
    if legacy:
        raise ConfigError(
            f"this registry (prefix {settings.redis_prefix!r}) holds versions of probe "
            f"{LEGACY_PROBE_NAME!r}, the default name before {DEFAULT_PROBE_NAME!r}, and none "
            f"of {DEFAULT_PROBE_NAME!r}: set PROBEGUARD_PROBES={LEGACY_PROBE_NAME} to keep "
            f"serving and training them, or PROBEGUARD_PROBES={DEFAULT_PROBE_NAME} to start "
            "that probe afresh from the packaged default"
        )
    return client


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
