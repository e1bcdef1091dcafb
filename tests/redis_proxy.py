"""A TCP proxy in front of the test Redis that can hold back one reply (a lost reply).

Review L8: when the reply to a command is lost to a socket timeout after Redis already
ran it, redis-py's ``Retry`` sends the command again. :meth:`LaggyProxy.delay_next`
arms the proxy: the reply to the next command whose request contains ``trigger`` (e.g.
``b"EVALSHA"``) is held for ``delay_s`` (past the client's socket timeout), so the client
gives up on that connection and retries on a new one, after the command has run.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

__all__ = ["LaggyProxy"]


class LaggyProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._trigger: bytes | None = None
        self._delay_s = 0.0
        self.delayed = 0  # replies held back so far
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def delay_next(self, trigger: bytes, delay_s: float) -> None:
        with self._lock:
            self._trigger, self._delay_s = trigger, delay_s

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            hold = threading.Event()  # set: hold the next reply chunk back
            threading.Thread(
                target=self._requests, args=(client, upstream, hold), daemon=True
            ).start()
            threading.Thread(
                target=self._replies, args=(upstream, client, hold), daemon=True
            ).start()

    def _requests(self, src: socket.socket, dst: socket.socket, hold: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                with self._lock:
                    if self._trigger is not None and self._trigger in chunk:
                        self._trigger = None
                        hold.set()  # before the command reaches Redis: its reply is next
                dst.sendall(chunk)
        _shut(src, dst)

    def _replies(self, src: socket.socket, dst: socket.socket, hold: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                if hold.is_set():
                    hold.clear()
                    self.delayed += 1
                    time.sleep(self._delay_s)
                dst.sendall(chunk)
        _shut(src, dst)


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()
