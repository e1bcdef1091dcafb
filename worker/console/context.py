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
from fastapi import Request
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry

from worker.console import web
from worker.console.auth import LoginThrottle, User
from worker.console.explainer import Explainer, SpecCache
from worker.console.metrics import console_metrics
from worker.console.sessions import SessionStore
from worker.review.queue import ReviewQueue
from worker.settings import Settings
from worker.store.evidence import EvidenceStore
from worker.store.redis import Keys, make_text_redis

__all__ = ["Console", "console_of", "user_of"]


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
        self.keys = Keys(self.settings.redis_prefix)
        self.texts = make_text_redis(self.settings, self.client)
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
