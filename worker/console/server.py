"""Serve the console: :class:`ConsoleServer` builds the app from settings and runs it
with uvicorn on a thread (``probeguard console`` blocks on it; the demo and the tests
run it beside other work).

Example::

    with ConsoleServer(settings) as server:   # review queue consuming, LLM loading
        print(server.url)                     # http://127.0.0.1:8300
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from worker.console.app import Console, create_app
from worker.console.auth import User, parse_users
from worker.console.context import redis_options
from worker.console.explainer import Explainer, SpecCache
from worker.errors import ConfigError, StackError
from worker.http_thread import HttpThread
from worker.kafka.clients import ensure_topics
from worker.review.queue import ReviewQueue
from worker.settings import Settings
from worker.store.redis import keys_for, make_redis

if TYPE_CHECKING:
    from worker.llm.extract import HiddenStateExtractor

__all__ = ["ConsoleServer"]

log = logging.getLogger(__name__)


class ConsoleServer:
    def __init__(
        self,
        settings: Settings,
        *,
        extractor: HiddenStateExtractor | None = None,
        users: dict[str, User] | None = None,
        secret_key: bytes | None = None,
        review: bool = True,
        worker_id: str = "console",
    ) -> None:
        if users is None:
            raw = settings.console_users
            users = parse_users(None if raw is None else raw.get_secret_value())
        if not users:
            raise ConfigError(
                "the console has no users: set PROBEGUARD_CONSOLE_USERS "
                "(`probeguard console user NAME --role operator` prints an entry)"
            )
        self.settings = settings
        client = make_redis(settings, **redis_options(settings))  # bounded: see there
        keys = keys_for(settings)
        queue = (
            ReviewQueue(settings, client, spec_of=SpecCache(client, keys), worker_id=worker_id)
            if review
            else None
        )
        explainer = Explainer(
            settings, client, extractor=extractor, enabled=settings.console_explain
        )
        self.console = Console(settings, users, client, queue, explainer)
        self.app = create_app(self.console, secret_key=secret_key)
        self.port = settings.console_port
        self.http = HttpThread(
            self.app,
            settings.console_host,
            settings.console_port,
            name="console",
            port_setting="PROBEGUARD_CONSOLE_PORT",
        )

    @property
    def url(self) -> str:
        return f"http://{self.settings.console_host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ConsoleServer:
        s = self.settings
        queue = self.console.queue
        if queue is not None:
            ensure_topics(s, [s.topic_review, s.topic_labels, s.topic_dead_letter])
            queue.start()
        if self.console.explainer.enabled:
            threading.Thread(
                target=self.console.explainer.warm_up, name="console-llm", daemon=True
            ).start()
        try:
            self.http.start(timeout_s)
        except StackError:
            self.stop()
            raise
        self.port = self.http.port
        log.info("console at %s", self.url)
        return self

    def stop(self) -> None:
        self.http.stop()
        if self.console.queue is not None:
            self.console.queue.stop()
        self.console.client.close()

    def wait(self) -> None:
        """Block until the server stops (SIGINT/SIGTERM handled by the caller)."""
        self.http.wait()

    def __enter__(self) -> ConsoleServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
