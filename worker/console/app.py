"""``probeguard console``: the web application (FastAPI, server-rendered Jinja2 pages).

    /login, /logout            sessions, users from PROBEGUARD_CONSOLE_USERS (pages_auth.py)
    /review                    the labeling queue (pages_review.py)
    /probes                    versions, rollout evidence, plots, stage changes (pages_probes.py)
    /explain                   one text's decomposition, as `probeguard explain` (pages_explain.py)
    /static/*                  the stylesheet and the one script file
    /healthz                   liveness, no data (pages_auth.py)
    /metrics                   Prometheus: the review backlog (metrics.py, pages_auth.py)
    /readyz                    the review queue takes in requests, no data (pages_auth.py)

Build one with :func:`create_app` from a :class:`Console` (what the pages read and
write, in ``context.py``); :class:`worker.console.server.ConsoleServer` serves it on a
thread. This module only assembles: the pages import ``context`` and ``web``, never it.
"""

from __future__ import annotations

import logging
import secrets

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.sessions import SessionMiddleware
from starlette.responses import Response

from worker.console import pages_auth, pages_explain, pages_probes, pages_review, web
from worker.console.context import Console, console_of, user_of

__all__ = ["Console", "create_app"]

log = logging.getLogger(__name__)


def create_app(console: Console, *, secret_key: bytes | None = None) -> FastAPI:
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
    app.include_router(pages_auth.router)
    _error_handlers(app)
    return app


def _retry_url(request: Request) -> str:
    """Where a 503 page tries again: the same page after a GET; after a POST (nothing was
    done), the page the form was on."""
    path = request.url.path
    if request.method == "GET":  # only a path on this site (no '//host' trick)
        return web.safe_next(path + ("?" + request.url.query if request.url.query else ""))
    for page in ("/review", "/probes", "/explain", "/login"):
        if path.startswith(page):
            return page
    return "/review"


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
            retry_url=_retry_url(request),
        )

    @app.exception_handler(web.NotSignedIn)
    def not_signed_in(request: Request, _exc: web.NotSignedIn) -> Response:
        wants_page = request.method == "GET" and "text/html" in request.headers.get("accept", "")
        if wants_page:
            return web.see_other(web.login_redirect(request))
        return JSONResponse({"error": "sign in first"}, status_code=401)

    @app.exception_handler(RequestValidationError)
    def malformed(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own answer echoes the input and lists what each field accepts, to
        # anyone: without a session it is the same 401 as a well-formed request gets.
        try:
            user_of(request)
        except web.NotSignedIn as no:
            return not_signed_in(request, no)
        except redis.RedisError as down:
            return redis_down(request, down)
        fields = sorted({str(e["loc"][-1]) for e in exc.errors() if e.get("loc")})
        return JSONResponse(
            {"error": f"malformed request (fields: {', '.join(fields)[:200] or '?'})"},
            status_code=422,
        )

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
