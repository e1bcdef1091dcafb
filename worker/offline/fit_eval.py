"""Offline training glue between caches, the probe library and checkpoints.

The CLI command ``fit`` is a thin wrapper over these functions, which the benchmark
scripts call directly; an ensemble over several LLMs' caches is
:mod:`worker.offline.fit_ensemble`, what ``fit`` reports of a fit
:mod:`worker.offline.fit_report`, evaluation (``eval``) :mod:`worker.offline.evaluate`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from probes import (
    ProbeError,
    build_probe,
    save_checkpoint,
)
from probes.checkpoint import WeightFormat
from probes.offline.cache import HiddenStateCache, features_for
from probes.offline.cv import CVResult
from probes.offline.dataset import ProbeDataset
from probes.offline.depth import DepthSearch
from probes.offline.fit import FitConfig, FitResult, fit
from probes.offline.select import fit_cv, select_depth
from schemas import (
    LayerMix,
    ProbeSpec,
    TokenPool,
    TrainingCounters,
)
from worker.errors import OfflineError

__all__ = [
    "ProbeOptions",
    "default_flag_labels",
    "dir_size",
    "fit_probe",
    "fit_probe_depth",
    "load_split",
    "log_progress",
    "prepare",
    "print_depth_table",
    "save_fit",
    "val_figures",
]

log = logging.getLogger(__name__)
Target = Literal["label", "labels"]


@dataclass(frozen=True)
class ProbeOptions:
    """Architecture choices of ``fit`` (everything a ProbeSpec needs besides the data)."""

    # MHA: the best kind on held-out data (bench/quality.md), so what `fit` gives by default.
    token_pool: TokenPool = "mha"
    layer_mix: LayerMix = "scalar_mix"
    layers: list[int] | None = None  # None: every layer the cache holds for this pool
    target: Target = "label"
    flag_labels: list[str] | None = None  # None: see default_flag_labels
    name: str | None = None
    d_inner: int = 64
    num_heads: int = 4
    layer_norm: bool = True
    dropout: float = 0.0


def default_flag_labels(train: ProbeDataset) -> list[str]:
    """Binary multiclass: the minority class; multilabel: every label; else none."""
    if train.task == "multilabel":
        return list(train.labels)
    if len(train.labels) == 2:
        counts = train.class_counts()
        return [train.labels[int(counts.argmin())]]
    return []


def _layers_for(cache: HiddenStateCache, opts: ProbeOptions) -> list[int]:
    m = cache.manifest
    if opts.layers is not None:
        return opts.layers
    if opts.layer_mix == "single":
        raise OfflineError("layer_mix 'single' needs --layers with exactly one layer")
    summary_ok = opts.token_pool in m.summaries
    layers = m.summary_layers if summary_ok else m.token_layers
    if not layers:
        raise OfflineError(
            f"cache {cache.directory} stores no layers usable by pool {opts.token_pool!r}"
        )
    return list(layers)


def load_split(
    cache: HiddenStateCache, pool: str, layers: list[int], target: Target
) -> ProbeDataset:
    """The features a probe with this pool and these layers trains on, from ``cache``."""
    return cache.dataset(features_for(pool, layers, cache.manifest), layers, target)


def _split(data: ProbeDataset, fraction: float, seed: int) -> tuple[ProbeDataset, ProbeDataset]:
    """Stratified (by class, or by 'any label' for multilabel) train/validation split."""
    g = torch.Generator().manual_seed(seed)
    strata = data.targets if data.task == "multiclass" else (data.targets.sum(1) > 0).long()
    val_idx = []
    for value in torch.unique(strata):
        rows = (strata == value).nonzero().flatten()
        rows = rows[torch.randperm(len(rows), generator=g)]
        val_idx.append(rows[: max(1, round(len(rows) * fraction))])
    val = torch.cat(val_idx).sort().values
    keep = torch.ones(len(data), dtype=torch.bool)
    keep[val] = False
    return data.subset(keep.nonzero().flatten()), data.subset(val)


def val_figures(report: dict[str, Any]) -> dict[str, float]:
    """The headline figures of a validation (or out-of-fold) report, as ``fit`` names them."""
    return {
        "val_f1": report["f1"],
        "val_auprc": report["auprc"],
        "val_recall_at_1pct_fpr": report["recall_at_1pct_fpr"],
        "val_ece": report["ece"],
    }


def fit_probe(
    cache: HiddenStateCache,
    opts: ProbeOptions,
    config: FitConfig,
    *,
    val_cache: HiddenStateCache | None = None,
    val_fraction: float = 0.1,
    folds: int = 0,
    calibrate: bool = False,
) -> tuple[FitResult, CVResult | None]:
    """Build a probe for ``opts``, load its features and fit it.

    Model selection: with ``val_cache``, early stopping and thresholds on that file
    (:func:`probes.offline.fit.fit`); else with ``folds >= 2``, k-fold cross-validation on the
    cache, then a refit on all of it (:func:`probes.offline.select.fit_cv`; the second value;
    ``calibrate``: its heads calibrated on the out-of-fold scores); else on a stratified
    ``val_fraction`` of the cache."""
    layers = _layers_for(cache, opts)
    data = load_split(cache, opts.token_pool, layers, opts.target)
    spec = _spec(cache, opts, layers, data)
    log.info(
        "fit %s: %d rows, %s features, layers %s, selection by %s",
        spec.name,
        len(data),
        "token-level" if data.token_level else "summary",
        layers,
        "the validation cache"
        if val_cache is not None
        else f"{folds}-fold cross-validation"
        if folds >= 2
        else f"a {val_fraction:.0%} validation split",
    )
    if val_cache is None and folds >= 2:
        return fit_cv(spec, data, config, folds=folds, calibrate=calibrate, progress=log_progress)
    if val_cache is not None:
        if val_cache.manifest.llm != cache.manifest.llm:
            raise OfflineError(
                "the validation cache was built with another LLM than the training cache"
            )
        train = data
        val = load_split(val_cache, opts.token_pool, layers, opts.target).relabel(train.labels)
    else:
        train, val = _split(data, val_fraction, config.seed)
    return fit(build_probe(spec, seed=config.seed), train, val, config, log_progress), None


def prepare(cache: HiddenStateCache, opts: ProbeOptions) -> tuple[ProbeSpec, ProbeDataset]:
    """The spec ``fit`` would train for ``opts`` on ``cache``, and its training data."""
    layers = _layers_for(cache, opts)
    data = load_split(cache, opts.token_pool, layers, opts.target)
    return _spec(cache, opts, layers, data), data


def fit_probe_depth(
    cache: HiddenStateCache,
    opts: ProbeOptions,
    config: FitConfig,
    *,
    folds: int = 5,
    epsilon: float = 0.01,
    depths: list[int] | None = None,
    calibrate: bool = False,
) -> tuple[FitResult, CVResult, DepthSearch]:
    """Like :func:`fit_probe` with k-fold selection, and the depth too: each candidate
    deepest layer (``depths``, default every layer of ``opts``) is cross-validated with the
    layers up to it, the shallowest within ``epsilon`` mean AUPRC of the best is refit
    (:func:`probes.offline.select.select_depth`). The probe's ``layers`` record the choice;
    ``calibrate``: its heads are calibrated on the chosen depth's out-of-fold scores."""
    if folds < 2:
        raise OfflineError(f"a depth search cross-validates: it needs --folds >= 2, got {folds}")
    spec, data = prepare(cache, opts)
    layers = list(spec.layers)
    log.info(
        "fit %s: %d rows, depth search over %s (layers %s), %d-fold CV each, epsilon %.3g",
        spec.name,
        len(data),
        depths or layers,
        layers,
        folds,
        epsilon,
    )
    try:
        return select_depth(
            spec,
            data,
            config,
            folds=folds,
            epsilon=epsilon,
            depths=depths,
            calibrate=calibrate,
            progress=log_progress,
        )
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc


def _spec(
    cache: HiddenStateCache, opts: ProbeOptions, layers: list[int], data: ProbeDataset
) -> ProbeSpec:
    flags = default_flag_labels(data) if opts.flag_labels is None else opts.flag_labels
    try:
        return ProbeSpec(
            name=opts.name or f"{opts.token_pool}-{opts.layer_mix}".replace("_", "-"),
            token_pool=opts.token_pool,
            layer_mix=opts.layer_mix,
            layers=layers,
            hidden_size=cache.manifest.llm.hidden_size,
            task="multiclass" if opts.target == "label" else "multilabel",
            labels=data.labels,
            flag_labels=flags,
            d_inner=opts.d_inner,
            num_heads=opts.num_heads,
            layer_norm=opts.layer_norm,
            dropout=opts.dropout,
        )
    except ValueError as exc:
        raise OfflineError(f"invalid probe options: {exc}") from exc


def log_progress(row: dict[str, float]) -> None:
    """A fit's progress row (epoch, fold, scores) as one log line."""
    log.info(
        ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
    )


def save_fit(
    result: FitResult,
    out: Path,
    cache: HiddenStateCache,
    *,
    signing_key: bytes | None = None,
    cv: CVResult | None = None,
    weights: WeightFormat = "fp32",
    depth: DepthSearch | None = None,
    extra_metrics: dict[str, float] | None = None,
) -> None:
    """Write the trained probe as a checkpoint the worker can load (the cache's LLM
    fingerprint), HMAC-signed when ``signing_key`` is given, with ``weights`` stored as
    fp32 or int8. With ``cv``, the manifest carries the cross-validated figures (mean and
    spread over folds) too; with ``depth``, the depth search's choice and each candidate's
    cross-validated AUPRC."""
    report = result.val_report
    metrics = {
        **val_figures(report),
        "val_accuracy": report["accuracy"],
        "val_macro_f1": report["macro_f1"],
        "best_epoch": float(result.best_epoch),
        "train_seconds": result.seconds,
    }
    if cv is not None:
        metrics.update({f"cv_{k}": v for k, v in cv.summary().items()})
        metrics.update({f"cv_{k}": v for k, v in cv.calibration_report.items()})
    if depth is not None:
        metrics.update(
            depth_chosen=depth.chosen, depth_best=depth.best, depth_epsilon=depth.epsilon
        )
        for row in depth.rows:
            mean, std = row.auprc
            metrics.update({f"depth_{row.depth}_cv_auprc_mean": mean})
            metrics.update({f"depth_{row.depth}_cv_auprc_std": std})
    metrics.update(extra_metrics or {})
    save_checkpoint(
        result.probe,
        out,
        llm=cache.manifest.llm,
        counters=TrainingCounters(
            labels_seen=result.train_rows, steps=result.steps, per_label=result.train_counts
        ),
        metrics={k: float(v) for k, v in metrics.items() if v == v},  # drop NaN
        signing_key=signing_key,
        weights=weights,
        drift=result.drift,
    )


def print_depth_table(depth: DepthSearch) -> None:
    """The depth search's table: one line per candidate, the choice marked."""
    print(f"depth search ({len(depth.table())} candidates, epsilon {depth.epsilon:g} AUPRC):")
    print(f"  {'depth':>5}  {'layers':>6}  {'CV AUPRC':>15}  {'CV F1':>15}  {'epochs':>6}  seconds")
    for r in depth.table():
        mark = "  <- chosen" if r["chosen"] else ""
        mark += "  (best)" if r["depth"] == depth.best else ""
        print(
            f"  {r['depth']:>5}  {len(r['layers']):>6}  "
            f"{r['auprc_mean']:.3f} ± {r['auprc_std']:.3f}  "
            f"{r['f1_mean']:.3f} ± {r['f1_std']:.3f}  "
            f"{r['epochs']:>6}  {r['seconds']:>7.0f}{mark}"
        )
    best = depth.row(depth.best).auprc[0]
    chosen = depth.row(depth.chosen).auprc[0]
    print(
        f"chose depth {depth.chosen}: the shallowest within {depth.epsilon:g} of the best "
        f"(depth {depth.best}, AUPRC {best:.3f}; chosen {chosen:.3f}); the probe reads layers "
        f"{depth.row(depth.chosen).layers}"
    )


def dir_size(path: Path) -> int:
    """Bytes in the files under ``path`` (a cache or a checkpoint folder)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
