"""The Explain page: a text box; the decomposition ``probeguard explain`` prints."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse

from worker.console import web
from worker.console.context import console_of, user_of
from worker.errors import ExplainError

__all__ = ["router"]

router = APIRouter()


@router.get("/explain")
def explain_form(request: Request) -> HTMLResponse:
    console = console_of(request)
    return console.page(
        request,
        "explain.html",
        user=user_of(request),
        text="",
        probe=console.settings.probe_names[0],
        stage="live",
        report=None,
        error=console.explainer.status,
    )


@router.post("/explain")
def explain_page(
    request: Request,
    text: Annotated[str, Form()] = "",
    probe: Annotated[str, Form()] = "",
    stage: Annotated[Literal["live", "canary"], Form()] = "live",
    csrf: Annotated[str, Form()] = "",
) -> HTMLResponse:
    console = console_of(request)
    user = user_of(request)
    web.check_csrf(request, csrf)  # not a state change, but it spends the CPU
    names = console.settings.probe_names
    report, error, status = None, "", 200
    limit = console.settings.max_text_chars
    if probe not in names:
        error, status = f"unknown probe; this console serves {names}", 400
    elif not text.strip():
        error, status = "type a message to explain", 400
    elif len(text) > limit:
        error, status = f"the text has {len(text)} characters; the limit is {limit}", 400
    else:
        try:
            report = console.explainer.explain(probe, text, stage=stage)
        except ExplainError as exc:
            error, status = str(exc), 422
    return console.page(
        request,
        "explain.html",
        status=status,
        user=user,
        text=text[:limit],
        probe=probe if probe in names else names[0],
        stage=stage,
        report=report,
        error=error,
    )
