"""``probeguard console``: the web application (FastAPI, server-rendered Jinja2 pages).

    /login, /logout            sessions (users and roles from PROBEGUARD_CONSOLE_USERS)
    /review                    the labeling queue (pages_review.py)
    /probes                    versions, rollout evidence, plots, stage changes (pages_probes.py)
    /explain                   one text's decomposition, as `probeguard explain` (pages_explain.py)
    /static/*                  the stylesheet and the one script file
    /healthz                   liveness, no data

Build one with :func:`create_app` from a :class:`Console` (what the pages read and
write); :class:`worker.console.server.ConsoleServer` serves it on a thread.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any

import jinja2
import redis
from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.sessions import SessionMiddleware
from starlette.responses import Response

from worker.console import web
from worker.console.auth import LoginThrottle, User, hash_password
from worker.console.explainer import Explainer, SpecCache
from worker.review.queue import ReviewQueue
from worker.settings import Settings
from worker.store.evidence import EvidenceStore
from worker.store.redis import Keys, make_text_redis

__all__ = ["Console", "create_app"]

log = logging.getLogger(__name__)

# Checked against when the user name is unknown, so a wrong name costs as long as a
# wrong password (no user enumeration by timing).
_DUMMY = User("-", "reviewer", hash_password(secrets.token_urlsafe(16)))


@dataclass
class Console:
    """Everything the pages need; one per process."""

    settings: Settings
    users: dict[str, User]
    client: Any  # redis.Redis
    queue: ReviewQueue | None
    explainer: Explainer
    keys: Keys = field(init=False)
    cache: Any = field(init=False)  # the text cache's Redis (PROBEGUARD_TEXT_REDIS_URL)
    evidence: EvidenceStore = field(init=False)
    specs: SpecCache = field(init=False)
    env: jinja2.Environment = field(default_factory=web.templates)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)

    def __post_init__(self) -> None:
        self.keys = Keys(self.settings.redis_prefix)
        self.cache = make_text_redis(self.settings, self.client)
        self.evidence = EvidenceStore.from_settings(self.client, self.settings, cache=self.cache)
        self.specs = SpecCache(self.client, self.keys)

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


def flash(request: Request, text: str, kind: str = "ok") -> None:
    request.session["flash"] = {"text": text[:600], "kind": kind}


def see_other(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303)


def console_of(request: Request) -> Console:
    return request.app.state.console


def user_of(request: Request) -> User:
    return web.signed_in(request, console_of(request).users)


def create_app(console: Console, *, secret_key: bytes | None = None) -> FastAPI:
    from worker.console import pages_explain, pages_probes, pages_review

    s = console.settings
    app = FastAPI(title="probeguard console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.console = console
    key = secret_key or (
        s.console_secret_key.get_secret_value().encode()
        if s.console_secret_key is not None
        else secrets.token_bytes(32)  # sessions end with the process
    )
    app.add_middleware(
        SessionMiddleware,
        secret_key=key.decode("latin-1"),
        session_cookie="probeguard_console",
        max_age=s.console_session_ttl_s,
        same_site="strict",
        https_only=s.console_secure_cookies,
    )
    app.add_middleware(web.SecurityHeaders)
    app.mount("/static", StaticFiles(directory=web.HERE / "static"), name="static")
    app.include_router(pages_review.router)
    app.include_router(pages_probes.router)
    app.include_router(pages_explain.router)
    _auth_routes(app)
    _error_handlers(app)
    return app


def _auth_routes(app: FastAPI) -> None:
    @app.get("/healthz", include_in_schema=False)
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/")
    def root(request: Request) -> RedirectResponse:
        user_of(request)
        return see_other("/review")

    @app.get("/login")
    def login_form(request: Request, next: str = "/review") -> HTMLResponse:
        return console_of(request).page(request, "login.html", next=web.safe_next(next), error="")

    @app.post("/login")
    def login(
        request: Request,
        username: Annotated[str, Form()] = "",
        password: Annotated[str, Form()] = "",
        csrf: Annotated[str, Form()] = "",
        next: Annotated[str, Form()] = "/review",
    ) -> Response:
        console = console_of(request)
        web.check_csrf(request, csrf)
        name = username.strip()[:64]
        if console.throttle.blocked(name):
            return console.page(
                request,
                "login.html",
                status=429,
                next=web.safe_next(next),
                error="too many failed attempts for this user; wait a few minutes",
            )
        user = console.users.get(name)
        ok = (user or _DUMMY).check(password[:1024])
        if user is None or not ok:
            console.throttle.failed(name)
            return console.page(
                request,
                "login.html",
                status=401,
                next=web.safe_next(next),
                error="unknown user or wrong password",
            )
        console.throttle.succeeded(name)
        request.session.clear()  # a fresh session (and CSRF token) at every sign-in
        request.session.update({"user": user.name, "pw": web.hash_digest(user)})
        return see_other(web.safe_next(next))

    @app.post("/logout")
    def logout(request: Request, csrf: Annotated[str, Form()] = "") -> RedirectResponse:
        user = user_of(request)
        web.check_csrf(request, csrf)
        queue = console_of(request).queue
        if queue is not None:
            queue.leave(user.name)
        request.session.clear()
        return see_other("/login")


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(redis.RedisError)
    def redis_down(request: Request, exc: redis.RedisError) -> Response:
        # Not the exception text: a connection error may name the server's address.
        log.warning("console request %s: Redis error %s", request.url.path, type(exc).__name__)
        return console_of(request).page(
            request,
            "error.html",
            status=503,
            user=None,
            title="Redis is unreachable",
            message="The console cannot read or write Redis right now; nothing was changed. "
            "Try again in a moment.",
        )

    @app.exception_handler(web.NotSignedIn)
    def not_signed_in(request: Request, _exc: web.NotSignedIn) -> Response:
        wants_page = request.method == "GET" and "text/html" in request.headers.get("accept", "")
        if wants_page:
            return see_other(web.login_redirect(request))
        return JSONResponse({"error": "sign in first"}, status_code=401)

    @app.exception_handler(web.Forbidden)
    def forbidden(request: Request, exc: web.Forbidden) -> Response:
        if "application/json" in request.headers.get("accept", ""):
            return JSONResponse({"error": exc.why}, status_code=403)
        try:
            user = user_of(request)
        except web.NotSignedIn:
            user = None
        return console_of(request).page(
            request, "error.html", status=403, user=user, title="Refused", message=exc.why
        )
