"""``probeguard fit``: train a probe on a hidden-state cache and write a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.commands._common import layer_list, offline_errors, print_json

if TYPE_CHECKING:
    from probes.offline.cache import HiddenStateCache
    from probes.offline.exit import ExitSearch
    from probes.offline.fit import FitConfig, FitResult
    from probes.offline.select import CVResult, DepthSearch
    from schemas import OperatingPoint
    from worker.offline.fit_eval import ProbeOptions


__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    from probes.offline.fit import FitConfig
    from worker.offline.fit_eval import ProbeOptions

    d, o = FitConfig(), ProbeOptions()
    p = sub.add_parser(
        "fit",
        help="train a probe offline on a hidden-state cache; write a checkpoint",
        description=(
            "Lion on mini-batches (<= 256), class-weighted loss or balanced sampling. Model "
            "selection by k-fold cross-validation on the cache (default 3 folds): the number of "
            "epochs maximizes the folds' mean validation curve, the thresholds sit at "
            "--operating-point on the out-of-fold scores (calibrated per head first: --calibrate), "
            "then the probe is the soup of the fold models (--final); "
            "reported figures are per fold, at choices made on the other folds (mean ± spread). "
            "--val-cache selects on that file instead (early stopping, thresholds), --folds 0 on "
            "--val-fraction of the cache. The checkpoint carries the cache's LLM fingerprint, "
            "so the worker loads it only with the same LLM."
        ),
    )
    p.add_argument(
        "--cache",
        type=Path,
        action="append",
        required=True,
        help="training cache (cache build). Give it once per LLM, each a cache of the same "
        "labeled file, to fit an ensemble: one probe per LLM on the same folds, their "
        "calibrated probabilities averaged, the thresholds chosen on that mean (--out then "
        "holds ensemble.json and a checkpoint folder per member)",
    )
    _selection_args(p)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    _probe_args(p, o)
    _depth_args(p)
    _training_args(p, d)
    p.add_argument(
        "--weights",
        choices=["fp32", "int8"],
        default="fp32",
        help="how the checkpoint stores the probe weights: int8 with per-row scales is about a "
        "quarter of the bytes and is dequantized to fp32 on load (default: fp32)",
    )
    p.add_argument(
        "--exit",
        default="auto",
        help="the cascade's exit head: 'auto' (with cross-validation: search the probe's "
        "layers below its deepest for an exit head and threshold whose cascade keeps the "
        "out-of-fold AUPRC within --exit-epsilon, attach the cheapest that saves >= 15%% of "
        "the forward pass), a layer number (search that layer only), or 'off'",
    )
    p.add_argument(
        "--exit-epsilon",
        type=float,
        default=0.005,
        help="with --exit: AUPRC the cascade may give up (%(default)s = 0.5 point)",
    )
    p.add_argument(
        "--exit-max-missed",
        type=float,
        default=0.05,
        help="with --exit: the largest share of the flagged training rows a threshold may "
        "allow early, out of fold (%(default)s); the AUPRC alone is measured against the "
        "fold models, weaker than the probe served, and understates what misses cost",
    )
    p.add_argument(
        "--exit-pool",
        choices=["auto", "mean", "mha"],
        default="auto",
        help="with --exit: the exit head's token aggregation: 'mha' (the multi-head "
        "attention kind over the exit layer's tokens, for the full probe's epochs: about 20 s "
        "per layer for 3 folds on ToxicChat; ranks the hard cases a mean hides), 'mean' (a "
        "linear head on the exit layer's masked means: seconds), 'auto' (mha when the "
        "probe reads tokens, else mean) (default: %(default)s)",
    )
    p.add_argument(
        "--calibrate",
        choices=["auto", "off"],
        default="auto",
        help="'auto' (with cross-validation): fit each head's temperature and per-label bias "
        "on the out-of-fold logits, so its scores read as probabilities (ECE), and choose "
        "the thresholds on the calibrated scores; the checkpoint carries both. 'off': raw "
        "scores, as before (default: auto)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(func=_run)


def _selection_args(p: argparse.ArgumentParser) -> None:
    """How the epochs and thresholds are chosen: folds, a validation cache or a split."""
    p.add_argument(
        "--val-cache", type=Path, help="select on this validation cache instead of by folds"
    )
    p.add_argument(
        "--folds",
        type=int,
        default=None,
        help="cross-validation folds (default: 3; 0 = one --val-fraction split); k folds are "
        "k fits, each on (k-1)/k of the rows (MHA on ToxicChat's 2.5k rows: ~5 min on 2 CPU "
        "cores with 3)",
    )
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out with --folds 0")
    p.add_argument(
        "--final",
        choices=["soup", "refit"],
        default="soup",
        help="with cross-validation, the probe written: 'soup' = the average of the fold "
        "models' weights at the chosen epoch (no further training; its thresholds were chosen "
        "on those models' out-of-fold scores), 'refit' = one more fit on every row (default: "
        "soup; it falls back to refit when the average scores worse than the folds did)",
    )
    p.add_argument(
        "--operating-point",
        default="f1",
        help="where flag thresholds go: 'f1' (its maximum), 'precision>=0.9' (the most recall "
        "at that precision), 'recall>=0.8' (default: f1)",
    )


def _probe_args(p: argparse.ArgumentParser, o: ProbeOptions) -> None:
    """The probe's kind, layers, labels and MHA shape."""
    from probes import LAYER_MIXES, TOKEN_POOLS

    p.add_argument(
        "--pool",
        choices=sorted(TOKEN_POOLS),
        help=f"token pooling kind (default: {o.token_pool}, the best on held-out data)",
    )
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
    p.add_argument("--d-inner", type=int, default=o.d_inner, help="MHA inner size (%(default)s)")
    p.add_argument("--num-heads", type=int, default=o.num_heads, help="MHA heads (%(default)s)")
    p.add_argument("--heads", type=int, dest="heads_deprecated", help=argparse.SUPPRESS)
    p.add_argument("--no-layer-norm", action="store_true", help="MHA without input LayerNorm")
    p.add_argument("--dropout", type=float, default=o.dropout)


def _depth_args(p: argparse.ArgumentParser) -> None:
    """``--depth auto``: the search for the shallowest probe that is good enough."""
    p.add_argument(
        "--depth",
        choices=["full", "auto"],
        default="full",
        help="'auto': search the depth/quality trade-off. Each candidate deepest layer is "
        "cross-validated with the layers up to it; the probe keeps the shallowest whose mean "
        "fold AUPRC is within --depth-epsilon of the best, so the scorer's forward pass stops "
        "there. Prints the table per depth and records the choice in the checkpoint. Costs "
        "--folds fits per candidate (fewer layers are cheaper): MHA on ToxicChat's 2.5k rows, "
        "8 candidates x 3 folds is most of an hour on 2 CPU cores; --depth-candidates "
        "11,15,30 cuts it to under half. (default: full, every layer of --layers)",
    )
    p.add_argument(
        "--depth-epsilon",
        type=float,
        default=0.01,
        help="with --depth auto: AUPRC a shallower probe may give up (%(default)s = 1 point)",
    )
    p.add_argument(
        "--depth-candidates",
        type=layer_list,
        default=None,
        help="with --depth auto: the deepest layers to try, e.g. 11,15,30 (default: every "
        "layer the probe would read)",
    )


def _training_args(p: argparse.ArgumentParser, d: FitConfig) -> None:
    """Lion, the loss and the mini-batches."""
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
    p.add_argument(
        "--mix-entropy",
        type=float,
        default=d.mix_entropy,
        help="weight of the layer-mix entropy penalty against collapse (%(default)s)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="mini-batch size, <= 256")
    p.add_argument("--balance", choices=["weights", "sampler", "none"], default=d.balance)
    p.add_argument("--monitor", choices=["auprc", "f1", "loss"], default=d.monitor)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-standardize", action="store_true", help="skip input standardization")
    p.add_argument(
        "--token-dtype",
        choices=["float32", "bfloat16"],
        default=d.token_dtype,
        help="dtype the MHA kind's padded token states are kept and projected in while "
        "training (%(default)s); bfloat16 halves their memory and, on a CPU with bf16 dot "
        "products (AVX512-BF16, AMX), runs an epoch 1.4x faster (a whole fit about 1.2x) at "
        "bf16's rounding (on ToxicChat held out: the same AUPRC); elsewhere bf16 is emulated "
        "and slower",
    )
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="recompute MHA attention in the backward pass (less memory, more compute)",
    )


@offline_errors
def _run(args: argparse.Namespace) -> int:
    from probes.ensemble import is_ensemble
    from probes.offline.cache import HiddenStateCache
    from schemas import OperatingPoint
    from worker.offline.fit_eval import fit_summary, save_fit, write_fit_report
    from worker.settings import load_settings

    _apply_deprecated(args)
    folds = _folds(args)
    try:
        point = OperatingPoint.parse(args.operating_point)
    except ValueError as exc:
        raise SystemExit(f"probeguard fit: {exc}") from exc
    settings = load_settings()
    key = settings.cache_key_bytes
    caches = [HiddenStateCache(path, key=key) for path in args.cache]
    opts, config = _options(args, point)
    if len(caches) > 1:
        return _run_ensemble(args, caches, opts, config, folds, point, settings.signing_key)
    if is_ensemble(args.out):
        raise SystemExit(
            f"probeguard fit: {args.out} holds an ensemble (ensemble.json); write the probe "
            "to another --out"
        )
    cache = caches[0]
    val_cache = HiddenStateCache(args.val_cache, key=key) if args.val_cache else None
    result, cv, depth = _fit(args, cache, val_cache, opts, config, folds)
    search = _exit(args, cache, opts, config, result, cv, folds)
    save_fit(
        result,
        args.out,
        cache,
        signing_key=settings.signing_key,
        cv=cv,
        weights=args.weights,
        depth=depth,
        extra_metrics=search.metrics() if search is not None else None,
    )
    selection = "validation cache" if val_cache else f"{folds}-fold CV" if cv else "split"
    summary = fit_summary(
        result, args.out, opts, selection=selection, point=point, cv=cv, depth=depth
    )
    write_fit_report(args.out, summary, result, cv=cv, depth=depth)
    if search is not None:
        summary["exit"] = search.metrics()
        if not args.json:
            _print_exit_table(search)
    if args.json:
        print_json({**summary, "depth_table": depth.table()} if depth else summary)
    else:
        _print_result(summary, result, cv, depth, folds=folds, point=point, out=args.out)
    return 0


def _run_ensemble(
    args: argparse.Namespace,
    caches: list[HiddenStateCache],
    opts: ProbeOptions,
    config: FitConfig,
    folds: int,
    point: OperatingPoint,
    signing_key: bytes | None,
) -> int:
    """``fit`` with several ``--cache``: one probe per LLM, averaged (``--out`` an ensemble)."""
    from probes.checkpoint import MANIFEST_FILE
    from probes.files import atomic_write
    from worker.offline.fit_eval import fit_probe_ensemble, save_ensemble_fit, val_figures

    refused = [
        ("--val-cache", args.val_cache is not None),
        ("--folds 0", folds < 2),
        ("--depth auto", args.depth == "auto"),
        ("--exit LAYER", args.exit not in ("auto", "off")),
    ]
    for flag, given in refused:
        if given:
            raise SystemExit(
                f"probeguard fit: {flag} selects one probe over one LLM; an ensemble (several "
                "--cache) is selected by cross-validation on the same folds (--folds >= 2)"
            )
    if (args.out / MANIFEST_FILE).exists():
        raise SystemExit(
            f"probeguard fit: {args.out} holds a single probe's checkpoint; write the ensemble "
            "to another --out"
        )
    fitted, specs = fit_probe_ensemble(
        caches, opts, config, folds=folds, calibrate=args.calibrate == "auto"
    )
    folders = save_ensemble_fit(
        fitted, args.out, caches, signing_key=signing_key, weights=args.weights
    )
    report = fitted.oof_report
    members = []
    for (result, cv), cache, folder in zip(fitted.members, caches, folders, strict=True):
        c = cv.summary()
        members.append(
            {
                "llm": cache.manifest.llm.model_id,
                "checkpoint": str(args.out / folder),
                "layers": list(result.probe.layers),
                "epochs": cv.epochs,
                "train_seconds": round(result.seconds, 2),
                **val_figures(result.val_report),
                **{f"cv_{k}": v for k, v in c.items()},
            }
        )
    summary = {
        "checkpoint": str(args.out),
        "probe": specs[0].name,
        "ensemble": len(members),
        "combine": "mean",
        "members": members,
        "thresholds": fitted.thresholds,
        **val_figures(report),
        "headline": report["headline"],
        "train_seconds": round(fitted.seconds, 2),
        "selection": f"{folds}-fold CV",
        "operating_point": str(point),
    }
    atomic_write(args.out / "fit-report.json", json.dumps({"summary": summary}, indent=1))
    if args.exit == "auto":
        print(
            "probeguard fit: no exit head for an ensemble's members (the cascade decides on "
            "one LLM's early layer; an ensemble averages every member's full depth)",
            file=sys.stderr,
        )
    if args.json:
        print_json(summary)
        return 0
    for i, m in enumerate(members, start=1):
        print(
            f"member {i} ({m['llm']}): {folds}-fold CV AUPRC {m['cv_auprc_mean']:.3f} ± "
            f"{m['cv_auprc_std']:.3f}, out of fold F1 {m['val_f1']:.3f} AUPRC "
            f"{m['val_auprc']:.3f}, {m['epochs']} epochs, {m['train_seconds']:.0f} s -> "
            f"{m['checkpoint']}"
        )
    print(
        f"{summary['probe']}: ensemble of {len(members)} LLMs' probes (mean of their calibrated "
        f"probabilities), out of fold F1 {report['f1']:.3f}, AUPRC {report['auprc']:.3f}, "
        f"recall at 1 % FPR {report['recall_at_1pct_fpr']:.3f}, ECE {report['ece']:.3f} "
        f"({report['headline']}, thresholds at {point}: {fitted.thresholds}); "
        f"{summary['train_seconds']:.0f} s -> {args.out}"
    )
    return 0


def _options(args: argparse.Namespace, point: OperatingPoint) -> tuple[ProbeOptions, FitConfig]:
    """The probe's shape and the training configuration the arguments ask for."""
    from probes.offline.fit import FitConfig
    from worker.offline.fit_eval import ProbeOptions

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
        token_dtype=args.token_dtype,
        seed=args.seed,
        layer_lr_scale=args.layer_lr_scale,
        mix_entropy=args.mix_entropy,
        operating_point=point,
        final=args.final,
    )
    return opts, config


def _fit(
    args: argparse.Namespace,
    cache: HiddenStateCache,
    val_cache: HiddenStateCache | None,
    opts: ProbeOptions,
    config: FitConfig,
    folds: int,
) -> tuple[FitResult, CVResult | None, DepthSearch | None]:
    """Fit at full depth, or search the depth (``--depth auto``)."""
    from worker.offline.fit_eval import fit_probe, fit_probe_depth

    if args.depth == "auto":
        if folds < 2:
            raise SystemExit(
                "probeguard fit: --depth auto cross-validates each depth; it needs --folds >= 2 "
                "and no --val-cache"
            )
        if args.depth_epsilon < 0:
            raise SystemExit(
                f"probeguard fit: --depth-epsilon must be >= 0, got {args.depth_epsilon}"
            )
        return fit_probe_depth(
            cache,
            opts,
            config,
            folds=folds,
            epsilon=args.depth_epsilon,
            depths=args.depth_candidates,
            calibrate=args.calibrate == "auto",
        )
    if args.depth_candidates is not None:
        raise SystemExit("probeguard fit: --depth-candidates needs --depth auto")
    result, cv = fit_probe(
        cache,
        opts,
        config,
        val_cache=val_cache,
        val_fraction=args.val_fraction,
        folds=folds,
        calibrate=args.calibrate == "auto",  # with cross-validation only
    )
    return result, cv, None


def _exit(
    args: argparse.Namespace,
    cache: HiddenStateCache,
    opts: ProbeOptions,
    config: FitConfig,
    result: FitResult,
    cv: CVResult | None,
    folds: int,
) -> ExitSearch | None:
    """Search and attach the exit head (``--exit``); None when off or without CV."""
    from probes.offline.exit import search_exit
    from worker.offline.fit_eval import prepare

    if args.exit == "off":
        return None
    if cv is None or folds < 2:
        if args.exit != "auto":
            raise SystemExit("probeguard fit: --exit LAYER cross-validates; it needs --folds >= 2")
        return None
    if not 0.0 <= args.exit_max_missed <= 1.0:
        raise SystemExit(f"probeguard fit: --exit-max-missed is a share: {args.exit_max_missed}")
    try:
        layers = None if args.exit == "auto" else [int(args.exit)]
    except ValueError as exc:
        raise SystemExit(f"probeguard fit: --exit must be auto, off or a layer: {exc}") from exc
    _, data = prepare(cache, opts)
    spec = result.probe.spec
    data = data.select_layers(list(spec.layers))
    pool = args.exit_pool
    if pool == "auto":
        pool = "mha" if data.token_level else "mean"
    search = search_exit(
        spec,
        result.probe,
        data,
        cv.oof_probs,
        config,
        folds=folds,
        epsilon=args.exit_epsilon,
        layers=layers,
        pool=pool,
        epochs=cv.epochs if pool != "mean" else None,
        max_missed=args.exit_max_missed,
    )
    if search.probe is not None:
        result.probe = search.probe
    return search


def _print_exit_table(search: ExitSearch) -> None:
    auprc = search.full_auprc
    print(f"exit search ({search.pool} exit heads): full-depth out-of-fold AUPRC {auprc:.4f}")
    print("layer  allow_below  share  tokens  missed  cascade_auprc  cost")
    for r in search.rows:
        mark = " <- chosen" if r == search.chosen else ""
        tokens = "     -" if r.tokens is None else f"{r.tokens:>6.2f}"
        print(
            f"{r.layer:>5}  {r.allow_below:>11.3f}  {r.share:>5.2f}  {tokens}  {r.missed:>6.3f}  "
            f"{r.auprc:>13.4f}  {r.cost:>4.2f}{mark}"
        )
    for note in search.notes:
        print(f"exit search: {note}")


def _print_result(
    summary: dict[str, Any],
    result: FitResult,
    cv: CVResult | None,
    depth: DepthSearch | None,
    *,
    folds: int,
    point: OperatingPoint,
    out: Path,
) -> None:
    from worker.offline.fit_eval import print_depth_table

    if depth is not None:
        print_depth_table(depth)
    if cv is not None:
        c = cv.summary()
        for f in cv.folds:
            print(
                f"fold {f.fold}: {f.rows} rows ({f.positives} positive), epoch {f.epoch}, "
                f"F1 {f.f1:.3f} (P {f.precision:.3f} R {f.recall:.3f}), AUPRC {f.auprc:.3f}, "
                f"recall at 1 % FPR {f.recall_at_1pct_fpr:.3f}, ECE {f.ece:.3f}"
            )
        print(
            f"{summary['probe']}: {folds}-fold CV F1 {c['f1_mean']:.3f} ± {c['f1_std']:.3f}, "
            f"AUPRC {c['auprc_mean']:.3f} ± {c['auprc_std']:.3f}, out of fold recall at 1 % "
            f"FPR {summary['val_recall_at_1pct_fpr']:.3f} and ECE {summary['val_ece']:.3f} "
            f"({summary['headline']}, thresholds at {point}: {summary['thresholds']}); "
            + (
                f"the soup of the {result.soup_of} fold models at {cv.epochs} epochs, "
                if result.soup_of
                else f"refit on all rows for {cv.epochs} epochs, "
            )
            + f"{summary['parameters']} parameters, "
            f"{summary['train_seconds']} s -> {out}"
        )
        if cv.calibration_report:
            print(
                f"calibration (temperature and per-label bias, per head, on the out-of-fold "
                f"logits): ECE {cv.calibration_report['ece_uncalibrated']:.3f} -> "
                f"{cv.calibration_report['ece']:.3f} (15 equal-width bins; each fold's rows "
                f"calibrated on the others); {_temperatures(summary['calibration'])}"
            )
    else:
        print(
            f"{summary['probe']}: val F1 {summary['val_f1']:.3f}, AUPRC {summary['val_auprc']:.3f}"
            f", recall at 1 % FPR {summary['val_recall_at_1pct_fpr']:.3f}, ECE "
            f"{summary['val_ece']:.3f} ({summary['headline']}), {summary['parameters']} "
            f"parameters, best epoch {result.best_epoch}/{result.epochs}, "
            f"{summary['train_seconds']} s -> {out}"
        )


def _temperatures(calibration: dict[str, dict[str, Any]]) -> str:
    shown = [f"{name} T={c['temperature']:.2f}" for name, c in list(calibration.items())[:6]]
    more = f" and {len(calibration) - 6} more" if len(calibration) > 6 else ""
    return ", ".join(shown) + more if shown else "no head had the positives to calibrate"


def _apply_deprecated(args: argparse.Namespace) -> None:
    """Honour ``--probe`` and ``--heads``, the old spellings kept for one release with a
    warning (CHANGELOG, Changed); default the pool."""
    from probes import TOKEN_POOLS
    from worker.offline.fit_eval import ProbeOptions

    if args.pool_deprecated is not None:
        print("probeguard fit: --probe is deprecated; use --pool", file=sys.stderr)
        if args.pool_deprecated not in TOKEN_POOLS:
            raise SystemExit(f"probeguard fit: unknown pool {args.pool_deprecated!r}")
        args.pool = args.pool or args.pool_deprecated
    if args.heads_deprecated is not None:
        print("probeguard fit: --heads is deprecated; use --num-heads", file=sys.stderr)
        args.num_heads = args.heads_deprecated
    if args.pool is None:
        args.pool = ProbeOptions().token_pool


def _folds(args: argparse.Namespace) -> int:
    """Cross-validation folds: 3 unless a validation cache selects (then 0)."""
    if args.folds is None:
        return 0 if args.val_cache else 3
    if args.val_cache and args.folds:
        raise SystemExit("probeguard fit: --val-cache and --folds are two ways to select; pick one")
    if args.folds == 1 or args.folds < 0:
        raise SystemExit(f"probeguard fit: --folds must be 0 or >= 2, got {args.folds}")
    return int(args.folds)
