"""``probeguard fit``: train a probe on a hidden-state cache and write a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.commands._common import offline_errors, print_json
from worker.commands._fit_args import add_fit_arguments
from worker.commands._fit_ensemble import run_ensemble

if TYPE_CHECKING:
    from probes.offline.cache import HiddenStateCache
    from probes.offline.cv import CVResult
    from probes.offline.depth import DepthSearch
    from probes.offline.exit import ExitSearch
    from probes.offline.fit import FitConfig, FitResult
    from schemas import OperatingPoint
    from worker.offline.fit_eval import ProbeOptions


__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
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
    add_fit_arguments(p)
    p.set_defaults(func=_run)


@offline_errors
def _run(args: argparse.Namespace) -> int:
    from probes.ensemble import is_ensemble
    from probes.offline.cache import HiddenStateCache
    from schemas import OperatingPoint
    from worker.offline.fit_eval import save_fit
    from worker.offline.fit_report import fit_summary, write_fit_report
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
        return run_ensemble(args, caches, opts, config, folds, point, settings.signing_key)
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
