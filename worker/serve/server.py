"""``probeguard serve``: the scoring engine behind an HTTP API.

:class:`ModerationServer` runs the routes (:mod:`worker.serve.app`) over a
:class:`~worker.serve.service.Service` with uvicorn on a thread.

Example::

    with ModerationServer(settings, extractor, redis_client, keys=KeyRing.parse(entries)) as srv:
        print(srv.url)   # http://127.0.0.1:8400
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from typing import Any

import redis
import uvicorn

from worker.errors import ConfigError, StackError
from worker.llm.extract import HiddenStateExtractor
from worker.serve.app import create_app
from worker.serve.keys import KeyRing
from worker.serve.service import Service
from worker.settings import Settings

__all__ = ["ModerationServer", "is_loopback"]

log = logging.getLogger(__name__)


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
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ModerationServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> ModerationServer:
        self.service.start()
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,  # request lines could carry ?key=
            lifespan="off",
            server_header=False,
        )
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, name="serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise StackError(
                    f"serve could not listen on {self.host}:{self.port} "
                    "(port in use? set PROBEGUARD_SERVE_PORT)"
                )
            time.sleep(0.05)
        if self.port == 0:
            self.port = int(server.servers[0].sockets[0].getsockname()[1])
        log.info("moderation API at %s (/v1/moderations, /v1alpha1/comments:analyze)", self.url)
        return self

    def wait(self) -> None:
        """Block until the HTTP server exits (:meth:`stop` or a signal)."""
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(0.5)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.service.stop()
