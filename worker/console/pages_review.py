"""The review queue page: one item at a time, one key per label, skip and undo.

Each answer is a plain form POST followed by a redirect (works without the script;
``static/console.js`` only maps keys to the buttons and renews the claim while the page
is open).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from pydantic import ValidationError

from schemas import DecidedRecord
from worker.console import web
from worker.console.context import Console, console_of, user_of
from worker.console.web import flash, see_other
from worker.errors import ExplainError, ReviewError
from worker.review.queue import ReviewItem
from worker.store.checkpoints import CheckpointRegistry

__all__ = ["router"]

log = logging.getLogger(__name__)
router = APIRouter()
KEYS = "1234567890qwertyiop"  # not s, u: skip and undo


def _queue(console: Console) -> Any:
    if console.queue is None:
        raise web.Forbidden("this console runs without a review queue")
    return console.queue


def _decided(console: Console, message_id: str) -> list[dict[str, Any]]:
    """Every probe's decision on the message, as the scorers recorded it."""
    raw = console.texts.get(console.keys.decided(message_id))
    if raw is None:
        return []
    try:
        record = DecidedRecord.decode(raw)
    except ValidationError:
        return []
    return [
        {"probe": name, "version": d.v, "flagged": d.f, "score": d.s}
        for name, d in sorted(record.p.items())
    ]


def _prompt(console: Console, reply_to: str | None) -> str | None:
    """The text a model's reply answers (from the text cache), for the reviewer to judge the
    reply in its context; None for a message someone sent, or once the cache dropped it."""
    if reply_to is None:
        return None
    raw = console.texts.get(console.keys.text(reply_to))
    return None if raw is None else bytes(raw).decode("utf-8", errors="replace")


def _explanation(console: Console, item: ReviewItem) -> tuple[dict[str, Any] | None, str]:
    """The item's explanation by the version that scored it, else by the live version
    with a note saying so; None and why when neither can explain it."""
    req = item.request
    if not req.version:  # a bootstrap checkpoint (v0) scored it: the registry never held it
        live = CheckpointRegistry(console.client, console.keys, req.probe).stages().live
        if live is None:
            return None, (
                "No explanation: a bootstrap checkpoint (v0) scored this item, and the "
                "registry has no live version yet to explain it with."
            )
        try:
            report = console.explainer.explain(
                req.probe, req.text, version=live, cache_key=item.key, lens=False
            )
        except ExplainError as exc:
            return None, str(exc)
        return report, (
            f"A bootstrap checkpoint (v0) scored this item; it is not in the registry, so this "
            f"is the live version v{live}'s explanation, which may differ from v0's scores."
        )
    try:
        report = console.explainer.explain(
            req.probe, req.text, version=req.version, cache_key=item.key, lens=False
        )
        return report, ""
    except ExplainError as exc:
        note = str(exc)
    try:  # the version may have been pruned: the live one explains it instead
        report = console.explainer.explain(req.probe, req.text, cache_key=item.key, lens=False)
        return report, (
            f"v{req.version} is gone from the registry; this is the live version "
            f"v{report.get('version')}'s explanation"
        )
    except ExplainError:
        return None, note


@router.get("/review")
def review(request: Request) -> HTMLResponse:
    console = console_of(request)
    user = user_of(request)
    queue = _queue(console)
    item = queue.next_item(user.name) if user.may("label") else None
    report, note = _explanation(console, item) if item is not None else (None, "")
    return console.page(
        request,
        "review.html",
        user=user,
        item=item,
        keys=KEYS,
        stats=queue.stats(),
        undoable=queue.undoable(user.name),
        skipped=queue.skipped_by(user.name) if item is None else 0,
        skip_s=console.settings.console_skip_s,
        decided=_decided(console, item.request.message_id) if item else [],
        prompt=_prompt(console, item.request.reply_to) if item else None,
        report=report,
        explain_note=note or console.explainer.status,
        undo_s=console.settings.console_undo_s,
        claim_ttl_s=console.settings.console_claim_ttl_s,
    )


@router.post("/review/answer")
def answer(
    request: Request,
    item: Annotated[str, Form()],
    label: Annotated[list[str] | None, Form()] = None,
    csrf: Annotated[str, Form()] = "",
) -> RedirectResponse:
    user = user_of(request)
    web.check_csrf(request, csrf)
    web.require(user, "label")
    try:
        sent = _queue(console_of(request)).answer(user.name, item, label or [])
        what = ", ".join(sent.all_labels) or "none of the labels"
        undo = console_of(request).settings.console_undo_s
        flash(request, f"{sent.message_id}: {what}" + (f" (u undoes, {undo:g} s)" if undo else ""))
    except ReviewError as exc:
        flash(request, str(exc), "error")
    return see_other("/review")


@router.post("/review/skip")
def skip(
    request: Request, item: Annotated[str, Form()], csrf: Annotated[str, Form()] = ""
) -> RedirectResponse:
    user = user_of(request)
    web.check_csrf(request, csrf)
    web.require(user, "label")
    try:
        _queue(console_of(request)).skip(user.name, item)
        flash(request, "skipped: the item stays in the queue for the others")
    except ReviewError as exc:
        flash(request, str(exc), "error")
    return see_other("/review")


@router.post("/review/undo")
def undo(request: Request, csrf: Annotated[str, Form()] = "") -> RedirectResponse:
    user = user_of(request)
    web.check_csrf(request, csrf)
    web.require(user, "label")
    try:
        item = _queue(console_of(request)).undo(user.name)
        flash(request, f"answer for {item.request.message_id} taken back: answer it again")
    except ReviewError as exc:
        flash(request, str(exc), "error")
    return see_other("/review")


@router.post("/review/heartbeat")
def heartbeat(request: Request) -> JSONResponse:
    """Renews the reviewer's claim while the page is open; returns the queue's numbers."""
    user = user_of(request)
    web.check_csrf(request, None)
    queue = _queue(console_of(request))
    kept = queue.heartbeat(user.name)
    st = queue.stats()
    return JSONResponse(
        {
            "claim_kept": kept,
            "depth": st.depth,
            "waiting": st.waiting,
            "claimed": st.claimed,
            "held": st.held,
            "lag": st.lag,
            "rate": st.rates.get(user.name, 0) / 10.0,
        }
    )
