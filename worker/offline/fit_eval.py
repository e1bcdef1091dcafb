"""Offline training and evaluation glue between caches, the probe library and checkpoints.

The CLI commands ``fit`` and ``eval`` are thin wrappers over these functions,
which the benchmark scripts call directly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from probes import (
    Probe,
    ProbeError,
    build_probe,
    encode_target,
    encode_targets,
    load_checkpoint,
    save_checkpoint,
)
from probes.checkpoint import WeightFormat
from probes.metrics import evaluate
from probes.offline.cache import HiddenStateCache, features_for
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, FitResult, fit, predict_dataset
from probes.offline.select import CVResult, DepthSearch, fit_cv, select_depth
from schemas import (
    CheckpointManifest,
    LabeledText,
    LayerMix,
    LLMFingerprint,
    ProbeSpec,
    TokenPool,
    TrainingCounters,
)
from worker.defaults import find_default
from worker.errors import OfflineError
from worker.offline.build_cache import ExtractorLike

__all__ = [
    "ProbeOptions",
    "default_flag_labels",
    "dir_size",
    "evaluate_on_cache",
    "evaluate_on_rows",
    "fit_probe",
    "fit_probe_depth",
    "for_head",
    "load_for_eval",
    "load_split",
    "prepare",
    "print_depth_table",
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


def fit_probe(
    cache: HiddenStateCache,
    opts: ProbeOptions,
    config: FitConfig,
    *,
    val_cache: HiddenStateCache | None = None,
    val_fraction: float = 0.1,
    folds: int = 0,
) -> tuple[FitResult, CVResult | None]:
    """Build a probe for ``opts``, load its features and fit it.

    Model selection: with ``val_cache``, early stopping and thresholds on that file
    (:func:`probes.offline.fit.fit`); else with ``folds >= 2``, k-fold cross-validation on the
    cache, then a refit on all of it (:func:`probes.offline.select.fit_cv`; the second value);
    else on a stratified ``val_fraction`` of the cache."""
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
        return fit_cv(spec, data, config, folds=folds, progress=_log_progress)
    if val_cache is not None:
        if val_cache.manifest.llm != cache.manifest.llm:
            raise OfflineError(
                "the validation cache was built with another LLM than the training cache"
            )
        train = data
        val = load_split(val_cache, opts.token_pool, layers, opts.target).relabel(train.labels)
    else:
        train, val = _split(data, val_fraction, config.seed)
    return fit(build_probe(spec, seed=config.seed), train, val, config, _log_progress), None


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
) -> tuple[FitResult, CVResult, DepthSearch]:
    """Like :func:`fit_probe` with k-fold selection, and the depth too: each candidate
    deepest layer (``depths``, default every layer of ``opts``) is cross-validated with the
    layers up to it, the shallowest within ``epsilon`` mean AUPRC of the best is refit
    (:func:`probes.offline.select.select_depth`). The probe's ``layers`` record the choice."""
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
            spec, data, config, folds=folds, epsilon=epsilon, depths=depths, progress=_log_progress
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


def _log_progress(row: dict[str, float]) -> None:
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
) -> None:
    """Write the trained probe as a checkpoint the worker can load (the cache's LLM
    fingerprint), HMAC-signed when ``signing_key`` is given, with ``weights`` stored as
    fp32 or int8. With ``cv``, the manifest carries the cross-validated figures (mean and
    spread over folds) too; with ``depth``, the depth search's choice and each candidate's
    cross-validated AUPRC."""
    report = result.val_report
    metrics = {
        "val_f1": report["f1"],
        "val_auprc": report["auprc"],
        "val_accuracy": report["accuracy"],
        "val_macro_f1": report["macro_f1"],
        "best_epoch": float(result.best_epoch),
        "train_seconds": result.seconds,
    }
    if cv is not None:
        metrics.update({f"cv_{k}": v for k, v in cv.summary().items()})
    if depth is not None:
        metrics.update(
            depth_chosen=depth.chosen, depth_best=depth.best, depth_epsilon=depth.epsilon
        )
        for row in depth.rows:
            mean, std = row.auprc
            metrics.update({f"depth_{row.depth}_cv_auprc_mean": mean})
            metrics.update({f"depth_{row.depth}_cv_auprc_std": std})
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
    )


def _layer_summary(probe: Probe, weights: torch.Tensor) -> dict[str, Any]:
    from probes.probe import weight_entropy

    return {
        "layers": list(probe.layers),
        "layer_weights": [round(float(w), 6) for w in weights],
        "layer_entropy": weight_entropy(weights),
    }


def load_for_eval(checkpoint: Path, llm: LLMFingerprint) -> tuple[Probe, CheckpointManifest]:
    """``checkpoint`` verified against ``llm``; ``default``: the packaged default for it."""
    if str(checkpoint) == "default":
        found = find_default(llm, "moderation")
        if found is None:
            raise OfflineError(f"this release ships no packaged default for {llm.model_id}")
        return found.probe, found.manifest
    return load_checkpoint(checkpoint, llm)


def for_head(probe: Probe, head: str | None) -> Probe:
    """``probe`` seen as its head ``head`` alone (a single-head view sharing the weights),
    for measuring one head on a file labeled for it; ``None``: the probe itself."""
    if head is None:
        return probe
    try:
        view = probe.spec.head_view(head)
    except ValueError as exc:
        raise OfflineError(str(exc)) from exc
    return HeadView(probe, head, view)


def evaluate_on_cache(
    checkpoint: Path, cache: HiddenStateCache, head: str | None = None
) -> tuple[Probe, dict[str, Any]]:
    """Load ``checkpoint`` (verified against the cache's LLM) and evaluate it on ``cache``
    (on one head's columns with ``head``, the file's labels read as that head's)."""
    probe, manifest = load_for_eval(checkpoint, cache.manifest.llm)
    probe = for_head(probe, head)
    if isinstance(probe, HeadView) or probe.spec.heads:
        data = load_split(cache, probe.spec.token_pool, list(probe.spec.layers), "label")
        targets = _targets_of_names(probe, [list(names) for names in cache.row_labels()])
        data = replace(data, labels=list(probe.spec.labels), task=probe.spec.task, targets=targets)
    else:
        target: Target = "label" if probe.spec.task == "multiclass" else "labels"
        data = load_split(cache, probe.spec.token_pool, list(probe.spec.layers), target)
        data = data.relabel(list(probe.spec.labels))
    probs = predict_dataset(probe, data)
    weights = torch.zeros(len(probe.layers))
    for start in range(0, len(data), 128):
        idx = torch.arange(start, min(start + 128, len(data)))
        hidden, mask, _ = data.batch(idx)
        weights += probe.layer_weights(hidden, mask) * len(idx)
    report = evaluate(probe.spec, probs, data.targets)
    report.update(_layer_summary(probe, weights / max(1, len(data))))
    report.update(checkpoint=str(checkpoint), probe=manifest.probe, version=manifest.version)
    return probe, report


def _targets(probe: Probe, rows: Sequence[LabeledText]) -> torch.Tensor:
    multiclass = probe.spec.task == "multiclass"
    if isinstance(probe, HeadView) or probe.spec.heads:
        names = [([r.label] if r.label else []) + (r.labels or []) for r in rows]
        return _targets_of_names(probe, names)
    if any((r.label if multiclass else r.labels) is None for r in rows):
        field = "label" if multiclass else "labels"
        raise OfflineError(f"a {probe.spec.task} probe needs {field!r} on every row")
    label_sets = [[r.label] if multiclass and r.label else list(r.labels or []) for r in rows]
    try:
        return encode_targets(probe.spec, label_sets)
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc


def evaluate_on_rows(
    checkpoint: Path,
    rows: Sequence[LabeledText],
    extractor: ExtractorLike,
    batch_size: int = 16,
    head: str | None = None,
) -> tuple[Probe, dict[str, Any]]:
    """Extract ``rows`` with ``extractor`` (only the probe's layers) and evaluate ``checkpoint``
    (``default``: the packaged default; with ``head``, that head on the file's labels)."""
    probe, manifest = load_for_eval(checkpoint, extractor.fingerprint)
    probe = for_head(probe, head)
    targets = _targets(probe, rows)
    probs, kept, skipped = [], [], {}
    weights = torch.zeros(len(probe.layers))
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        out = extractor.extract([r.text for r in chunk], list(probe.layers))
        skipped.update({chunk[p].id: reason for p, reason in out.errors.items()})
        if out.index:
            hidden = out.hidden.float()  # [L, B_ok, T, D]
            probs.append(probe.predict_proba_many(hidden, out.mask))
            weights += probe.layer_weights(hidden, out.mask) * len(out.index)
            kept += [start + p for p in out.index]
    if not kept:
        raise OfflineError("no row could be extracted")
    report = evaluate(probe.spec, torch.cat(probs), targets[torch.tensor(kept)])
    report.update(_layer_summary(probe, weights / len(kept)))
    report.update(checkpoint=str(checkpoint), probe=manifest.probe, version=manifest.version)
    report["skipped"] = skipped
    return probe, report


def _targets_of_names(probe: Probe, names: Sequence[Sequence[str]]) -> torch.Tensor:
    """Each row's label names read as the probe's: the names outside its label space say
    nothing. One head (:class:`HeadView`): the names in its space are its positives (a
    multiclass head needs exactly one per row). A multi-head probe: each row annotates the
    heads it names a label of (the others unknown; a row naming none counts for none)."""
    space = set(probe.spec.labels)
    label_sets = [[n for n in row if n in space] for row in names]
    if isinstance(probe, HeadView):
        if probe.spec.task == "multiclass" and any(len(x) != 1 for x in label_sets):
            raise OfflineError(
                f"multiclass head {probe.head_name!r} needs exactly one of {probe.spec.labels} "
                "per row"
            )
        return encode_targets(probe.spec, label_sets)
    unknown = torch.full((len(probe.spec.labels),), float("nan"))
    return (
        torch.stack([encode_target(probe.spec, x)[0] if x else unknown for x in label_sets])
        if label_sets
        else unknown[None][:0]
    )


class HeadView(Probe):
    """One head of a multi-head probe as a single-head probe: the shared pooling, mix and
    weights, its own columns of the output, its task, labels, flags and thresholds."""

    def __init__(self, probe: Probe, head: str, view: ProbeSpec) -> None:
        torch.nn.Module.__init__(self)
        self.whole = probe
        self.head_name = head
        self._spec = view
        self._cols = probe.spec.head_columns(head)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.whole(hidden, mask)[:, self._cols]  # [B, C_head]

    def layer_weights(
        self, hidden: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.whole.layer_weights(hidden, mask)

    @property
    def layers(self) -> tuple[int, ...]:
        return self.whole.layers

    @property
    def separable(self) -> bool:
        return self.whole.separable


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
