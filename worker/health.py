"""Prometheus metrics and the health endpoints of a long-running process.

One HTTP server per process serves ``/metrics`` (Prometheus text format),
``/healthz`` (the loop is alive: it completed an iteration recently) and
``/readyz`` (it can do its job: e.g. a probe is loaded and partitions are
assigned). Each service builds its metrics in its own ``CollectorRegistry``,
so several services can live in one process (tests, the demo).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = ["Health", "HealthServer"]

log = logging.getLogger(__name__)


class Health:
    """Liveness from a heartbeat the loop beats, and from ``fatal`` (a fault that only a
    restart clears, however often the loop beats); readiness from a callable."""

    def __init__(self, stale_after_s: float = 60.0) -> None:
        self.stale_after_s = stale_after_s
        self._beat = time.monotonic()
        self.ready_check: Callable[[], tuple[bool, str]] = lambda: (True, "ok")
        self.fatal: Callable[[], str | None] = lambda: None

    def beat(self) -> None:
        self._beat = time.monotonic()

    def alive(self) -> tuple[bool, str]:
        fatal = self.fatal()
        if fatal is not None:
            return False, fatal
        age = time.monotonic() - self._beat
        if age > self.stale_after_s:
            return False, f"loop stalled: last iteration {age:.0f}s ago"
        return True, f"ok (last iteration {age:.1f}s ago)"


class HealthServer:
    """``/metrics``, ``/healthz``, ``/readyz`` on ``host:port`` (port 0 = a free one)."""

    def __init__(
        self, registry: CollectorRegistry, health: Health, port: int, host: str = "0.0.0.0"
    ) -> None:
        self.registry = registry
        self.health = health
        handler = self._handler_class()
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> HealthServer:
        self.thread.start()
        log.info("metrics and health on :%d (/metrics /healthz /readyz)", self.port)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, generate_latest(outer.registry), CONTENT_TYPE_LATEST)
                elif self.path in ("/healthz", "/readyz"):
                    check = (
                        outer.health.alive if self.path == "/healthz" else outer.health.ready_check
                    )
                    ok, why = check()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    # The client gave up first (a scrape past its scrape_timeout while the
                    # LLM holds the CPU): nothing to answer, and no traceback on stderr.
                    self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds would drown the log

        return Handler
