"""The metrics/health server: idle connections cost no thread each and are closed, so
anything that can reach the port cannot starve the process of threads or the probes."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from worker.health import Health, HealthServer


@contextmanager
def serving(**kw: Any) -> Iterator[HealthServer]:
    registry = CollectorRegistry()
    Counter("probeguard_test_things", "things", registry=registry).inc(3)
    server = HealthServer(registry, Health(), 0, host="127.0.0.1", **kw).start()
    try:
        yield server
    finally:
        server.stop()


def get(port: int, path: str, timeout_s: float = 1.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
        return r.status, r.read()


def test_metrics_and_health_are_served() -> None:
    with serving() as server:
        status, body = get(server.port, "/metrics")
        assert status == 200 and b"probeguard_test_things_total 3.0" in body
        assert get(server.port, "/healthz")[0] == 200
        assert get(server.port, "/readyz")[0] == 200


def test_idle_connections_hold_no_thread_and_healthz_still_answers() -> None:
    with serving() as server:
        before = threading.active_count()
        idle: list[socket.socket] = []
        try:
            for i in range(2000):
                idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
                if i % 100 == 99:  # fail early rather than spawn 2,000 threads
                    assert threading.active_count() < before + 20, f"after {i + 1} connections"
            time.sleep(0.5)  # the server has accepted them all
            assert threading.active_count() < before + 20
            t0 = time.monotonic()
            assert get(server.port, "/healthz", timeout_s=1.0)[0] == 200
            assert time.monotonic() - t0 < 1.0
            assert threading.active_count() < before + 20
        finally:
            for s in idle:
                s.close()


def test_an_idle_connection_is_closed_after_the_timeout() -> None:
    with serving(idle_timeout_s=0.3) as server:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.settimeout(3.0)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # the server hung up
        assert time.monotonic() - t0 < 2.0
        s.close()


def test_past_the_cap_the_oldest_idle_connection_makes_room() -> None:
    with serving(max_connections=8) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
        try:
            assert get(server.port, "/healthz")[0] == 200
            for s in idle[:12]:
                s.settimeout(3.0)
                assert s.recv(1) == b""  # evicted
        finally:
            for s in idle:
                s.close()


def test_an_oversized_request_head_is_refused() -> None:
    with serving() as server:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.settimeout(3.0)
        s.sendall(b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n")
        reply = s.recv(64)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 431"), reply
        s.close()
