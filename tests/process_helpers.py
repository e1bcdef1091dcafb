"""Run probeguard roles as real subprocesses (for kill/restart tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.settings import Settings

_PASS_THROUGH = (
    "kafka_bootstrap",
    "redis_prefix",
    "topic_chat",
    "topic_labels",
    "topic_verdicts",
    "topic_review",
    "topic_dead_letter",
    "group_scorer",
    "group_updater",
)


def settings_env(settings: Settings, model_dir: Path, **extra: object) -> dict[str, str]:
    """Environment giving a child process these settings, on the tiny model at ``model_dir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBEGUARD_")}
    for field in _PASS_THROUGH:
        env[f"PROBEGUARD_{field.upper()}"] = str(getattr(settings, field))
    if settings.redis_url is not None:
        env["PROBEGUARD_REDIS_URL"] = settings.redis_url.get_secret_value()
    env["PROBEGUARD_MODEL"] = str(model_dir)
    env["PROBEGUARD_CACHE_DIR"] = str(model_dir.parent / "cache")
    env["PROBEGUARD_METRICS_PORT"] = "0"
    for key, value in extra.items():
        env[f"PROBEGUARD_{key.upper()}"] = str(value)
    return env


def spawn(command: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``probeguard <command>`` with output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker.cli", command],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def tiny_model_dir(tmp_path: Path) -> tuple[Path, object]:
    """Save the tiny LLM under ``tmp_path``; returns its directory and the loaded LLM."""
    from tests.tiny_llm import make_tiny_llm

    llm = make_tiny_llm(tmp_path)
    return next(p for p in tmp_path.iterdir() if p.name.startswith("tiny-")), llm
