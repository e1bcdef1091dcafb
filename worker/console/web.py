"""The console's web plumbing: security headers, sessions, the signed-in user, CSRF.

- Every response carries a strict Content-Security-Policy: scripts and styles only from
  ``/static`` (no inline script or style anywhere), no frames, forms post only here.
- Sessions are signed cookies (``HttpOnly``, ``SameSite=Strict``; ``Secure`` with
  ``PROBEGUARD_CONSOLE_SECURE_COOKIES``) that name the user, a digest of their password
  hash and a session id checked against Redis (:mod:`worker.console.sessions`): signing
  out, ``probeguard console sign-out NAME``, the session TTL, changing a password or
  removing a user end a session, and a copy of its cookie with it.
- Every state change (each POST) must carry the session's CSRF token, as a form field
  ``csrf`` or an ``X-CSRF-Token`` header, and must not come from another origin.
- After a POST, pages answer :func:`see_other` (303) with a :func:`flash` note for the
  next page.
- Texts a reviewer judges are shown as the model read them: characters that are invisible
  or reorder the display (bidi controls, zero-width characters) are revealed as markers
  (:func:`reveal`), never applied.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
from fastapi import Request
from fastapi.responses import RedirectResponse
from markupsafe import Markup, escape
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.console.auth import Permission, User
from worker.console.sessions import SessionStore

__all__ = [
    "CSP",
    "Forbidden",
    "NotSignedIn",
    "SecurityHeaders",
    "check_csrf",
    "csrf_token",
    "flash",
    "hidden_chars",
    "reveal",
    "see_other",
    "signed_in",
    "templates",
]

HERE = Path(__file__).parent
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'"
)
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # Not no-referrer: with it, browsers send "Origin: null" on same-site form posts.
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=()"),
]


class SecurityHeaders:
    """Adds the headers above to every response; pages are never cached."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope.get("path", "").startswith("/static/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += _HEADERS
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def templates() -> jinja2.Environment:
    """Autoescaping everywhere: every value from Kafka, Redis or a form is text."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _num
    env.filters["pct"] = _pct
    env.filters["reveal"] = reveal
    env.filters["hidden_chars"] = hidden_chars
    return env


# --- hidden characters ---------------------------------------------------------------
# What changes how a text is displayed without being seen: format characters (category
# Cf: bidi embeddings, overrides and isolates, LRM/RLM/ALM, zero-width space and joiners,
# word joiner, BOM, soft hyphen, tag characters), control characters other than line
# breaks and tabs (Cc), and the Hangul fillers, which render blank.
_BLANK = frozenset("\u115f\u1160\u3164\uffa0")
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _hidden(ch: str) -> bool:
    if ch in "\n\r\t":
        return False
    return unicodedata.category(ch) in ("Cf", "Cc") or ch in _BLANK


def _char_name(ch: str) -> str:
    return unicodedata.name(ch, "CONTROL CHARACTER" if unicodedata.category(ch) == "Cc" else "")


@dataclass(frozen=True)
class Hidden:
    """The hidden characters of a text: how many, the names of the first few kinds, and
    whether any of them changes the reading direction."""

    count: int
    names: tuple[str, ...]
    more: bool  # kinds beyond those named
    bidi: bool
    example: str = ""  # the first one's marker text, "U+202E"


def hidden_chars(text: Any) -> Hidden:
    """>>> h = hidden_chars("a\u202eb\u200bc\u200b")
    >>> h.count, h.names, h.bidi, h.example
    (3, ('RIGHT-TO-LEFT OVERRIDE', 'ZERO WIDTH SPACE'), True, 'U+202E')
    """
    found = [ch for ch in str(text) if _hidden(ch)]
    kinds = list(dict.fromkeys(found))
    names = tuple(_char_name(ch) or f"U+{ord(ch):04X}" for ch in kinds[:6])
    example = f"U+{ord(found[0]):04X}" if found else ""
    return Hidden(len(found), names, len(kinds) > 6, any(ch in _BIDI for ch in kinds), example)


def reveal(text: Any) -> Markup:
    """``text`` escaped, with each hidden character replaced by a visible marker
    (``⟨U+202E⟩``, its name as the title), so what is shown reads as the model read it:
    a right-to-left override shows where it is instead of reversing what follows."""
    text = str(text)
    parts: list[Markup] = []
    start = 0
    for i, ch in enumerate(text):
        if _hidden(ch):
            parts.append(escape(text[start:i]))
            title = escape(_char_name(ch) or "hidden character")
            parts.append(
                Markup(f'<span class="hidden-char" title="{title}">⟨U+{ord(ch):04X}⟩</span>')
            )
            start = i + 1
    parts.append(escape(text[start:]))
    return Markup("").join(parts)


def _num(v: Any, fmt: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    return format(v, fmt)


def _pct(v: Any) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    return f"{100 * v:.1f}%"


# --- who is signed in ---------------------------------------------------------------


class NotSignedIn(Exception):
    """No valid session: pages redirect to the login form, everything else gets 401."""


class Forbidden(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def hash_digest(user: User) -> str:
    return hashlib.sha256(user.password_hash.encode()).hexdigest()[:16]


def signed_in(request: Request, users: dict[str, User], sessions: SessionStore) -> User:
    """The session's user, still configured, with the same password, and a session that
    has not ended (signed out, revoked, past its TTL); else NotSignedIn."""
    name = request.session.get("user")
    user = users.get(name) if isinstance(name, str) else None
    digest = request.session.get("pw")
    sid = request.session.get("sid")
    if user is None or not isinstance(digest, str) or not isinstance(sid, str):
        raise NotSignedIn()
    if not hmac.compare_digest(digest, hash_digest(user)) or not sessions.check(sid, user.name):
        request.session.clear()
        raise NotSignedIn()
    return user


def require(user: User, permission: Permission) -> None:
    if not user.may(permission):
        raise Forbidden(f"{user.name} is a {user.role}; this needs the operator role")


def login_redirect(request: Request) -> str:
    target = request.url.path
    if request.url.query:
        target += "?" + request.url.query
    return "/login?next=" + quote(target, safe="")


def safe_next(target: str | None) -> str:
    """Only a path on this site (no scheme, no host, no '//' trick)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/review"
    return target


def see_other(url: str) -> RedirectResponse:
    """The answer to a POST: the browser GETs ``url`` next (303 See Other)."""
    return RedirectResponse(url, status_code=303)


def flash(request: Request, text: str, kind: str = "ok") -> None:
    """A one-time note (``ok`` or ``error``) shown by the next page rendered."""
    request.session["flash"] = {"text": text[:600], "kind": kind}


# --- CSRF -------------------------------------------------------------------------------


def csrf_token(request: Request) -> str:
    token = request.session.get("csrf")
    if not isinstance(token, str) or len(token) < 32:
        token = secrets.token_urlsafe(32)
        request.session["csrf"] = token
    return token


def check_csrf(request: Request, form_token: str | None) -> None:
    """Refuse a state change without the session's token, or from another origin."""
    origin = request.headers.get("origin")  # "null" (a sandboxed frame) is refused too
    if origin is not None:
        own = f"{request.url.scheme}://{request.url.netloc}"
        if origin != own:
            raise Forbidden(f"cross-origin request from {origin[:100]} refused")
    want = request.session.get("csrf")
    got = form_token or request.headers.get("x-csrf-token") or ""
    if not isinstance(want, str) or not want or not hmac.compare_digest(want, got):
        raise Forbidden("missing or wrong CSRF token: reload the page and try again")
