"""Cross-validated fit of an ensemble: one probe per LLM over the same labeled rows.

::

    fitted = fit_ensemble_cv([spec_a, spec_b], [rows_a, rows_b], FitConfig(), folds=3,
                             calibrate=True)
    fitted.thresholds, fitted.oof_report["auprc"]

Each member is :func:`probes.offline.select.fit_cv` over its own LLM's states of the same
rows: the rows are put in one order first, so every member sees the same folds (they
depend on the targets and the seed only) and the out-of-fold probabilities line up row by
row. The ensemble's thresholds are chosen on the mean of the members' (calibrated)
out-of-fold probabilities, at ``config.operating_point``, so they were chosen on scores
of models that never saw those rows, as a single probe's are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probes.errors import ProbeError
from probes.metrics import choose_thresholds, evaluate
from probes.offline.cv import CVResult
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, FitResult
from probes.offline.select import fit_cv
from schemas import ProbeSpec

__all__ = ["EnsembleFit", "align_rows", "fit_ensemble_cv"]


@dataclass
class EnsembleFit:
    """Each member's fit and cross-validation, and the ensemble's choices on their mean."""

    members: list[tuple[FitResult, CVResult]]
    thresholds: dict[str, float]
    oof_probs: Tensor  # [N, C]: the members' out-of-fold probabilities averaged
    oof_report: dict[str, Any]  # probes.metrics.evaluate of oof_probs at the thresholds
    seconds: float


def align_rows(datas: Sequence[ProbeDataset]) -> list[ProbeDataset]:
    """``datas`` (the same labeled rows as seen by several LLMs) in the first one's row
    order; :class:`ProbeError` when they hold other rows or other labels for a row."""
    first = datas[0]
    where = {row_id: i for i, row_id in enumerate(first.ids)}
    if len(where) != len(first.ids):
        raise ProbeError("the training rows repeat an id; an ensemble pairs rows by id")
    aligned = [first]
    for k, data in enumerate(datas[1:], start=2):
        if sorted(data.labels) != sorted(first.labels) or data.task != first.task:
            raise ProbeError(
                f"cache {k} has labels {data.labels} ({data.task}), cache 1 {first.labels} "
                f"({first.task}): an ensemble's members learn the same labels"
            )
        data = data.relabel(first.labels)
        missing = [row_id for row_id in data.ids if row_id not in where]
        if missing or len(data.ids) != len(first.ids):
            raise ProbeError(
                f"cache {k} holds {len(data.ids)} rows, cache 1 {len(first.ids)}, "
                f"{len(missing)} of cache {k}'s ids are not in cache 1 (e.g. "
                f"{missing[:3]}): build every member's cache from the same labeled file"
            )
        order = torch.tensor([where[row_id] for row_id in data.ids]).argsort()
        data = data.subset(order)
        if not torch.equal(data.targets, first.targets):
            raise ProbeError(f"cache {k} labels some rows differently than cache 1")
        aligned.append(data)
    return aligned


def fit_ensemble_cv(
    specs: Sequence[ProbeSpec],
    datas: Sequence[ProbeDataset],
    config: FitConfig = FitConfig(),
    *,
    folds: int = 3,
    calibrate: bool = True,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> EnsembleFit:
    """Fit one probe per (``spec``, ``data``) pair with the same folds, then choose the
    thresholds on their mean out-of-fold probabilities. ``progress(member, row)`` sees
    each member's per-epoch rows (member counts from 1)."""
    if len(specs) != len(datas) or len(specs) < 2:
        raise ProbeError(
            f"an ensemble needs >= 2 members, one spec per dataset (got {len(specs)} "
            f"specs, {len(datas)} datasets)"
        )
    if folds < 2:
        raise ProbeError(f"an ensemble is selected by cross-validation: folds >= 2, got {folds}")
    started = time.perf_counter()
    datas = align_rows(datas)
    members = []
    for i, (spec, data) in enumerate(zip(specs, datas, strict=True), start=1):

        def tagged(row: dict[str, float], i: int = i) -> None:
            if progress is not None:
                progress(i, row)

        members.append(
            fit_cv(spec, data, config, folds=folds, calibrate=calibrate, progress=tagged)
        )
    mean = torch.stack([cv.oof_probs for _, cv in members]).mean(0)
    targets = datas[0].targets
    thresholds = choose_thresholds(specs[0], mean, targets, point=config.operating_point)
    tuned = specs[0].model_copy(update={"thresholds": thresholds})
    return EnsembleFit(
        members=members,
        thresholds=thresholds,
        oof_probs=mean,
        oof_report=evaluate(tuned, mean, targets),
        seconds=time.perf_counter() - started,
    )
