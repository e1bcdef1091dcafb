"""``probeguard default build|show``: the packaged default probe (moderation on day one)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from worker.commands._common import layer_list, offline_errors

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "default",
        help="build or show the packaged default probe (multi-head, trained on public data)",
        description="The packaged default is a multi-head probe a scorer serves when nothing "
        "is published and an updater fine-tunes from. Its recipe (heads, datasets, licenses) "
        "is worker/offline/default_recipe.py.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build",
        help="rebuild the default from the datasets' train splits (fixed seeds)",
        description="Builds (or resumes) a hidden-state cache per dataset; holds out 20% of "
        "each train split by id hash; cross-validates the multi-head default on the other "
        "80%, calibrates each head out of fold and sets the flag thresholds so that the "
        "whole policy (any head) flags the most out-of-fold unsafe rows while flagging at "
        "most the budget of every source's benign rows; measures it on the held-out rows; "
        "then writes the checkpoint and its data card (with the thresholds for other "
        "budgets). The LLM comes from PROBEGUARD_MODEL and the text form from "
        "PROBEGUARD_TEXT_FORM (chat: the folder gets a -chat suffix). On 2 CPU cores once "
        "the caches exist: 20-40 minutes for the raw form's fifteen seeds, about 7 for "
        "the chat form's one, 35 for fifteen (building the caches: about 30-40; the chat "
        "form's took 26 on cores shared with other work).",
    )
    build.add_argument(
        "--data-root",
        type=Path,
        required=True,
        help="folder holding <dataset>/train.jsonl for every dataset of the recipe",
    )
    build.add_argument(
        "--out", type=Path, default=None, help="checkpoint folder (default: the package's own)"
    )
    build.add_argument(
        "--cache-root",
        type=Path,
        default=Path("runs/default-cache"),
        help="where the per-dataset caches go (default: runs/default-cache; resumed)",
    )
    build.add_argument(
        "--noncommercial",
        action="store_true",
        help="also train on non-commercial data (ToxicChat, CC-BY-NC-4.0): the result may "
        "only be used non-commercially",
    )
    build.add_argument("--epochs", type=int, default=25, help="most epochs (default 25)")
    build.add_argument("--patience", type=int, default=4, help="early-stopping patience (4)")
    build.add_argument(
        "--pool",
        choices=["mean", "max", "last", "gate", "mha"],
        default=None,
        help="token pooling (default: the recipe's mean over every layer; last: the last "
        "token's states, in the chat form the end of the assistant header)",
    )
    build.add_argument(
        "--layers",
        type=layer_list,
        default=None,
        help="hidden-state indices the probe mixes, e.g. 24-30 or 22,26,30 (default: every "
        "layer for mean, max and last; the cached token layers for gate and mha)",
    )
    build.add_argument(
        "--solver",
        choices=["lion", "logistic", "lion+logistic"],
        default=None,
        help="lion: Lion epochs over the layer mix and heads, chosen by cross-validation; "
        "logistic: each head a logistic regression on the mean of the layers, its L2 "
        "strength chosen by leaving one dataset out (mean, max or last pool); "
        "lion+logistic (default for those pools; lion for the others): the Lion fit, then "
        "logistic heads on the layer mix it learned wherever a dataset can be left out to "
        "choose their strength (the other heads stay Lion's)",
    )
    build.add_argument(
        "--source-invariant",
        type=_heads,
        default=None,
        metavar="HEADS",
        help="the logistic heads held orthogonal to the directions in which their positive "
        "rows' mean states differ from one dataset to the next (the datasets' style, not "
        "the category): comma-separated names, all, or none (default: the recipe's: "
        "toxicity in the raw form, none in the chat form)",
    )
    build.add_argument(
        "--budget",
        type=float,
        default=None,
        help="the share of each benign source the flag policy may flag out of fold "
        "(default: the recipe's 0.03; contrastive test suites get 3 times it)",
    )
    build.add_argument(
        "--budget-price",
        choices=["share", "scarcity"],
        default=None,
        help="what a flagged benign row costs the budget rule: its share of its dataset or "
        "its share of what the dataset's budget has left (default: the recipe's for the "
        "text form; docs/default-probe.md)",
    )
    build.add_argument(
        "--budget-rule",
        choices=["greedy", "joint", "heads"],
        default=None,
        help="how the flag thresholds are chosen: greedy, label by label (at "
        "--budget-price); joint, every label's at once for the datasets' unsafe recall; "
        "heads, joint with each label's own recall on its rows counted as much, so no "
        "head is set out of reach (default: the recipe's for the text form; "
        "docs/default-probe.md)",
    )
    build.add_argument("--folds", type=int, default=4, help="cross-validation folds (4)")
    build.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    build.add_argument(
        "--seeds",
        type=_count,
        default=None,
        metavar="N",
        help="repeat the cross-validations with the seeds SEED .. SEED+N-1 and ship the "
        "soup of every seed's fold models, at about N times the fits' time (default: the "
        "recipe's for the text form, 15 raw and 1 chat; two builds of 15 disjoint seeds "
        "agreed where 5 did not: docs/default-probe.md)",
    )
    build.add_argument(
        "--rule-inputs",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write what the budget rule chose the thresholds on (each development "
        "row's out-of-fold probabilities, source and role) to FILE, so "
        "bench/threshold_rules.py compares rules and budgets on this fit without a refit",
    )
    build.add_argument(
        "--variant",
        type=_variant,
        default=None,
        metavar="FILE",
        help="a JSON object editing the recipe's sources, to measure a change before the "
        "recipe takes it: dataset -> the fields it replaces (heads, cap, repeat, benign, "
        "unsafe, hard) or null to leave the dataset out, e.g. "
        '{"toxigen_demonstrations": {"heads": {"hate": {"hate": ["hate"], "neutral": []}}}}; '
        "the card records it (not with --pin: to ship a change, edit the recipe)",
    )
    build.add_argument(
        "--pin", action="store_true", help="record the new manifest's sha256 in pins.json"
    )
    build.set_defaults(func=_build)
    show = actions.add_parser("show", help="print the packaged defaults' data cards")
    show.add_argument("--json", action="store_true", help="print the cards as JSON")
    show.set_defaults(func=_show)


@offline_errors
def _build(args: argparse.Namespace) -> int:
    import hashlib

    from probes.offline.fit import FitConfig
    from worker.defaults import PINS, ROOT, folder_name
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.precision import resolve_state_dtype
    from worker.offline.default_probe import BUDGET, POOL, SEEDS, build_default
    from worker.settings import load_settings

    if args.variant and args.pin:
        raise SystemExit(
            "--variant builds a measurement, not a default: to ship the change, edit the "
            "recipe (worker/offline/default_recipe.py) and build it without --variant"
        )
    settings = load_settings()
    extractor = HiddenStateExtractor.from_settings(settings)
    # One folder per LLM and text form: the chat form's default sits beside the raw one.
    out = args.out or ROOT / folder_name(extractor.fingerprint, noncommercial=args.noncommercial)
    seeds = args.seeds or SEEDS.get(extractor.fingerprint.form, 1)
    config = FitConfig(max_epochs=args.epochs, patience=args.patience, seed=args.seed, seeds=seeds)
    result = build_default(
        args.data_root,
        out,
        extractor,
        cache_root=args.cache_root,
        noncommercial=args.noncommercial,
        config=config,
        pool=args.pool or POOL,
        layers=args.layers,
        solver=args.solver,
        invariant=args.source_invariant,
        price=args.budget_price,
        budget_rule=args.budget_rule,
        budget=BUDGET if args.budget is None else args.budget,
        folds=args.folds,
        key=settings.cache_key_bytes,
        dtype=resolve_state_dtype(settings.state_dtype, extractor.model_type),
        rule_inputs=args.rule_inputs,
        variant=args.variant,
    )
    if args.pin:
        pins = json.loads(PINS.read_text()) if PINS.is_file() else {}
        pins[out.name] = hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
        # The card carries the operating points a deployment may switch to: pinned too.
        pins[f"{out.name}/card.json"] = hashlib.sha256((out / "card.json").read_bytes()).hexdigest()
        PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
    print(json.dumps({"out": str(out), **result.card}, indent=1))
    return 0


def _variant(value: str) -> dict:
    """``--variant``: a readable JSON object (its names are checked against the recipe
    before the LLM loads: :func:`~worker.offline.default_recipe.vary`)."""
    from worker.offline.default_recipe import SOURCES, vary

    try:
        variant = json.loads(Path(value).read_text())
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{value}: {exc}") from exc
    if not isinstance(variant, dict):
        raise argparse.ArgumentTypeError(f"{value}: not a JSON object of dataset -> edits")
    try:
        vary(SOURCES, variant)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value}: {exc}") from exc
    return variant


def _count(value: str) -> int:
    """``--seeds``: a whole number, at least 1 (checked before the LLM loads)."""
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"not a whole number >= 1: {value!r}")
    return int(value)


def _heads(value: str) -> list[str]:
    """``--source-invariant``: head names, ``all`` or ``none``."""
    from worker.offline.default_recipe import HEADS

    names = [h.name for h in HEADS]
    if value.strip() in ("all", "none"):
        return names if value.strip() == "all" else []
    heads = [h.strip() for h in value.split(",") if h.strip()]
    if unknown := sorted(set(heads) - set(names)):
        raise argparse.ArgumentTypeError(f"unknown heads {unknown}; the recipe has {names}")
    return heads


def _show(args: argparse.Namespace) -> int:
    from worker.defaults import PINNED, ROOT

    cards = {}
    for folder in sorted(p for p in ROOT.iterdir() if (p / "card.json").is_file()):
        cards[folder.name] = {
            "pinned": folder.name in PINNED,
            **json.loads((folder / "card.json").read_text()),
        }
    if args.json:
        print(json.dumps(cards, indent=1))
        return 0
    if not cards:
        print("this release ships no packaged default")
    for name, card in cards.items():
        form = f", chat form {card['text_form']}" if card.get("text_form") else ""
        print(f"{name}: {card['name']} on {card['llm']}{form} ({card['license']})")
        print(f"  heads: {', '.join(h['name'] for h in card['heads'])}")
        print(f"  flags: {', '.join(card['flag_labels'])}")
        for source in card["sources"]:
            print(f"  trained on {source['dataset']} ({source['license']}): {source['rows']}")
        fit = card.get("fit", {})
        if "solver" in fit:
            kept, held = fit.get("lion_heads"), fit.get("source_invariant")
            print(f"  fitted by {fit['solver']} over layers {fit['layers'][0]}-{fit['layers'][-1]}"
                  + (f" (Lion's heads kept: {', '.join(kept)})" if kept else ""))  # fmt: skip
            if held:
                print(f"  held off the sources' directions: {', '.join(held)}")
            if (n := fit.get("seeds", 1)) > 1:
                first = fit["seed"]
                print(f"  the soup of {n} seeds' fold models (seeds {first}-{first + n - 1})")
        if "budget" in card:
            price, rule = fit.get("budget_price"), fit.get("budget_rule")
            print(f"  flag budget: {card['budget']:g} of ordinary chat (card ships "
                  f"{', '.join(card.get('operating_points', {}))})"
                  + (f", priced by {price}" if price else "")
                  + (", thresholds chosen jointly" if rule in ("joint", "heads") else "")
                  + (", each head's own recall counted" if rule == "heads" else ""))  # fmt: skip
        for what in ("benign", "unsafe"):
            if rates := card.get(f"oof_{what}_flagged"):
                print(f"  out of fold, {what} rows flagged: "
                      + ", ".join(f"{k} {v:.1%}" for k, v in rates.items()))  # fmt: skip
        if recall := card.get("oof_head_recall"):
            print("  out of fold, each head's own rows it flags: "
                  + ", ".join(f"{k} {v:.1%}" for k, v in recall.items()))  # fmt: skip
        if ranked := card.get("oof_policy_auprc"):
            print("  out of fold, the policy's AUPRC (benign against unsafe rows): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ranked.items()))  # fmt: skip
        if left := card.get("oof_left_out_benign_flagged"):
            within = card.get("oof_benign_flagged", {})
            print("  out of fold, benign rows flagged at thresholds chosen without them: "
                  + ", ".join(f"{k} {v:.1%}" + (f" (with them {within[k]:.1%})" if k in within
                              else "") for k, v in left.items()))  # fmt: skip
        for dataset, measured in card["held_out"].items():
            policy = measured.get("policy", {})
            shares = [f"{k} {policy[k]:.1%}" for k in ("benign_flagged", "unsafe_flagged")
                      if policy.get(k) is not None]  # fmt: skip
            if shares:
                print(f"  held-out {dataset:<24} policy: " + ", ".join(shares))
            for head, m in measured.get("heads", measured).items():
                if None in (m.get("f1"), m.get("auprc"), m.get("recall_at_1pct_fpr")):
                    continue  # no positives held out (e.g. a set of benign rows only)
                print(
                    f"  held-out {dataset:<24} {head:<17} F1 {m['f1']:.3f}  AUPRC "
                    f"{m['auprc']:.3f}  R@1%FPR {m['recall_at_1pct_fpr']:.3f}  (n={m['rows']})"
                )
    return 0
