"""The Explain page: a text box; the decomposition ``probeguard explain`` prints, with the
Ecco views (the lens at any position, a token's rank at every layer and position, two
candidate tokens compared) when the form asks for them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse

from worker.console import web
from worker.console.context import console_of, user_of
from worker.errors import ExplainError
from worker.explain.breakdown import ExplainOptions

__all__ = ["router"]

router = APIRouter()

MAX_TOKEN_CHARS = 64  # a token's text; real vocabularies' longest are far shorter
NO_VIEWS = {"position": "", "rank": "", "rank_next": False, "compare_a": "", "compare_b": ""}


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
        views=NO_VIEWS,
        report=None,
        error=console.explainer.status,
    )


@router.post("/explain")
def explain_page(
    request: Request,
    text: Annotated[str, Form()] = "",
    probe: Annotated[str, Form()] = "",
    stage: Annotated[Literal["live", "canary"], Form()] = "live",
    position: Annotated[str, Form()] = "",
    rank: Annotated[str, Form()] = "",
    rank_next: Annotated[bool, Form()] = False,
    compare_a: Annotated[str, Form()] = "",
    compare_b: Annotated[str, Form()] = "",
    csrf: Annotated[str, Form()] = "",
) -> HTMLResponse:
    console = console_of(request)
    user = user_of(request)
    web.check_csrf(request, csrf)  # not a state change, but it spends the CPU
    names = console.settings.probe_names
    views = {
        "position": position[:16],
        "rank": rank[:MAX_TOKEN_CHARS],
        "rank_next": rank_next,
        "compare_a": compare_a[:MAX_TOKEN_CHARS],
        "compare_b": compare_b[:MAX_TOKEN_CHARS],
    }
    report, status = None, 200
    limit = console.settings.max_text_chars
    options, error = _options(views, rank, compare_a, compare_b, position)
    if error:
        status = 400
    elif probe not in names:
        error, status = f"unknown probe; this console serves {names}", 400
    elif not text.strip():
        error, status = "type a message to explain", 400
    elif len(text) > limit:
        error, status = f"the text has {len(text)} characters; the limit is {limit}", 400
    else:
        try:
            report = console.explainer.explain(probe, text, stage=stage, options=options)
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
        views=views,
        report=report,
        error=error,
    )


def _options(
    views: dict[str, Any], rank: str, a: str, b: str, position: str
) -> tuple[ExplainOptions, str]:
    """The form's Ecco fields as options, or a reason to refuse them. A token field keeps its
    spaces (``" is"`` is one token); an empty field asks for nothing."""
    if any(len(t) > MAX_TOKEN_CHARS for t in (rank, a, b)):
        return ExplainOptions(), f"a token has at most {MAX_TOKEN_CHARS} characters"
    if bool(a) != bool(b):
        return ExplainOptions(), "name both tokens to compare, A and B"
    if rank and views["rank_next"]:
        return ExplainOptions(), "rank one token or the actual next tokens, not both"
    try:
        index = int(position) if position.strip() else -1
    except ValueError:
        return ExplainOptions(), f"position {position[:16]!r} is not a whole number"
    return (
        ExplainOptions(
            position=index,
            rank=rank or None,
            rank_next=bool(views["rank_next"]),
            compare=(a, b) if a else None,
        ),
        "",
    )
