"""Which probe architecture is best on a dataset? Fit each on a train cache, score on validation.

Question: on a labeled dataset (train -> fit, validation -> early stopping and
thresholds), what validation F1 and AUPRC do the probe kinds reach, with how
many parameters and how much training time?

Configurations (``--configs``, comma-separated):

- ``mean-best``: mean pooling on one layer; every cached layer is tried and the
  one with the best validation AUPRC is reported (so, like the thresholds, it is
  chosen on validation);
- ``mean-mix`` / ``max-mix``: mean / max pooling over every cached layer with an
  ELMo scalar mix (trained on the cached per-layer summaries);
- ``gate``: scoring gate over the token-level layers, scalar mix;
- ``gate-gate``: scoring gate with a learned per-input gate over layers;
- ``mha``: downcast multi-head attention over the token-level layers, scalar mix.

Build the caches first, e.g.::

    D=../shared/data/toxicchat C=runs/cache/toxicchat
    probeguard cache build --data $D/train.jsonl --out $C-train
    probeguard cache build --data $D/validation.jsonl --out $C-validation
    python bench/probe_table.py --train-cache $C-train --val-cache $C-validation

Prints one line per configuration, then one JSON object (the last line).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from probes.offline.cache import HiddenStateCache
from probes.offline.fit import FitConfig, FitResult
from schemas import LayerMix, TokenPool
from worker.offline.fit_eval import ProbeOptions, dir_size, fit_probe, save_fit

CONFIGS: dict[str, tuple[TokenPool, LayerMix]] = {
    "mean-best": ("mean", "single"),
    "mean-mix": ("mean", "scalar_mix"),
    "max-mix": ("max", "scalar_mix"),
    "gate": ("gate", "scalar_mix"),
    "gate-gate": ("gate", "gate"),
    "mha": ("mha", "scalar_mix"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--train-cache", type=Path, required=True)
    p.add_argument("--val-cache", type=Path, required=True)
    p.add_argument("--target", choices=["label", "labels"], default="label")
    p.add_argument("--flag-labels", default=None, help="comma-separated (default: fit's default)")
    p.add_argument("--configs", default="mean-best,mean-mix,max-mix,gate,mha")
    p.add_argument("--out", type=Path, default=None, help="write each checkpoint under this folder")
    p.add_argument("--lr", type=float, default=3e-4, help="Lion learning rate for every fit")
    p.add_argument(
        "--scan-lr", type=float, default=1e-3, help="Lion learning rate of the layer scan"
    )
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--layer-lr-scale", type=float, default=30.0)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--balance", choices=["weights", "sampler", "none"], default="weights")
    p.add_argument("--d-inner", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p.parse_args(argv)


def fit_one(
    args: argparse.Namespace,
    train: HiddenStateCache,
    val: HiddenStateCache,
    pool: TokenPool,
    mix: LayerMix,
    layers: list[int] | None,
    lr: float,
) -> tuple[dict[str, Any], FitResult]:
    """Fit one probe; its summary row and the full result."""
    flags = None if args.flag_labels is None else args.flag_labels.split(",")
    opts = ProbeOptions(
        token_pool=pool,
        layer_mix=mix,
        layers=layers,
        target=args.target,
        flag_labels=flags,
        d_inner=args.d_inner,
        num_heads=args.num_heads,
        dropout=args.dropout,
    )
    config = FitConfig(
        lr=lr,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size,
        max_epochs=args.epochs,
        patience=args.patience,
        balance=args.balance,
        seed=args.seed,
        layer_lr_scale=args.layer_lr_scale,
    )
    result, _ = fit_probe(train, opts, config, val_cache=val)
    r = result.val_report
    row = {
        "pool": pool,
        "mix": mix,
        "layers": list(result.probe.layers),
        "f1": r["f1"],
        "auprc": r["auprc"],
        "accuracy": r["accuracy"],
        "macro_f1": r["macro_f1"],
        "macro_auprc": r["macro_auprc"],
        "headline": r["headline"],
        "parameters": result.probe.num_parameters(),
        "train_seconds": round(result.seconds, 1),
        "best_epoch": result.best_epoch,
        "epochs": result.epochs,
        "layer_entropy": round(result.probe.layer_entropy(), 3),
        "layer_weights": [round(float(w), 4) for w in result.probe.layer_weights()],
        "thresholds": result.probe.spec.thresholds,
    }
    if "micro_f1" in r:
        row["micro_f1"] = r["micro_f1"]
    return row, result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    train, val = HiddenStateCache(args.train_cache), HiddenStateCache(args.val_cache)
    m = train.manifest
    rows = []
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        pool, mix = CONFIGS[name]
        started = time.perf_counter()
        if name == "mean-best":
            scan = []
            for layer in m.summary_layers:
                row, _ = fit_one(args, train, val, pool, mix, [layer], args.scan_lr)
                scan.append(row)
                print(
                    f"  scan layer {layer:2d}: F1 {row['f1']:.3f} AUPRC {row['auprc']:.3f}",
                    file=sys.stderr,
                )
            best = max(scan, key=lambda r: r["auprc"] if not math.isnan(r["auprc"]) else -1)
            row = {
                **best,
                "scan": [
                    {"layer": r["layers"][0], "f1": r["f1"], "auprc": r["auprc"]} for r in scan
                ],
            }
            row["scan_seconds"] = round(time.perf_counter() - started, 1)
            result = None
        else:
            row, result = fit_one(args, train, val, pool, mix, None, args.lr)
        row["config"] = name
        if args.out is not None and result is not None:
            save_fit(result, args.out / name, train)
        rows.append(row)
        layers = row["layers"] if len(row["layers"]) < 10 else f"{len(row['layers'])} layers"
        print(
            f"{name:10s} F1 {row['f1']:.3f}  AUPRC {row['auprc']:.3f}  "
            f"params {row['parameters']:>9,d}  train {row['train_seconds']:7.1f} s  "
            f"epochs {row['best_epoch']}/{row['epochs']}  layers {layers}",
            flush=True,
        )
    size_train = dir_size(args.train_cache)
    summary = {
        "train_cache": str(args.train_cache),
        "val_cache": str(args.val_cache),
        "target": args.target,
        "llm": m.llm.model_id,
        "train_rows": m.source.rows,
        "cache_mb_per_1000_messages": round(size_train / m.source.rows * 1000 / 1e6, 1),
        "token_layers": m.token_layers,
        "threads": torch.get_num_threads(),
        "results": rows,
    }
    print(json.dumps(summary, default=lambda x: None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
