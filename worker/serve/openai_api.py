"""OpenAI's moderation API on ``probeguard serve``: ``POST /v1/moderations``, answered
in OpenAI's response shape (which of the probe's labels answer as which categories:
:mod:`worker.serve.mapping`), its refusals in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) so its clients raise their usual
errors."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from schemas import ProbeResult, ProbeSpec
from schemas.moderation_api import (
    OPENAI_CATEGORIES,
    ModerationRequest,
    ModerationResponse,
    ModerationResult,
    TextInput,
)
from worker.scoring.engine import Retain
from worker.serve import messages
from worker.serve.auth import Caller
from worker.serve.errors import ApiError
from worker.serve.handler import Dialect, Handler, body_schema
from worker.serve.mapping import category_labels

if TYPE_CHECKING:
    from worker.serve.service import Service

__all__ = ["OPENAI", "register"]


def _error(e: ApiError) -> dict[str, Any]:
    kind = {401: "invalid_request_error", 429: "rate_limit_error"}.get(e.status)
    kind = kind or ("server_error" if e.status >= 500 else "invalid_request_error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


OPENAI = Dialect("openai", 401, 401, _error)


def register(app: FastAPI, handle: Handler, service: Service) -> None:
    """Add ``POST /v1/moderations`` to ``app``."""
    s = service.settings

    @app.post(
        "/v1/moderations",
        response_model=ModerationResponse,
        openapi_extra=body_schema(ModerationRequest),
        summary="Classify text (OpenAI's moderation API)",
    )
    async def moderations(request: Request) -> Response:
        async def work(body: bytes, caller: Caller) -> Response:
            req = await service.parser.parse(ModerationRequest, body, max_inputs=s.serve_max_inputs)
            texts = _texts(req)
            if len(texts) > s.serve_max_inputs:
                raise ApiError(
                    413,
                    f"{len(texts)} inputs; at most {s.serve_max_inputs} per request "
                    "(PROBEGUARD_SERVE_MAX_INPUTS)",
                    param="input",
                    code="too_many_inputs",
                )
            probe = service.probe_for(req.model)
            rid = f"modr-{uuid.uuid4().hex}"
            conversation = messages.conversation_key(
                request.headers.get(messages.CONVERSATION_HEADER), rid
            )
            retain = Retain.COUNT if s.serve_do_not_store else Retain.ALL
            batch = [
                messages.as_message(f"{rid}-{i}", conversation, text, f"input[{i}]", s.limits)
                for i, text in enumerate(texts)
            ]
            counts = await service.measure(texts)
            for i, n in enumerate(counts):
                if n == 0:
                    raise messages.unreadable_input(f"input[{i}]", texts[i])
            service.charge(caller.limit_key, sum(counts))
            scored = await service.score(batch, [retain] * len(batch), counts)
            results = [messages.probe_result(scored, i, probe) for i in range(len(texts))]
            out = ModerationResponse(
                id=rid,
                model=f"{probe}@v{results[0].version}",
                results=[_result(r, scored.specs[(probe, r.version)]) for r in results],
            )
            return JSONResponse(out.model_dump(mode="json"))

        return await handle(request, OPENAI, work)


def _texts(req: ModerationRequest) -> list[str]:
    if isinstance(req.input, str):
        return [req.input]
    texts = []
    for i, part in enumerate(req.input):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, TextInput):
            texts.append(part.text)
        else:
            raise ApiError(
                400,
                "image inputs are not supported: probeguard moderates text",
                param=f"input[{i}]",
                code="unsupported_input_type",
            )
    if not texts:
        raise ApiError(400, "input must hold at least one text", param="input")
    return texts


def _result(result: ProbeResult, spec: ProbeSpec) -> ModerationResult:
    labels = category_labels(spec)
    names = list(OPENAI_CATEGORIES) + [x for x in labels if x not in OPENAI_CATEGORIES]
    predicted = set(result.predicted)
    return ModerationResult(
        flagged=result.flagged,
        categories={c: c in labels and c in predicted for c in names},
        category_scores={c: messages.label_score(result, c) if c in labels else 0.0 for c in names},
        category_applied_input_types={c: ["text"] if c in labels else [] for c in names},
    )
