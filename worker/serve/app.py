"""The HTTP app of ``probeguard serve``: OpenAI's moderation call
(:mod:`worker.serve.openai_api`), Perspective's (:mod:`worker.serve.perspective_api`),
``/metrics``, ``/healthz``, ``/readyz`` and ``/openapi.json``.

Every moderation request is authenticated (an API key: ``Authorization: Bearer KEY``,
``?key=KEY`` or ``x-goog-api-key``), rate-limited per key, read up to
``serve_max_body_bytes`` (:mod:`worker.serve.handler`) and validated before anything is
scored; every refusal, an unknown path or method included, answers in the calling API's
own error shape (OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Perspective:
``{"error": {"code", "message", "status"}}``), so its clients raise their usual errors.
Malformed JSON is a 400, never a 500.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.serve import openai_api, perspective_api
from worker.serve.errors import ApiError
from worker.serve.handler import Handler, error_response
from worker.serve.openai_api import OPENAI
from worker.serve.perspective_api import PERSPECTIVE

if TYPE_CHECKING:
    from worker.serve.service import Service

__all__ = ["create_app"]


def create_app(service: Service) -> FastAPI:
    """The app on ``service``: each API's routes on one shared :class:`Handler`."""
    app = FastAPI(
        title="probeguard serve",
        description="OpenAI- and Perspective-compatible moderation on probeguard's probes.",
        docs_url=None,
        redoc_url=None,
    )
    handle = Handler(service)
    openai_api.register(app, handle, service)
    perspective_api.register(app, handle, service)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """404, 405 and the like in the shape of the API the path belongs to, not
        FastAPI's ``{"detail": ...}``."""
        dialect = PERSPECTIVE if request.url.path.startswith("/v1alpha1/") else OPENAI
        why = {404: "no such endpoint", 405: "method not allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path[:200]}: {why or exc.detail}"
        e = ApiError(exc.status_code, message, code=(why or "error").replace(" ", "_"))
        response = error_response(dialect, e)
        response.headers.update(dict(exc.headers or {}))
        return response

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(service.collector), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        ok, why = service.alive()
        return PlainTextResponse(why + "\n", status_code=200 if ok else 503)

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        ok, why = service.ready()
        return PlainTextResponse(why + "\n", status_code=200 if ok else 503)

    return app
