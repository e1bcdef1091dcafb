"""An ASGI app served by uvicorn on a daemon thread: the console and ``probeguard serve``.

:class:`HttpThread` starts uvicorn (no access log: URLs can carry keys; no lifespan; no
server header), waits until it listens, says clearly when it cannot (a port in use), and
reports the port actually bound (``0`` picks a free one).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from worker.errors import StackError

__all__ = ["HttpThread"]


class HttpThread:
    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        name: str,
        port_setting: str,
        http: Any = "auto",
    ) -> None:
        """``http``: uvicorn's protocol (a class: e.g. ``serve``'s guarded one)."""
        self.app = app
        self.http = http
        self.host = host
        self.port = port
        self.name = name
        self.port_setting = port_setting  # named in the error when the port is taken
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> HttpThread:
        """Listen, or :class:`StackError` (the caller cleans up what it started)."""
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,
            http=self.http,
        )
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise StackError(
                    f"the {self.name} could not listen on {self.host}:{self.port} "
                    f"(port in use? set {self.port_setting})"
                )
            time.sleep(0.05)
        self.port = _bound_port(server) or self.port
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def wait(self) -> None:
        """Block until the server stops."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)


def _bound_port(server: uvicorn.Server) -> int | None:
    """The port actually bound (``0`` picks a free one)."""
    servers: Any = getattr(server, "servers", [])
    for srv in servers:
        for sock in srv.sockets:
            return int(sock.getsockname()[1])
    return None
