"""``probeguard probe``: the operator's view of probe versions and their rollout.

    probeguard probe status [--versions N] [--json]
    probeguard probe show VERSION [--json]
    probeguard probe promote VERSION [--force] [--verify-model]
    probeguard probe canary VERSION [--share 0.1] [--force] [--verify-model]
    probeguard probe rollback [--canary] [--no-pin]
    probeguard probe pin | unpin
    probeguard probe history [--count N] [--wide] [--json]
    probeguard probe add-head PROBE NAME --labels a[,b] [--task T] [--flag]  (probe_heads)

Every change is a compare-and-set stage change with an event (actor, reason). Only
Redis is needed. Compatibility of a version with the model is checked against the
live version's LLM fingerprint (cheap; scorers verify the real model anyway and
refuse what does not fit); ``--verify-model`` loads the configured LLM and checks
against it instead (slow, authoritative, and the way through a model migration).
"""

from __future__ import annotations

import argparse
import os
import pwd
import socket
from typing import Any

from worker.commands._probe_context import ProbeContext, note_policy, probe_context

__all__ = ["register"]


def _default_actor() -> str:
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"[:256]


def _parents() -> tuple[argparse.ArgumentParser, ...]:
    """The shared option groups: probe, change (reason/actor), --json, checks (--force...)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--probe", help="probe name (default: PROBEGUARD_TRAIN_PROBE or first)")
    changes = argparse.ArgumentParser(add_help=False)
    changes.add_argument("--reason", default="", help="why (recorded in the event)")
    changes.add_argument("--actor", default=_default_actor(), help="who (default: user@host)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="one JSON object instead of text")
    checks = argparse.ArgumentParser(add_help=False)
    checks.add_argument(
        "--force",
        action="store_true",
        help="override: a rolled-back version, scorer refusals, a canary already on trial",
    )
    checks.add_argument(
        "--verify-model",
        action="store_true",
        help="load the configured LLM and check the version's fingerprint against it "
        "(default: against the live version's)",
    )
    return common, changes, as_json, checks


def register(sub: argparse._SubParsersAction) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "probe",
        help="operate probe versions: status, promote, canary, rollback, pin, history",
        description=(
            "Inspect and change which probe version serves traffic. Reads and writes the Redis "
            "registry (PROBEGUARD_REDIS_URL); every change is recorded as an event with its "
            "actor and reason, and all scorers follow it within the propagation bound. "
            "Exit status 1 with a message when a version does not exist, does not fit the "
            "model, was rolled back, or the change conflicts with the updater's rollout."
        ),
    )
    common, changes, as_json, checks = _parents()
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    a = acts.add_parser(
        "status", parents=[common, as_json], help="stages, shares and evidence per version"
    )
    a.add_argument("--versions", type=int, default=8, help="newest versions shown (default 8)")
    a.set_defaults(func=_status)

    a = acts.add_parser("show", parents=[common, as_json], help="one version's manifest")
    a.add_argument("version", type=int)
    a.set_defaults(func=_show)

    a = acts.add_parser(
        "promote", parents=[common, changes, checks], help="make a version live at once"
    )
    a.add_argument("version", type=int)
    a.set_defaults(func=_promote)

    a = acts.add_parser(
        "canary",
        parents=[common, changes, checks],
        help="trial a version on a share of conversations",
    )
    a.add_argument("version", type=int)
    a.add_argument("--share", type=float, default=None, help="default: PROBEGUARD_CANARY_SHARE")
    a.set_defaults(func=_canary)

    a = acts.add_parser(
        "rollback",
        parents=[common, changes],
        help="restore the previous live version (and pin), or end the canary",
        description=(
            "Without --canary: make the previous live version (from the event history) live "
            "again, mark the current one rolled back (never promoted automatically again) and "
            "pin the probe so automation does not replace the restored version; "
            "`probeguard probe unpin` resumes it. With --canary: end the canary's trial and "
            "mark it rolled back."
        ),
    )
    a.add_argument("--canary", action="store_true", help="roll back the canary instead")
    a.add_argument("--no-pin", action="store_true", help="do not pin after a live rollback")
    a.set_defaults(func=_rollback)

    a = acts.add_parser("pin", parents=[common, changes], help="freeze automatic stage changes")
    a.set_defaults(func=_pin)
    a = acts.add_parser("unpin", parents=[common, changes], help="resume automatic stage changes")
    a.set_defaults(func=_unpin)

    a = acts.add_parser("history", parents=[common, as_json], help="stage-change events")
    a.add_argument("--count", type=int, default=20, help="newest events (default 20)")
    a.add_argument("--wide", action="store_true", help="do not cut lines at 80 columns")
    a.add_argument("--all", action="store_true", help="include 'published' events")
    a.set_defaults(func=_history)

    from worker.commands.probe_heads import register_add_head

    register_add_head(acts, [changes])


# --- context -------------------------------------------------------------------------


def _emit(obj: Any) -> None:
    from worker.commands._common import print_json

    print_json(obj)


def _model(ctx: ProbeContext, args: argparse.Namespace) -> tuple[Any, str]:
    """--verify-model: the configured LLM's fingerprint, as its scorers have it (text form
    included; slow, loaded only after the version is known to exist); else None: checked
    against live's."""
    if not args.verify_model:
        return None, " (--verify-model checks against the configured model instead)"
    from worker.llm.extract import HiddenStateExtractor

    ctx.registry.manifest(args.version)  # an unknown version fails before the slow load
    return HiddenStateExtractor.from_settings(ctx.settings).fingerprint, ""


# --- actions -----------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    from worker.rollout.status import gather
    from worker.rollout.status_text import render_status

    ctx = probe_context(args)
    report = gather(ctx.registry, ctx.evidence, limit=max(1, args.versions), settings=ctx.settings)
    if args.json:
        _emit(report.as_dict())
    else:
        print(render_status(report))
    return 0


def _show(args: argparse.Namespace) -> int:
    from worker.rollout.status import gather_version
    from worker.rollout.status_text import render_version

    ctx = probe_context(args)
    detail = gather_version(ctx.registry, ctx.evidence, args.version)
    if args.json:
        _emit(detail.as_dict())
    else:
        print(render_version(detail))
    return 0


def _promote(args: argparse.Namespace) -> int:
    ctx = probe_context(args)
    model, hint = _model(ctx, args)
    said = ctx.operator.promote(
        args.version, reason=args.reason, force=args.force, fingerprint=model, hint=hint
    )
    print(said)
    note_policy(ctx)
    return 0


def _canary(args: argparse.Namespace) -> int:
    ctx = probe_context(args)
    share = ctx.settings.canary_share if args.share is None else args.share
    model, hint = _model(ctx, args)
    said = ctx.operator.canary(
        args.version, share, reason=args.reason, force=args.force, fingerprint=model, hint=hint
    )
    print(said)
    note_policy(ctx)
    return 0


def _rollback(args: argparse.Namespace) -> int:
    ctx = probe_context(args)
    print(ctx.operator.rollback(canary=args.canary, pin=not args.no_pin, reason=args.reason))
    note_policy(ctx)
    return 0


def _pin(args: argparse.Namespace) -> int:
    print(probe_context(args).operator.pin(reason=args.reason))
    return 0


def _unpin(args: argparse.Namespace) -> int:
    print(probe_context(args).operator.unpin(reason=args.reason))
    return 0


def _history(args: argparse.Namespace) -> int:
    from worker.rollout.status_text import render_history

    ctx = probe_context(args)
    events = [e for _, e in ctx.registry.history(max(1, args.count) * (1 if args.all else 20))]
    if not args.all:
        events = [e for e in events if e.kind != "published"]
    events = events[-max(1, args.count) :]
    if args.json:
        _emit({"probe": ctx.registry.probe, "events": [e.model_dump(mode="json") for e in events]})
    else:
        print(render_history(events, wide=args.wide))
    return 0
