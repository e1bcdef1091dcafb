"""``probeguard fit``: train a probe on a hidden-state cache and write a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from worker.commands._common import layer_list, offline_errors, print_json


def register(sub: argparse._SubParsersAction) -> None:
    from probes import LAYER_MIXES, TOKEN_POOLS
    from probes.fit import FitConfig
    from worker.offline.fit_eval import ProbeOptions

    d, o = FitConfig(), ProbeOptions(token_pool="mha")
    p = sub.add_parser(
        "fit",
        help="train a probe offline on a hidden-state cache; write a checkpoint",
        description=(
            "Lion on mini-batches (<= 256), class-weighted loss or balanced sampling, early "
            "stopping and F1-optimal thresholds on the validation split. The checkpoint carries "
            "the cache's LLM fingerprint, so the worker loads it only with the same LLM."
        ),
    )
    p.add_argument("--cache", type=Path, required=True, help="training cache (cache build)")
    p.add_argument(
        "--val-cache", type=Path, help="validation cache; else --val-fraction of --cache"
    )
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out when no --val-cache")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--pool", choices=sorted(TOKEN_POOLS), help="token pooling kind (required)")
    p.add_argument("--probe", dest="pool_deprecated", help=argparse.SUPPRESS)
    p.add_argument(
        "--layer-mix", choices=sorted(LAYER_MIXES), default="scalar_mix", help="default: scalar_mix"
    )
    p.add_argument(
        "--layers",
        type=layer_list,
        default=None,
        help="hidden-state indices, e.g. 12 or 4,8,12 or 2-20 (default: every cached layer "
        "the probe kind can use; 'single' needs exactly one)",
    )
    p.add_argument(
        "--target",
        choices=["label", "labels"],
        default="label",
        help="'label' = multiclass over the label field; 'labels' = multilabel (default: label)",
    )
    p.add_argument(
        "--flag-labels",
        default=None,
        help="comma-separated labels that flag a message (default: the minority class of a "
        "binary task, every label of a multilabel task, none otherwise)",
    )
    p.add_argument("--name", default=None, help="probe name (default: <pool>-<layer-mix>)")
    p.add_argument("--epochs", type=int, default=d.max_epochs, help="maximum epochs (%(default)s)")
    p.add_argument(
        "--patience", type=int, default=d.patience, help="early-stopping patience in epochs"
    )
    p.add_argument("--lr", type=float, default=d.lr, help="Lion learning rate (%(default)s)")
    p.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="decoupled (%(default)s)"
    )
    p.add_argument(
        "--layer-lr-scale",
        type=float,
        default=d.layer_lr_scale,
        help="learning-rate multiplier of the layer-mix scalars (%(default)s)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="mini-batch size, <= 256")
    p.add_argument("--balance", choices=["weights", "sampler", "none"], default=d.balance)
    p.add_argument("--monitor", choices=["auprc", "f1", "loss"], default=d.monitor)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--d-inner", type=int, default=o.d_inner, help="MHA inner size (%(default)s)")
    p.add_argument("--num-heads", type=int, default=o.num_heads, help="MHA heads (%(default)s)")
    p.add_argument("--heads", type=int, dest="heads_deprecated", help=argparse.SUPPRESS)
    p.add_argument("--no-layer-norm", action="store_true", help="MHA without input LayerNorm")
    p.add_argument("--dropout", type=float, default=o.dropout)
    p.add_argument("--no-standardize", action="store_true", help="skip input standardization")
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="recompute MHA attention in the backward pass (less memory, more compute)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(func=_run)


@offline_errors
def _run(args: argparse.Namespace) -> int:
    from probes.cache import HiddenStateCache
    from probes.fit import FitConfig
    from worker.offline.fit_eval import ProbeOptions, save_fit, train_probe
    from worker.settings import load_settings

    _apply_deprecated(args)
    cache = HiddenStateCache(args.cache)
    val_cache = HiddenStateCache(args.val_cache) if args.val_cache else None
    flags = None if args.flag_labels is None else [x for x in args.flag_labels.split(",") if x]
    opts = ProbeOptions(
        token_pool=args.pool,
        layer_mix=args.layer_mix,
        layers=args.layers,
        target=args.target,
        flag_labels=flags,
        name=args.name,
        d_inner=args.d_inner,
        num_heads=args.num_heads,
        layer_norm=not args.no_layer_norm,
        dropout=args.dropout,
    )
    config = FitConfig(
        lr=args.lr,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size,
        max_epochs=args.epochs,
        patience=args.patience,
        balance=args.balance,
        monitor=args.monitor,
        standardize=not args.no_standardize,
        gradient_checkpointing=args.grad_checkpointing,
        seed=args.seed,
        layer_lr_scale=args.layer_lr_scale,
    )
    result = train_probe(cache, opts, config, val_cache=val_cache, val_fraction=args.val_fraction)
    save_fit(result, args.out, cache, signing_key=load_settings().signing_key)
    report = result.val_report
    summary = {
        "checkpoint": str(args.out),
        "probe": result.probe.spec.name,
        "token_pool": opts.token_pool,
        "layer_mix": opts.layer_mix,
        "layers": list(result.probe.layers),
        "parameters": result.probe.num_parameters(),
        "epochs": result.epochs,
        "best_epoch": result.best_epoch,
        "train_seconds": round(result.seconds, 2),
        "thresholds": result.probe.spec.thresholds,
        "val_f1": report["f1"],
        "val_auprc": report["auprc"],
        "val_accuracy": report["accuracy"],
        "val_macro_f1": report["macro_f1"],
        "headline": report["headline"],
        "layer_entropy": result.probe.layer_entropy(),
    }
    (args.out / "fit-report.json").write_text(
        json.dumps(
            {"summary": summary, "history": result.history, "val_report": report},
            default=str,
            indent=1,
        )
    )
    if args.json:
        print_json(summary)
    else:
        print(
            f"{summary['probe']}: val F1 {summary['val_f1']:.3f}, AUPRC {summary['val_auprc']:.3f} "
            f"({summary['headline']}), {summary['parameters']} parameters, best epoch "
            f"{result.best_epoch}/{result.epochs}, {summary['train_seconds']} s -> {args.out}"
        )
    return 0


def _apply_deprecated(args: argparse.Namespace) -> None:
    """Honour ``--probe`` and ``--heads``, the old spellings kept for one release with a
    warning (CHANGELOG, Changed); require a pool."""
    from probes import TOKEN_POOLS

    if args.pool_deprecated is not None:
        print("probeguard fit: --probe is deprecated; use --pool", file=sys.stderr)
        if args.pool_deprecated not in TOKEN_POOLS:
            raise SystemExit(f"probeguard fit: unknown pool {args.pool_deprecated!r}")
        args.pool = args.pool or args.pool_deprecated
    if args.heads_deprecated is not None:
        print("probeguard fit: --heads is deprecated; use --num-heads", file=sys.stderr)
        args.num_heads = args.heads_deprecated
    if args.pool is None:
        raise SystemExit(f"probeguard fit: --pool is required (one of {sorted(TOKEN_POOLS)})")
