"""``probeguard serve``: the scoring engine behind an HTTP API.

:class:`ModerationServer` runs the routes (:mod:`worker.serve.app`) over a
:class:`~worker.serve.service.Service` with uvicorn on a thread.

Example::

    with ModerationServer(settings, extractor, redis_client, keys=KeyRing.parse(entries)) as srv:
        print(srv.url)   # http://127.0.0.1:8400
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import platform
from typing import Any

import redis

from worker.errors import ConfigError, StackError
from worker.http_thread import HttpThread
from worker.llm.extract import HiddenStateExtractor
from worker.serve.app import create_app
from worker.serve.connections import guarded_protocol
from worker.serve.keys import KeyRing
from worker.serve.service import Service
from worker.settings import Settings

__all__ = ["ModerationServer", "is_loopback"]

log = logging.getLogger(__name__)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 * 1024 * 1024


def keep_rss_flat() -> bool:
    """Make glibc give large freed blocks back (blocks of 4 MiB and more are mapped and
    unmapped; smaller ones are trimmed from the heaps' tops). By default glibc raises that
    threshold after the first large free and keeps up to 64 MiB per thread arena: hostile
    bodies parsed on worker threads then grew RSS by ~300 MB (bench/serve_abuse.py) that
    was never returned. True when applied (glibc only)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ModerationServer:
    """The service on uvicorn, on a thread (``probeguard serve`` blocks on it)."""

    def __init__(
        self,
        settings: Settings,
        extractor: HiddenStateExtractor,
        redis_client: redis.Redis,
        *,
        keys: KeyRing | None,
        host: str | None = None,
        port: int | None = None,
    ) -> None:
        self.host = settings.serve_host if host is None else host
        self.port = settings.serve_port if port is None else port
        if keys is None or not len(keys):
            keys = None
            if not is_loopback(self.host):
                raise ConfigError(
                    f"without API keys `serve` listens on loopback only, not {self.host!r}: "
                    "set PROBEGUARD_SERVE_API_KEYS (`probeguard serve key NAME`)"
                )
        self.service = Service(settings, extractor, redis_client, keys=keys)
        self.app = create_app(self.service)
        protocol = guarded_protocol(
            header_timeout_s=settings.serve_header_timeout_s,
            max_connections=settings.serve_max_connections,
            max_per_address=settings.serve_max_connections_per_address,
            new_per_address_s=settings.serve_new_connections_per_address,
            refusal_delay_s=settings.serve_refusal_delay_s,
        )
        self.http = HttpThread(
            self.app,
            self.host,
            self.port,
            name="serve",
            port_setting="PROBEGUARD_SERVE_PORT",
            http=protocol,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ModerationServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> ModerationServer:
        keep_rss_flat()
        self.service.start()
        try:
            self.http.start(timeout_s)
        except StackError:
            self.service.stop()
            raise
        self.port = self.http.port
        log.info("moderation API at %s (/v1/moderations, /v1alpha1/comments:analyze)", self.url)
        return self

    def wait(self) -> None:
        """Block until the HTTP server exits (:meth:`stop` or a signal)."""
        self.http.wait()

    def stop(self) -> None:
        self.http.stop()
        self.service.stop()
