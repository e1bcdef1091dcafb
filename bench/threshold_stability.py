"""How far do the default's flag thresholds, and what they flag held out, move when the
budget rule's inputs move by as little as another machine's floating point does?

The default's recipe is fitted once on the caches (``fit_default``, the recipe's solver,
pool, held heads and price for the caches' text form, seed 0); then the budget rule
(:class:`worker.offline.default_probe.RuleInputs`) chooses the thresholds again on its
out-of-fold probabilities multiplied by ``1 + noise * N(0, 1)``, ``--draws`` times, and
each draw is measured on the held-out rows (and on ToxicChat's, ``--toxicchat``). Draw 0
is the rule on its inputs as they are. ``--rules`` measures the greedy rule (at the recipe's
price) and the joint one (``probes.budget.joint_thresholds``) side by side on the same fit
and draws. The raw recipe rebuilt on a
second machine (same code and seed, caches built there) flagged 64.2 % of AILuminate's
held-out unsafe prompts where the shipped build flags 75.6 %; this measures that spread on
one machine (docs/default-probe.md, "The budget rule's thresholds move with the machine").

Example (about 9 minutes on 2 CPU cores for the fit, seconds per draw and rule)::

    python bench/threshold_stability.py --cache-root runs/default-cache \\
        --data-root ../shared/data --toxicchat runs/cache/toxicchat-all --draws 4

The last line is one JSON object: per draw and rule, each dataset's policy row (benign and
unsafe shares flagged, AUPRC), the thresholds, and per rule the spread (min, max) of each.
Raw form, four draws: AILuminate flagged 63.2-76.2 % by the greedy rule, 74.6 % in every
draw by the joint one (docs/default-probe.md, "The thresholds chosen jointly").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from probes.offline.cache import HiddenStateCache
from probes.offline.fit import FitConfig
from worker.offline.default_probe import (
    BUDGET,
    INVARIANT,
    POOL,
    PRICE,
    SOLVER,
    RuleInputs,
    fit_default,
    measure,
)
from worker.offline.default_recipe import default_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_probe import _load  # bench/default_probe.py: the held-out rows

from _shared import log

# The columns the spread is reported for: (dataset, policy field).
WATCHED = [
    ("ailuminate_demo", "unsafe_flagged"),
    ("simplesafetytests", "unsafe_flagged"),
    ("toxicchat", "auprc"),
    ("toxicchat", "benign_flagged"),
    ("convabuse", "benign_flagged"),
    ("openai_moderation", "benign_flagged"),
    ("hatecheck", "unsafe_flagged"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-root", type=Path, required=True, help="the recipe's caches")
    p.add_argument("--data-root", type=Path, required=True, help="<dataset>/train.jsonl texts")
    p.add_argument("--toxicchat", type=Path, default=None, help="ToxicChat's cache (all rows)")
    p.add_argument("--draws", type=int, default=4, help="noisy draws after draw 0 (4)")
    p.add_argument("--noise", type=float, default=1e-4, help="relative noise (1e-4)")
    p.add_argument("--budget", type=float, default=BUDGET)
    p.add_argument("--seed", type=int, default=0, help="the fit's seed (0, the recipe's)")
    p.add_argument(
        "--rules",
        default="greedy,joint",
        help="the rules measured side by side on the same fit and draws: greedy (the "
        "recipe's, recall_thresholds at its price), joint (joint_thresholds), heads "
        "(joint_thresholds with each label's own recall counted) (default: greedy,joint)",
    )
    p.add_argument("--temperature", type=float, default=0.25, help="joint's smoothing")
    p.add_argument("--steps", type=int, default=1500, help="joint's most L-BFGS iterations")
    args = p.parse_args(argv)
    if args.draws < 0 or args.noise < 0:
        p.error("--draws and --noise must not be negative")
    args.rules = args.rules.split(",")
    if not args.rules or set(args.rules) - {"greedy", "joint", "heads"}:
        p.error(f"--rules: greedy, joint and/or heads, got {args.rules}")
    return args


def nudged(rule: RuleInputs, noise: float, draw: int) -> RuleInputs:
    """``rule`` with its probabilities times ``1 + noise * N(0, 1)`` (draw 0: as it is)."""
    if draw == 0:
        return rule
    gen = torch.Generator().manual_seed(draw)

    def move(p: torch.Tensor) -> torch.Tensor:
        return (p * (1 + noise * torch.randn(p.shape, generator=gen))).clamp(0.0, 1.0)

    return replace(rule, benign=move(rule.benign), unsafe=move(rule.unsafe))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    llm = HiddenStateCache(args.cache_root / "convabuse").manifest.llm
    spec = default_spec(llm.hidden_size, list(range(llm.num_layers + 1)), pool=POOL)
    loaded, held = _load(spec, args)
    log(f"fitting the {llm.form or 'raw'} recipe (seed {args.seed}) ...")
    price = PRICE.get(llm.form, "share")
    fitted = fit_default(
        loaded, spec, FitConfig(max_epochs=25, patience=4, seed=args.seed), budget=args.budget,
        solver=SOLVER, invariant=INVARIANT.get(llm.form, ()), price=price,
    )  # fmt: skip
    rule, probe = fitted.rule, fitted.result.probe
    draws: list[dict[str, Any]] = []
    for draw in range(args.draws + 1):
        inputs = nudged(rule, args.noise, draw)
        for name in args.rules:
            at = time.time()
            own = {"own": inputs.own} if name == "heads" else {}
            chosen = (
                inputs.thresholds(args.budget, price)
                if name == "greedy"
                else inputs.joint(
                    args.budget, temperature=args.temperature, steps=args.steps, **own
                )
            )
            took = round(time.time() - at, 1)
            probe.set_thresholds({**fitted.thresholds, **chosen})
            rows = {d: measure(probe, item)["policy"] for d, item in held.items()}
            draws.append({"draw": draw, "rule": name, "thresholds": chosen, "policy": rows,
                          "seconds": took})  # fmt: skip
            log(f"draw {draw} {name} ({took} s): "
                + ", ".join(f"{d} {k} {rows.get(d, {}).get(k)}" for d, k in WATCHED))  # fmt: skip
    spread: dict[str, dict[str, list[float]]] = {}
    for name in args.rules:
        mine = [x for x in draws if x["rule"] == name]
        spread[name] = {}
        for d, k in WATCHED:
            values = [x["policy"][d][k] for x in mine if k in x["policy"].get(d, {})]
            if values:
                spread[name][f"{d}.{k}"] = [min(values), max(values)]
        for label in rule.flag:
            values = [x["thresholds"][label] for x in mine]
            spread[name][f"threshold.{label}"] = [round(min(values), 4), round(max(values), 4)]
    keys = list(spread[args.rules[0]])
    print(f"{'column':<36}" + "".join(f" {n + ' min':>12} {n + ' max':>12}" for n in args.rules))
    for key in keys:
        print(f"{key:<36}" + "".join(f" {spread[n][key][0]:>12} {spread[n][key][1]:>12}"
                                     for n in args.rules))  # fmt: skip
    print(json.dumps({"question": "the budget rules' thresholds under 1e-4 noise, held out",
                      "form": llm.form or "raw", "noise": args.noise, "budget": args.budget,
                      "price": price, "temperature": args.temperature, "steps": args.steps,
                      "spread": spread, "draws": draws,
                      "seconds": round(time.time() - started, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
