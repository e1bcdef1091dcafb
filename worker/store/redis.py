"""Redis connections and key namespacing.

Every key probeguard writes starts with ``{prefix}:`` (``settings.redis_prefix``),
so several deployments (or test runs) can share one server.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from worker.errors import ConfigError
from worker.settings import Settings

__all__ = ["Breaker", "Keys", "make_redis"]


def make_redis(settings: Settings, url: str | None = None, **overrides: Any) -> redis.Redis:
    """A client for ``url`` (default: ``settings.redis_url``).

    RESP2 is used on purpose: redis-py's RESP3 parser is ~8x slower on
    megabyte-sized values such as checkpoint blobs (see BROKER-NOTES).
    ``rediss://`` URLs use TLS, with ``settings.redis_ssl_ca_certs`` when set.
    """
    if url is None:
        if settings.redis_url is None:
            raise ConfigError(
                "no Redis configured: set PROBEGUARD_REDIS_URL (or REDIS_URL), "
                "or run the embedded stack with `probeguard up`"
            )
        url = settings.redis_url.get_secret_value()
    kwargs: dict[str, Any] = {
        "protocol": 2,
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_socket_timeout_s,
        "health_check_interval": 30,
        # Fail fast: one quick retry for a dropped connection. redis-py's default (10
        # retries with backoff) turns a hung server into minutes per call, stalling
        # batches and outliving the updater's lease.
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), settings.redis_retries),
    }
    if url.startswith("rediss://") and settings.redis_ssl_ca_certs is not None:
        kwargs["ssl_ca_certs"] = str(settings.redis_ssl_ca_certs)
    kwargs.update(overrides)
    try:
        return redis.Redis.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL: {exc}") from None  # the URL may hold a password


class Keys:
    """Builds namespaced Redis keys (layout in DESIGN.md)."""

    def __init__(self, prefix: str) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ConfigError(f"invalid Redis key prefix {prefix!r}")
        self.prefix = prefix

    def __call__(self, *parts: str | int) -> str:
        return ":".join([self.prefix, *(str(p) for p in parts)])

    def probe(self, probe: str, *parts: str | int) -> str:
        return self(probe, *parts)

    def text(self, message_id: str) -> str:
        return self("text", message_id)

    def pattern(self) -> str:
        """A SCAN pattern matching every key under this prefix."""
        return f"{self.prefix}:*"


class Breaker:
    """Skips best-effort Redis work for a while after a failure.

    A hung Redis costs a socket timeout per call, and the scorer makes its calls on the
    thread that polls Kafka: trying on every batch would stall scoring (and any group
    rebalance, which kafka-python drives from ``poll``) for the whole outage. Callers ask
    :meth:`ready` first, :meth:`trip` on a failure and :meth:`reset` on a success; the
    pause doubles with each failure in a row, from ``cooldown_s`` up to ``max_cooldown_s``.
    """

    def __init__(self, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0) -> None:
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.failures = 0
        self._until = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self._until

    def trip(self) -> None:
        pause = min(self.max_cooldown_s, self.cooldown_s * 2**self.failures)
        self.failures += 1
        self._until = time.monotonic() + pause

    def reset(self) -> None:
        self.failures = 0
        self._until = 0.0
