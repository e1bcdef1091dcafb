"""Perspective's comment analyzer on ``probeguard serve``:
``POST /v1alpha1/comments:analyze``, answered in Perspective's response shape (which of
the probe's labels answer as which attributes: :mod:`worker.serve.mapping`; sentence
spans with ``spanAnnotations``), its refusals in Google's error shape
(``{"error": {"code", "message", "status"}}``) so its clients raise their usual errors.
"""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from schemas import Limits, ProbeResult, ProbeSpec
from schemas.moderation_api import (
    AttributeScores,
    PerspectiveRequest,
    PerspectiveResponse,
    Score,
    SpanScore,
)
from worker.scoring.engine import Retain
from worker.serve import messages
from worker.serve.auth import Caller
from worker.serve.errors import ApiError
from worker.serve.handler import Dialect, Handler, body_schema
from worker.serve.mapping import attribute_labels

if TYPE_CHECKING:
    from worker.serve.service import Service

__all__ = ["MAX_SPANS", "PERSPECTIVE", "register"]

_SPAN = re.compile(r"[^.!?\n]*(?:[.!?]+|\n|$)")
MAX_SPANS = 16


_GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    408: "DEADLINE_EXCEEDED",
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
}


def _http_status(status: int) -> int:
    """The HTTP status Perspective answers with: a body or text too large is Google's
    400 ``INVALID_ARGUMENT`` (its ``code`` is always the HTTP status)."""
    return 400 if status == 413 else status


def _error(e: ApiError) -> dict[str, Any]:
    code = _http_status(e.status)
    status = _GOOGLE_STATUS.get(code, "INTERNAL")
    return {"error": {"code": code, "message": e.message, "status": status}}


PERSPECTIVE = Dialect("perspective", 403, 400, _error, _http_status)


def register(app: FastAPI, handle: Handler, service: Service) -> None:
    """Add ``POST /v1alpha1/comments:analyze`` to ``app``."""
    s = service.settings

    @app.post(
        "/v1alpha1/comments:analyze",
        response_model=PerspectiveResponse,
        response_model_exclude_none=True,
        openapi_extra=body_schema(PerspectiveRequest),
        summary="Score a comment (Perspective's comments:analyze)",
    )
    async def analyze(request: Request) -> Response:
        async def work(body: bytes, caller: Caller) -> Response:
            req = await service.parser.parse(
                PerspectiveRequest, body, max_inputs=s.serve_max_inputs
            )
            languages = _languages(req.languages)
            text = req.comment.text
            if not text.strip():
                raise ApiError(400, "Comment must be non-empty.", param="comment.text")
            probe = service.probe_for(None)
            attributes = _attributes(req, service.live_spec(probe), probe)
            mid = _client_message_id(caller, req.clientToken, s.limits)
            mid = mid or f"pc-{uuid.uuid4().hex}"
            conversation = messages.conversation_key(
                req.sessionId or request.headers.get(messages.CONVERSATION_HEADER), mid
            )
            private = req.doNotStore or s.serve_do_not_store
            batch = [messages.as_message(mid, conversation, text, "comment.text", s.limits)]
            retain = [Retain.COUNT if private else Retain.ALL]
            spans = _spans(text) if req.spanAnnotations else []
            counts = await service.measure([text] + [text[b:e] for b, e in spans])
            if counts[0] == 0:
                raise messages.unreadable_input("comment.text", text)
            # A sentence the model cannot read (control characters only) gets no span.
            spans = [span for span, n in zip(spans, counts[1:], strict=True) if n > 0]
            service.charge(caller.limit_key, sum(counts))
            for i, (b, e) in enumerate(spans):
                span = messages.as_message(
                    f"{mid}.s{i}", conversation, text[b:e], "comment.text", s.limits
                )
                batch.append(span)
                retain.append(Retain.NOTHING)
            costs = [counts[0]] + [n for n in counts[1:] if n > 0]  # as the spans kept
            scored = await service.score(batch, retain, costs)
            whole = messages.probe_result(scored, 0, probe)
            span_results = [messages.probe_result(scored, i + 1, probe) for i in range(len(spans))]
            out = PerspectiveResponse(
                attributeScores=_scores(req, attributes, whole, spans, span_results, len(text)),
                languages=languages,
                clientToken=req.clientToken,
            )
            return JSONResponse(
                out.model_dump(mode="json", exclude_none=True),
                headers={"X-Probeguard-Message-Id": mid},
            )

        return await handle(request, PERSPECTIVE, work)


def _client_message_id(caller: Caller, token: str | None, limits: Limits) -> str | None:
    """The message id of a Perspective call's ``clientToken``: ``pc:NAME:TOKEN``, in the
    namespace of the caller's key (``pc::TOKEN`` without keys), so two keys sending the
    same token never name one message; None when that is no valid id (the call gets a
    random one, and the token is only echoed). Key names hold no ``:`` and, written here
    with ``_`` as ``.`` (no name holds a ``.``), no two names share a namespace."""
    if not token:
        return None
    mid = f"pc:{(caller.name or '').replace('_', '.')}:{token}"
    return mid if limits.id_re.fullmatch(mid) else None


def _languages(requested: list[str] | None) -> list[str]:
    if not requested:
        return ["en"]
    if not any(x.lower().split("-")[0] == "en" for x in requested):
        raise ApiError(
            400,
            f"Attribute scores are not available in languages {requested[:4]}: the probes "
            "read English (en)",
            param="languages",
            code="LANGUAGE_NOT_SUPPORTED_BY_ATTRIBUTE",
        )
    return requested


def _attributes(req: PerspectiveRequest, spec: ProbeSpec, probe: str) -> dict[str, str]:
    available = attribute_labels(spec)
    unknown = [a for a in req.requestedAttributes if a not in available]
    if unknown:
        raise ApiError(
            400,
            f"Unknown or unsupported attribute: {', '.join(a[:64] for a in unknown[:4])}. "
            f"Probe {probe!r} scores: {', '.join(sorted(available))}",
            param="requestedAttributes",
            code="ATTRIBUTE_NOT_SUPPORTED",
        )
    return {a: available[a] for a in req.requestedAttributes}


def _spans(text: str) -> list[tuple[int, int]]:
    """Sentence spans ``(begin, end)`` of ``text``, whitespace trimmed; at most
    :data:`MAX_SPANS` (the last runs to the end); none when the text is one sentence."""
    spans = []
    for m in _SPAN.finditer(text):
        b, e = m.start(), m.end()
        while b < e and text[b].isspace():
            b += 1
        while e > b and text[e - 1].isspace():
            e -= 1
        if e > b:
            spans.append((b, e))
    if len(spans) > MAX_SPANS:
        spans = [*spans[: MAX_SPANS - 1], (spans[MAX_SPANS - 1][0], spans[-1][1])]
    return spans if len(spans) > 1 else []


def _scores(
    req: PerspectiveRequest,
    attributes: dict[str, str],
    whole: ProbeResult,
    spans: list[tuple[int, int]],
    span_results: list[ProbeResult],
    length: int,
) -> dict[str, AttributeScores]:
    out: dict[str, AttributeScores] = {}
    for attr, label in attributes.items():
        value = messages.label_score(whole, label)
        threshold = req.requestedAttributes[attr].scoreThreshold
        if threshold is not None and value < threshold:
            continue  # Perspective leaves out attributes under their threshold
        span_scores = None
        if req.spanAnnotations:
            pairs = list(zip(spans, span_results, strict=True)) or [((0, length), whole)]
            span_scores = [
                SpanScore(begin=b, end=e, score=Score(value=messages.label_score(r, label)))
                for (b, e), r in pairs
            ]
        out[attr] = AttributeScores(summaryScore=Score(value=value), spanScores=span_scores)
    return out
