"""An ensemble over several LLMs: one probe per LLM's cache of the same labeled rows, fitted
on the same folds and averaged (``probeguard fit`` with several ``--cache``).

Built on :mod:`worker.offline.fit_eval` (one probe's options, data and checkpoint) and
:mod:`probes.offline.ensemble` (the cross-validation of the members together).
"""

from __future__ import annotations

import logging
from pathlib import Path

from probes import ProbeError
from probes.checkpoint import WeightFormat
from probes.ensemble import member_folder, write_ensemble
from probes.offline.cache import HiddenStateCache
from probes.offline.ensemble import EnsembleFit, fit_ensemble_cv
from probes.offline.fit import FitConfig
from schemas import ProbeSpec
from worker.errors import OfflineError
from worker.offline.fit_eval import ProbeOptions, log_progress, prepare, save_fit, val_figures

__all__ = ["fit_probe_ensemble", "save_ensemble_fit"]

log = logging.getLogger(__name__)


def fit_probe_ensemble(
    caches: list[HiddenStateCache],
    opts: ProbeOptions,
    config: FitConfig,
    *,
    folds: int = 3,
    calibrate: bool = True,
) -> tuple[EnsembleFit, list[ProbeSpec]]:
    """One probe of ``opts`` per cache (the same labeled rows, each cache from another LLM,
    each probe over its own cache's layers), fit by ``folds``-fold cross-validation on the
    same folds, thresholds on their mean out-of-fold probabilities
    (:func:`probes.offline.ensemble.fit_ensemble_cv`). Returns the fit and the specs."""
    llms = [c.manifest.llm for c in caches]
    if len({llm.digest for llm in llms}) != len(llms):
        raise OfflineError(
            "two of the caches were built with the same LLM: an ensemble holds one probe per "
            "LLM, so give one cache of the same rows per LLM"
        )
    if opts.layers is not None:
        raise OfflineError(
            "--layers names one LLM's layers; with several caches each probe reads every "
            "layer its own cache holds"
        )
    prepared = [prepare(c, opts) for c in caches]
    specs = [spec for spec, _ in prepared]
    for cache, (spec, data) in zip(caches, prepared, strict=True):
        log.info(
            "fit %s on %s: %d rows, layers %s, %d-fold cross-validation",
            spec.name,
            cache.manifest.llm.model_id,
            len(data),
            list(spec.layers),
            folds,
        )

    def progress(member: int, row: dict[str, float]) -> None:
        log_progress({"member": member, **row})

    try:
        fitted = fit_ensemble_cv(
            specs,
            [data for _, data in prepared],
            config,
            folds=folds,
            calibrate=calibrate,
            progress=progress,
        )
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc
    return fitted, specs


def save_ensemble_fit(
    fitted: EnsembleFit,
    out: Path,
    caches: list[HiddenStateCache],
    *,
    signing_key: bytes | None = None,
    weights: WeightFormat = "fp32",
) -> list[str]:
    """Write each member as a checkpoint in its own folder of ``out`` (:func:`save_fit`)
    and ``out/ensemble.json`` over them; returns the members' folder names."""
    folders = []
    for i, ((result, cv), cache) in enumerate(zip(fitted.members, caches, strict=True)):
        folder = member_folder(i, cache.manifest.llm.model_id)
        save_fit(result, out / folder, cache, signing_key=signing_key, cv=cv, weights=weights)
        folders.append(folder)
    report = fitted.oof_report
    write_ensemble(
        out,
        fitted.members[0][0].probe.spec.name,
        folders,
        fitted.thresholds,
        metrics={**val_figures(report), "train_seconds": fitted.seconds},
        signing_key=signing_key,
    )
    return folders
