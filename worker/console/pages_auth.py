"""Signing in and out, the root redirect, ``/healthz``, ``/readyz`` and ``/metrics``.

Sessions are described in :mod:`worker.console.web` and :mod:`worker.console.sessions`:
signing out ends the session on the server. A failed sign-in costs the same
time whether or not the user exists; repeated failures are throttled per client address
and per (address, name), so nobody can lock a user out from elsewhere
(:class:`~worker.console.auth.LoginThrottle`).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from worker.console import web
from worker.console.auth import User, hash_password
from worker.console.context import console_of, user_of
from worker.console.web import see_other

__all__ = ["router"]

router = APIRouter()

# Checked against when the user name is unknown, so a wrong name costs as long as a
# wrong password (no user enumeration by timing).
_DUMMY = User("-", "reviewer", hash_password(secrets.token_urlsafe(16)))


@router.get("/healthz", include_in_schema=False)
def healthz() -> PlainTextResponse:
    return PlainTextResponse("ok")


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """Prometheus text, without a session (as ``/healthz``): counts only, no content."""
    collector = console_of(request).collector
    return Response(generate_latest(collector), media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz", include_in_schema=False)
def readyz(request: Request) -> PlainTextResponse:
    """Whether the review queue takes in review requests (503 with why, while Redis or the
    broker does not answer); no session needed, and no data."""
    queue = console_of(request).queue
    ok, why = queue.readiness() if queue is not None else (True, "ok (no review queue)")
    return PlainTextResponse(why + "\n", status_code=200 if ok else 503)


@router.get("/")
def root(request: Request) -> RedirectResponse:
    user_of(request)
    return see_other("/review")


@router.get("/login")
def login_form(request: Request, next: str = "/review") -> HTMLResponse:
    return console_of(request).page(request, "login.html", next=web.safe_next(next), error="")


@router.post("/login")
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
    address = request.client.host if request.client else None
    if console.throttle.blocked(name, address):
        return console.page(
            request,
            "login.html",
            status=429,
            next=web.safe_next(next),
            error="too many failed attempts from your address; wait a few minutes",
        )
    user = console.users.get(name)
    # At most a few password checks at once (each is a scrypt: ~40 ms of CPU, 16 MiB): a
    # burst of sign-ins waits here instead of starving the pages' threads.
    if not console.password_checks.acquire(timeout=10.0):
        return console.page(
            request,
            "login.html",
            status=503,
            next=web.safe_next(next),
            error="the console is busy checking other sign-ins; try again in a moment",
        )
    try:
        ok = (user or _DUMMY).check(password[:1024])
    finally:
        console.password_checks.release()
    if user is None or not ok:
        console.throttle.failed(name, address)
        return console.page(
            request,
            "login.html",
            status=401,
            next=web.safe_next(next),
            error="unknown user or wrong password",
        )
    console.throttle.succeeded(name, address)
    _end(request)  # a fresh session (and CSRF token) at every sign-in
    sid = console.sessions.start(user.name)
    request.session.update({"user": user.name, "pw": web.hash_digest(user), "sid": sid})
    return see_other(web.safe_next(next))


@router.post("/logout")
def logout(request: Request, csrf: Annotated[str, Form()] = "") -> RedirectResponse:
    user = user_of(request)
    web.check_csrf(request, csrf)
    queue = console_of(request).queue
    if queue is not None:
        queue.leave(user.name)
    _end(request)
    return see_other("/login")


def _end(request: Request) -> None:
    """End the request's session on the server (a copy of its cookie is refused from now
    on) and clear the cookie."""
    sid, name = request.session.get("sid"), request.session.get("user")
    if isinstance(sid, str) and isinstance(name, str):
        console_of(request).sessions.end(sid, name)
    request.session.clear()
