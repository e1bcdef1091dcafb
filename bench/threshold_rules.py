"""What would another budget rule, budget or price pick on the same fit, and what would it
flag out of fold? Reads the rule inputs a build saved (``probeguard default build
--rule-inputs FILE``: each development row's out-of-fold probabilities of the flagging
labels, its source and role); no refit, and no held-out row is read, so it can be run on
any variant before one is chosen to be judged held out.

Per rule (``--rules``, at ``--budget`` and ``--price``, both defaulting to the build's):
the thresholds, the share of each source's benign and unsafe rows flagged, each label's
own rows its head flags (``--own-rows``: the least a label needs to count in the heads
rule, :data:`worker.offline.default_probe.OWN_ROWS` by default), the policy's AUPRC per
source, and each large benign source's share flagged at thresholds chosen without it.
``--checkpoint DIR --out NEW --rule R`` also writes DIR's probe with the thresholds ``R``
picks (DIR must be the build the inputs came from), for ``bench/default_candidate.py``.

Example (seconds; the left-out shares take most of it)::

    probeguard default build --data-root ../shared/data --cache-root CACHES --out OUT \\
        --rule-inputs OUT.rules
    python bench/threshold_rules.py --rule-inputs OUT.rules --rules joint,heads \\
        --checkpoint OUT --out OUT-joint --rule joint

The raw heads rule's build at 0.03, joint -> heads: the policy's AUPRC ConvAbuse 0.847 ->
0.823, OpenAI 0.785 -> 0.771, the loss held out showed after (docs/default-probe.md, "The
heads rule in the raw form, judged held out"). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from probes import load_checkpoint, save_checkpoint
from probes.budget import flag_rates
from worker.offline.default_probe import (
    BUDGETS,
    OWN_ROWS,
    SHIPPED_WEIGHTS,
    RuleInputs,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import log

RULES = ("greedy", "joint", "heads")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rule-inputs", type=Path, required=True, help="`default build --rule-inputs`")
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated (default: all)")
    p.add_argument("--budget", type=float, default=None, help="default: the build's")
    p.add_argument("--price", choices=["share", "scarcity"], default=None,
                   help="the greedy rule's (default: the build's)")  # fmt: skip
    p.add_argument("--own-rows", type=int, default=OWN_ROWS,
                   help=f"least own rows a label needs in the heads rule ({OWN_ROWS})")  # fmt: skip
    p.add_argument("--checkpoint", type=Path, default=None, help="the build's folder")
    p.add_argument("--out", type=Path, default=None, help="where --checkpoint goes rethresholded")
    p.add_argument("--rule", choices=RULES, default=None, help="the rule --out's thresholds are")
    args = p.parse_args(argv)
    args.rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    if unknown := set(args.rules) - set(RULES):
        p.error(f"unknown rules {sorted(unknown)}; known: {', '.join(RULES)}")
    if (args.checkpoint is None) != (args.out is None) or (args.out is None) != (args.rule is None):
        p.error("--checkpoint, --out and --rule go together")
    return args


def measure_rule(inputs: RuleInputs, rule: str, budget: float, price: Any) -> dict[str, Any]:
    """The thresholds ``rule`` picks at ``budget`` and what they flag out of fold."""
    chosen = inputs.points([budget], rule, price)[f"{budget:g}"]  # type: ignore[arg-type]
    ordered = [chosen[x] for x in inputs.flag]

    def rounded(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 4) for k, v in d.items()}

    return {
        "thresholds": rounded(chosen),
        "benign_flagged": rounded(flag_rates(inputs.benign, inputs.groups, ordered)),
        "unsafe_flagged": rounded(flag_rates(inputs.unsafe, inputs.unsafe_groups, ordered)),
        "head_recall": rounded(inputs.head_recall(chosen)),
        "policy_auprc": rounded(inputs.policy_auprc(ordered)),
        "left_out_benign_flagged": rounded(inputs.left_out(budget, rule, price)),  # type: ignore[arg-type]
    }


def rethreshold(
    inputs: RuleInputs, about: dict[str, str], args: argparse.Namespace, budget: float, price: Any
) -> None:
    """``--checkpoint``'s probe with the thresholds ``--rule`` picks, written to ``--out``."""
    probe, manifest = load_checkpoint(args.checkpoint, None)  # verified: its tensors' digest
    if manifest.tensors_sha256 != about.get("checkpoint_tensors_sha256"):
        raise SystemExit(f"{args.rule_inputs} were not saved by the build of {args.checkpoint}")
    if list(probe.spec.flag_labels) != inputs.flag:
        raise SystemExit(f"{args.checkpoint} flags {probe.spec.flag_labels}, not {inputs.flag}")
    points = inputs.points([budget, *BUDGETS], args.rule, price)
    probe.set_thresholds({**probe.spec.thresholds, **points[f"{budget:g}"]})
    save_checkpoint(probe, args.out, llm=manifest.llm, counters=manifest.counters,
                    weights=SHIPPED_WEIGHTS)  # fmt: skip
    log(f"{args.out}: {args.checkpoint} at the {args.rule} rule's thresholds")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    inputs, about = RuleInputs.load(args.rule_inputs)
    budget = args.budget if args.budget is not None else float(about.get("budget", "0.03"))
    price = args.price or about.get("budget_price", "share")
    inputs = replace(inputs, own_rows=args.own_rows)
    out = {}
    for rule in args.rules:
        out[rule] = row = measure_rule(inputs, rule, budget, price)
        log(f"{rule}: thresholds {row['thresholds']}")
        for key in ("benign_flagged", "unsafe_flagged", "head_recall", "policy_auprc",
                    "left_out_benign_flagged"):  # fmt: skip
            print(f"{rule:<7} {key:<24} " + "  ".join(f"{k} {v:.3f}" for k, v in row[key].items()))
    if args.out is not None:
        rethreshold(inputs, about, args, budget, price)
    print(json.dumps({"bench": "threshold_rules", "budget": budget, "price": price,
                      "own_rows": args.own_rows, "built_with": about.get("budget_rule"),
                      "rules": out, "seconds": round(time.time() - started, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
