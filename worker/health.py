"""Prometheus metrics and the health endpoints of a long-running process.

One HTTP server per process serves ``/metrics`` (Prometheus text format),
``/healthz`` (the loop is alive: it completed an iteration recently) and
``/readyz`` (it can do its job: e.g. a probe is loaded and partitions are
assigned). Each service builds its metrics in its own ``CollectorRegistry``,
so several services can live in one process (tests, the demo).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

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
    """``/metrics``, ``/healthz``, ``/readyz`` on ``host:port`` (port 0 = a free one).

    One asyncio loop on one thread serves every connection: the port is reachable by
    anything in the cluster (Prometheus scrapes it), so a connection that sends nothing
    must cost no thread (a thread per connection let a few thousand idle sockets exhaust
    the process's threads, and with them the updater's lease keeper and Kafka's own).
    A request head must arrive within ``idle_timeout_s`` and fit ``_MAX_HEAD`` bytes; past
    ``max_connections`` the oldest connection still sending its head is dropped, so a
    kubelet probe or a scrape always gets in. Responses close the connection.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Health,
        port: int,
        host: str = "0.0.0.0",
        *,
        idle_timeout_s: float = 5.0,
        max_connections: int = 256,
    ) -> None:
        self.registry = registry
        self.health = health
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._loop = asyncio.new_event_loop()
        # Bound now, so that the port is known (and a port in use fails) before start().
        self._socket = socket.create_server((host, port), backlog=1024)
        self._reading: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        self._server: asyncio.AbstractServer | None = None
        # Metrics collection may call out (gauges read state under locks): off the loop,
        # on a small fixed pool, so a slow collector delays scrapes, not the health probes.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="metrics")
        self.thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    def start(self) -> HealthServer:
        self.thread.start()
        log.info("metrics and health on :%d (/metrics /healthz /readyz)", self.port)
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self.thread.join(10.0)
        else:
            self._socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, sock=self._socket, limit=_MAX_HEAD)
        )
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for writer in list(self._reading):
                writer.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reading[writer] = None
        while len(self._reading) > self.max_connections:
            oldest, _ = self._reading.popitem(last=False)
            oldest.close()
        try:
            try:
                head = await asyncio.wait_for(
                    reader.readuntil(b"\r\n\r\n"), timeout=self.idle_timeout_s
                )
            except asyncio.LimitOverrunError:
                await self._reply(writer, 431, b"request header too large\n", "text/plain")
                return
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return  # idle, evicted, or the client hung up first
            finally:
                self._reading.pop(writer, None)
            code, body, ctype = await self._answer(head)
            await self._reply(writer, code, body, ctype)
        except (ConnectionError, TimeoutError):
            pass  # the client gave up first (a scrape past its scrape_timeout)
        finally:
            writer.close()

    async def _answer(self, head: bytes) -> tuple[int, bytes, str]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"GET":
            return 405, b"only GET\n", "text/plain"
        path = parts[1].decode("latin-1")
        if path == "/metrics":
            body = await self._loop.run_in_executor(self._pool, generate_latest, self.registry)
            return 200, body, CONTENT_TYPE_LATEST
        if path in ("/healthz", "/readyz"):
            check = self.health.alive if path == "/healthz" else self.health.ready_check
            ok, why = check()
            return (200 if ok else 503), (why + "\n").encode(), "text/plain"
        return 404, b"not found\n", "text/plain"

    async def _reply(
        self, writer: asyncio.StreamWriter, code: int, body: bytes, ctype: str
    ) -> None:
        head = (
            f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + body)
        # A reader that never drains must not hold the connection open forever either.
        await asyncio.wait_for(writer.drain(), timeout=self.idle_timeout_s)


_MAX_HEAD = 16 * 1024  # bytes: a scrape's request head is a few hundred
