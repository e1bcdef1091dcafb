"""``probeguard probe add-head``: give a probe a custom category (a new head).

    probeguard probe add-head PROBE NAME --labels a[,b] [--task multilabel|multiclass]
                              [--flag [a,b]]

The logic, shared with the console, is :func:`worker.rollout.heads.add_head_version`.
"""

from __future__ import annotations

import argparse

__all__ = ["register_add_head"]


def register_add_head(
    acts: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    a = acts.add_parser(
        "add-head",
        parents=parents,
        help="add a head (a custom category) to the live version, as a new version",
        description=(
            "Publish the live version plus a new head NAME as a new candidate version (parent: "
            "live; signed; the rollout policy or `promote` puts it on a stage like any version). "
            "Every other head scores as before; the new head starts at zero and predicts "
            "nothing until the updater has calibrated it. Labels naming the head "
            '(`"head": NAME` in a HumanLabel) train it.'
        ),
    )
    a.add_argument("probe", help="the probe (e.g. moderation)")
    a.add_argument("name", help="the new head's name (e.g. jailbreak)")
    a.add_argument(
        "--labels", required=True, help="its labels, comma-separated (e.g. jailbreaking)"
    )
    a.add_argument(
        "--task",
        choices=["multilabel", "multiclass"],
        default="multilabel",
        help="multilabel (one label: binary; default) or multiclass (a softmax over the labels)",
    )
    a.add_argument(
        "--flag",
        nargs="?",
        const=True,
        default=False,
        metavar="LABELS",
        help="its labels flag verdicts once calibrated (all of them, or those named)",
    )
    a.set_defaults(func=_add_head)


def _add_head(args: argparse.Namespace) -> int:
    from worker.commands._probe_context import note_policy, probe_context
    from worker.rollout.heads import add_head_version, parse_head

    head, flags = parse_head(args.name, args.labels, args.task, args.flag)
    ctx = probe_context(args)
    print(add_head_version(ctx.operator, head, flag_labels=flags, reason=args.reason).message)
    note_policy(ctx)
    return 0
