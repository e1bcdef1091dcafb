"""What every route of ``probeguard serve`` shares: :class:`Handler` authenticates a
request (an API key: ``Authorization: Bearer KEY``, ``?key=KEY`` or ``x-goog-api-key``),
rate-limits it per key, reads its body up to ``serve_max_body_bytes``, runs the route's
work and counts it; a refusal (:class:`~worker.serve.errors.ApiError`) answers in the
shape of the calling API, its :class:`Dialect`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Histogram
from pydantic import BaseModel

from worker.serve.auth import Caller
from worker.serve.bodies import BodyReader, declared_length
from worker.serve.errors import ApiError
from worker.serve.keys import RateLimiter

if TYPE_CHECKING:
    from worker.serve.service import Service

__all__ = ["BODY_UNIT", "Dialect", "Handler", "Work", "body_schema", "error_response"]

# Each this many bytes of a body count as one more request: a 1 MB body costs ~61 of a
# key's rate (at 64 KiB, a tenant had four such bodies a second read and checked).
BODY_UNIT = 16 * 1024
DROP_BYTES = 64 * 1024  # a body refused before it is read is read and dropped up to this
REFUSALS_HELD = 256  # rate-limited requests held at once for their Retry-After (see _hold)

Work = Callable[[bytes, Caller], Awaitable[Response]]


@dataclass(frozen=True)
class Dialect:
    """How one API says no."""

    name: str
    missing_key_status: int
    invalid_key_status: int
    render: Callable[[ApiError], dict[str, Any]]
    http_status: Callable[[int], int] = lambda status: status


def error_response(dialect: Dialect, e: ApiError) -> JSONResponse:
    headers = {"Connection": "close"} if e.close else {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    status = dialect.http_status(e.status)
    return JSONResponse(dialect.render(e), status_code=status, headers=headers)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is ``model`` (the route reads the body
    itself, so FastAPI does not know it)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


class Handler:
    """``await handle(request, dialect, work)``: the request authenticated, rate-limited
    and read, then ``work(body, caller)``'s response, or the refusal in ``dialect``'s
    shape; each counted in ``probeguard_serve_requests`` and timed in
    ``probeguard_serve_request_seconds`` under the dialect's name."""

    def __init__(self, service: Service) -> None:
        s = self.settings = service.settings
        self.service = service
        self.requests_total = Counter(
            "probeguard_serve_requests",
            "HTTP moderation requests by endpoint and status",
            ["endpoint", "code"],
            registry=service.collector,
        )
        self.request_seconds = Histogram(
            "probeguard_serve_request_seconds",
            "Wall time of a moderation request (authentication to response)",
            ["endpoint"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=service.collector,
        )
        self._held = 0  # 429s waiting out their Retry-After now
        self.reader = BodyReader(
            s.serve_max_body_bytes,
            s.serve_body_timeout_s,
            drain_bytes=max(4 * s.serve_max_body_bytes, 8 * 1024 * 1024),
        )

    async def __call__(self, request: Request, dialect: Dialect, work: Work) -> Response:
        s = self.settings
        limiter = self.service.limiter
        t0 = time.perf_counter()
        reading = False  # the body is being (or was) read: nothing left to drop
        try:
            caller = await self.service.auth.caller(
                request, _presented_key(request), lambda code: _key_refusal(dialect, code)
            )
            # A large body costs more to read and parse: one more request per BODY_UNIT
            # bytes, charged before it is read where Content-Length declares it (never more
            # than the burst: a configured burst below it must still admit it).
            upfront = min(declared_length(request) // BODY_UNIT, s.serve_rate_burst - 1)
            _charge(limiter, caller.limit_key, 1 + upfront, s.serve_rate_per_key)
            reading = True
            body = await self.reader.read(request)
            extra = min(len(body) // BODY_UNIT, s.serve_rate_burst - 1) - upfront
            if extra > 0:  # a body its headers did not declare (chunked)
                _charge(limiter, caller.limit_key, extra, s.serve_rate_per_key)
            response = await work(body, caller)
        except ApiError as e:
            if e.status == 429 and e.retry_after_s:
                await self._hold(e)
            # Refused before its body was read: drop a small body to keep the connection;
            # a large one is not worth reading (the connection closes: a client that sends
            # it again reconnects, within its address's connection rate).
            if not reading and not await self.reader.discard(request, DROP_BYTES):
                e.close = True
            response = error_response(dialect, e)
        self.requests_total.labels(dialect.name, str(response.status_code)).inc()
        self.request_seconds.labels(dialect.name).observe(time.perf_counter() - t0)
        return response

    async def _hold(self, e: ApiError) -> None:
        """A 429 is answered after the ``Retry-After`` it would name, up to
        ``SERVE_REFUSAL_DELAY_S``, and names what is left of it: a client that retries the
        moment it is refused (a flood) then asks once per delay per connection, and one
        that honours ``Retry-After`` is not made to wait longer than a second more. At most
        ``REFUSALS_HELD`` wait at once; the rest are answered at once."""
        assert e.retry_after_s is not None
        delay = min(e.retry_after_s, self.settings.serve_refusal_delay_s)
        if delay <= 0 or self._held >= REFUSALS_HELD:
            return
        self._held += 1
        try:
            await anyio.sleep(delay)
        finally:
            self._held -= 1
        e.retry_after_s = max(0.0, e.retry_after_s - delay)


def _charge(limiter: RateLimiter, key: str, cost: int, rate: float) -> None:
    """Take ``cost`` from ``key``'s bucket, or refuse with a 429 saying when to retry."""
    wait = limiter.take(key, cost=cost)
    if wait > 0:
        body = (
            f"; each {BODY_UNIT // 1024} KiB of body counts as one more request" if cost > 1 else ""
        )
        raise ApiError(
            429,
            f"rate limit of {rate:g} requests/s for this key reached "
            f"(PROBEGUARD_SERVE_RATE_PER_KEY{body})",
            code="rate_limit_exceeded",
            retry_after_s=wait,
        )


def _presented_key(request: Request) -> str:
    """The API key a request carries: ``Authorization: Bearer``, ``?key=`` or
    ``x-goog-api-key`` ('' when none)."""
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return key or request.query_params.get("key", "") or request.headers.get("x-goog-api-key", "")


def _key_refusal(dialect: Dialect, code: str) -> ApiError:
    if code == "missing_api_key":
        return ApiError(
            dialect.missing_key_status,
            "The request is missing an API key (Authorization: Bearer KEY, or ?key=KEY).",
            code=code,
        )
    return ApiError(dialect.invalid_key_status, "API key not valid.", code=code)
