"""What every console page reads: the :class:`Console` (one per process) and the two
request helpers the routes start with, :func:`console_of` and :func:`user_of`.

FastAPI's "dependencies" module: ``app`` assembles the pages, the pages import this,
and this imports only the plumbing below it (``web``, ``auth``), so no page imports
the app that mounts it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import jinja2
import redis
from fastapi import Request
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from worker.console import web
from worker.console.auth import LoginThrottle, User
from worker.console.explainer import Explainer, SpecCache
from worker.console.metrics import console_metrics
from worker.console.sessions import SessionStore
from worker.review.queue import ReviewQueue
from worker.settings import Settings
from worker.store.evidence import EvidenceStore
from worker.store.redis import Keys, keys_for, make_text_redis

__all__ = ["Console", "console_of", "redis_options", "user_of"]


def redis_options(settings: Settings) -> dict[str, Any]:
    """The console's Redis client options (for :func:`worker.store.redis.make_redis`): a
    request waits at most ``console_redis_timeout_s`` for a Redis that does not answer and
    does not retry that (a dropped connection is still retried once, quickly), so a hung
    Redis is a 503 page within about a second, not a minute behind the review queue's lock.
    """
    t = settings.console_redis_timeout_s
    return {
        "socket_timeout": t,
        "socket_connect_timeout": t,
        "retry": Retry(
            ExponentialBackoff(cap=0.5, base=0.05),
            settings.redis_retries,
            supported_errors=(redis.ConnectionError,),
        ),
    }


@dataclass
class Console:
    """Everything the pages need; one per process."""

    settings: Settings
    users: dict[str, User]
    client: Any  # redis.Redis
    queue: ReviewQueue | None
    explainer: Explainer
    keys: Keys = field(init=False)
    texts: Any = field(init=False)  # the text store's Redis (PROBEGUARD_TEXT_REDIS_URL)
    evidence: EvidenceStore = field(init=False)
    specs: SpecCache = field(init=False)
    collector: CollectorRegistry = field(init=False)  # served on /metrics
    sessions: SessionStore = field(init=False)
    env: jinja2.Environment = field(default_factory=web.templates)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    # Password checks (scrypt) running at once, at most; the others wait for a turn.
    password_checks: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(2)
    )

    def __post_init__(self) -> None:
        self.keys = keys_for(self.settings)
        self.texts = make_text_redis(self.settings, self.client, **redis_options(self.settings))
        self.evidence = EvidenceStore.from_settings(self.client, self.settings, cache=self.texts)
        self.specs = SpecCache(self.client, self.keys)
        self.collector = console_metrics(self.queue)
        self.sessions = SessionStore(
            self.client, self.keys, ttl_s=self.settings.console_session_ttl_s
        )

    def page(self, request: Request, name: str, status: int = 200, **values: Any) -> HTMLResponse:
        """Render ``name`` with the common values (user, CSRF token, flash, probes)."""
        user = values.pop("user", None)
        html = self.env.get_template(name).render(
            user=user,
            csrf=web.csrf_token(request),
            flash=request.session.pop("flash", None),
            probes=self.settings.probe_names,
            path=request.url.path,
            **values,
        )
        return HTMLResponse(html, status_code=status)


def console_of(request: Request) -> Console:
    """The process's :class:`Console` (set on the app by ``create_app``)."""
    return request.app.state.console


def user_of(request: Request) -> User:
    """The signed-in user; raises :class:`web.NotSignedIn` otherwise."""
    console = console_of(request)
    return web.signed_in(request, console.users, console.sessions)
