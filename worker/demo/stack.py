"""The broker and Redis a demo runs on, and the names that keep one run apart from others.

Shared by ``probeguard demo`` (:mod:`worker.demo.run`) and the chat demo
(:mod:`worker.demo.chat`): the configured services when there are any, else embedded ones
started for the run; per-run topics, consumer groups and key prefix.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from pydantic import SecretStr

from worker.embedded import EmbeddedBroker, EmbeddedRedis
from worker.settings import Settings

__all__ = ["embedded_stack", "run_names"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def embedded_stack(base: Settings, *, keep: bool = False) -> Iterator[Settings]:
    """``base`` pointed at a broker and a Redis: the configured ones
    (``PROBEGUARD_KAFKA_BOOTSTRAP``, ``PROBEGUARD_REDIS_URL``), else embedded ones started
    here and stopped at the end (``keep``: left running)."""
    broker = redis_server = None
    updates: dict[str, Any] = {}
    try:
        if "kafka_bootstrap" not in base.model_fields_set:
            broker = EmbeddedBroker().start()
            updates["kafka_bootstrap"] = broker.bootstrap
        if base.redis_url is None:
            redis_server = EmbeddedRedis().start()
            updates["redis_url"] = SecretStr(redis_server.url)  # model_copy won't convert
        yield base.model_copy(update=updates)
    finally:
        if keep:
            for name, svc in (("broker", broker), ("redis", redis_server)):
                if svc is not None:
                    log.info("--keep: %s left running (pid %s)", name, svc.pid)
        else:
            for svc in (broker, redis_server):
                if svc is not None:
                    svc.stop()


def run_names(tag: str) -> dict[str, str]:
    """Settings that give one run its own Redis key prefix, topics and consumer groups."""
    names = {"redis_prefix": tag}
    for topic in ("chat", "labels", "verdicts", "review", "dead_letter"):
        names[f"topic_{topic}"] = f"{tag}.{topic.replace('_', '-')}"
    for group in ("scorer", "updater", "console"):
        names[f"group_{group}"] = f"{tag}-{group}"
    return names
