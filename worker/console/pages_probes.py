"""The Probes page: stages, evidence and plots; operators change stages from it.

A change is two POSTs: the first shows what will happen and asks for a reason (nothing
changes yet), the second (``confirm=1``) makes it through
:class:`worker.rollout.operator.Operator`, the class ``probeguard probe`` uses: same
refusals, same compare-and-set. The stages the operator looked at travel with the
form, so a change made meanwhile by the updater (or another operator) refuses the click
instead of being overridden unseen. The pin is part of what they saw: on a pinned probe
every change works as with the CLI (a live rollback, say, pins it again), and only a pin
or unpin made since the page was shown refuses the click. Every event records
``<user> (console)`` as actor.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.responses import Response

from worker.console import web
from worker.console.context import console_of, user_of
from worker.console.probes_view import probe_page
from worker.console.web import flash, see_other
from worker.errors import ProbeguardError
from worker.rollout.operator import Operator
from worker.store.checkpoints import CheckpointRegistry, Stages

__all__ = ["router"]

router = APIRouter()
Action = Literal["promote", "canary", "rollback", "rollback_canary", "pin", "unpin"]
VERBS: dict[str, str] = {
    "promote": "Make v{v} live now",
    "canary": "Put v{v} on trial for {share:.0%} of conversations",
    "rollback": "Roll back live v{live}: the previous live version returns, v{live} is marked "
    "bad and the probe is pinned",
    "rollback_canary": "End canary v{canary}'s trial and mark it bad",
    "pin": "Pin: freeze automatic stage changes",
    "unpin": "Unpin: resume automatic stage changes",
}


def _probe(request: Request, name: str | None) -> str:
    names = console_of(request).settings.probe_names
    if name is None:
        return names[0]
    if name not in names:
        raise web.Forbidden(f"unknown probe {name[:64]!r}; this console serves {names}")
    return name


def _version(v: str) -> int | None:
    """A posted version number, or None: ASCII digits only (``"²".isdigit()`` is True
    and ``int("²")`` raises) and at most 18 of them (``int`` refuses over 4,300)."""
    v = v.strip()
    return int(v) if v.isascii() and v.isdigit() and len(v) <= 18 else None


@router.get("/probes")
def probes(request: Request, probe: str | None = None) -> HTMLResponse:
    console = console_of(request)
    user = user_of(request)
    name = _probe(request, probe)
    registry = CheckpointRegistry(
        console.client, console.keys, name, signing_key=console.settings.signing_key
    )
    view = probe_page(registry, console.evidence, console.settings, console.explainer)
    return console.page(
        request,
        "probes.html",
        user=user,
        probe=name,
        view=view,
        operator=user.may("change_stages"),
        default_share=console.settings.canary_share,
    )


@router.post("/probes/change")
def change(
    request: Request,
    probe: Annotated[str, Form()],
    action: Annotated[Action, Form()],
    version: Annotated[str, Form()] = "",
    share: Annotated[float | None, Form()] = None,
    reason: Annotated[str, Form()] = "",
    force: Annotated[bool, Form()] = False,
    confirm: Annotated[bool, Form()] = False,
    seen_live: Annotated[str, Form()] = "",
    seen_canary: Annotated[str, Form()] = "",
    seen_pinned: Annotated[str, Form()] = "",
    csrf: Annotated[str, Form()] = "",
) -> Response:
    console = console_of(request)
    user = user_of(request)
    web.check_csrf(request, csrf)
    web.require(user, "change_stages")
    name = _probe(request, probe)
    registry = CheckpointRegistry(
        console.client, console.keys, name, signing_key=console.settings.signing_key
    )
    seen = Stages(live=_version(seen_live), canary=_version(seen_canary), pinned=seen_pinned == "1")
    v = _version(version)
    share = console.settings.canary_share if share is None else share
    back = f"/probes?probe={name}"
    if action in ("promote", "canary") and v is None:
        flash(request, f"{action} needs a version", "error")
        return see_other(back)
    if not confirm:
        what = VERBS[action].format(v=v, share=share, live=seen.live, canary=seen.canary)
        return console.page(
            request,
            "confirm.html",
            user=user,
            probe=name,
            action=action,
            what=what,
            version=version,
            share=share,
            force=force,
            seen_live=seen_live,
            seen_canary=seen_canary,
            seen_pinned="1" if seen.pinned else "",
            back=back,
        )
    return _apply(request, registry, user.name, action, v, share, reason, force, seen, back)


def _apply(
    request: Request,
    registry: CheckpointRegistry,
    who: str,
    action: str,
    v: int | None,
    share: float,
    reason: str,
    force: bool,
    seen: Stages,
    back: str,
) -> RedirectResponse:
    console = console_of(request)
    op = Operator(registry, console.evidence, actor=f"{who} (console)")
    reason = reason.strip()[:500]
    try:
        if action == "promote" and v is not None:
            said = op.promote(v, reason=reason, force=force, expect=seen)
        elif action == "canary" and v is not None:
            said = op.canary(v, share, reason=reason, force=force, expect=seen)
        elif action == "rollback":
            said = op.rollback(reason=reason, expect=seen)
        elif action == "rollback_canary":
            said = op.rollback(canary=True, reason=reason, expect=seen)
        elif action == "pin":
            said = op.pin(reason=reason)
        else:
            said = op.unpin(reason=reason)
    except ProbeguardError as exc:
        flash(request, f"refused: {exc}", "error")
        return see_other(back)
    note = op.policy_note()
    flash(request, said.replace("\n", "; ") + (f". Note: {note}" if note else ""))
    return see_other(back)
