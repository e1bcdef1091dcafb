"""Model selection by k-fold cross-validation on the training split.

One small validation set picks the epoch and the threshold on a few dozen positives and
then reports on the same rows: on ToxicChat (247 validation rows, 41 toxic) that
overstated held-out F1 by up to 10 points. Instead, every choice comes from folds of the
training split, and every reported figure from rows the choice never saw::

    result, cv = fit_cv(spec, data, FitConfig(), folds=5)
    cv.epochs, cv.thresholds          # what the final probe uses
    cv.summary()["f1_mean"], cv.summary()["f1_std"]

How (``k`` folds, stratified by class, or by "any label" for multilabel targets):

1. For each fold ``i``: fit on the other folds with early stopping on fold ``i``, keeping
   fold ``i``'s probabilities after every epoch (its curve of the monitored metric).
2. The final number of epochs ``E*`` maximizes the mean curve over the folds; the
   thresholds are chosen at ``config.operating_point`` on
   the pooled out-of-fold probabilities at ``E*``: each row scored by a probe that never
   trained on it.
3. Fold ``i``'s reported figures use an epoch and thresholds chosen the same way from the
   *other* folds only, so no reported number was tuned on the rows it is measured on.
   (A fold that early stopping ended first counts with its last epoch for the epochs it did
   not run; :func:`probes.offline.cv._pad`.)
4. :func:`fit_cv` serves the *soup* of the ``k`` fold models: the average of their weights
   after ``E*`` epochs (every fold starts from the same initialization and standardizes by
   the statistics of all rows, so their weights stay in one basin), with the thresholds of
   step 2; or, with ``FitConfig(final="refit")``, refits on every row for ``E*`` epochs.
   The soup costs no further training, and its thresholds were chosen on scores of the
   very models it averages; a refit model is more confident than the fold models its
   thresholds came from, so they transfer worse (``bench/quality.md``).

With ``calibrate=True``, between steps 3 and 4 (:func:`calibrate_cv`): each head's
temperature and per-label bias are fitted on the out-of-fold logits, and the thresholds of
step 2 are chosen again on the calibrated out-of-fold probabilities; the refit probe
carries both.

Depth (:func:`select_depth`): the same cross-validation for each candidate deepest layer
(the probe reads the given layers up to it), then the shallowest depth whose mean fold
AUPRC is within ``epsilon`` of the best; the scorer's forward pass stops at the deepest
layer a served probe reads, so a shallower probe is a cheaper forward::

    result, cv, search = select_depth(spec, data, FitConfig(), folds=3, epsilon=0.01)
    search.chosen, search.table()     # e.g. 15, one row per candidate depth
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from probes.calibration import calibrated_probabilities, fit_heads, raw_logits
from probes.errors import ProbeError
from probes.metrics import choose_thresholds, evaluate
from probes.offline.cv import CVResult, FoldRun, choose_from_folds, fold_reports
from probes.offline.dataset import ProbeDataset
from probes.offline.depth import DepthRow, DepthSearch, choose_depth, depth_candidates
from probes.offline.fit import (
    FitConfig,
    FitResult,
    drift_reference,
    epoch_score,
    fit,
    predict_dataset,
)
from probes.probe import build_probe
from schemas import HeadCalibration, ProbeSpec

log = logging.getLogger(__name__)

__all__ = [
    "calibrate_cv",
    "cross_validate",
    "fit_cv",
    "held_out",
    "mean_state",
    "refit",
    "select_depth",
    "stratified_folds",
]


def held_out(ids: list[str], share: float, salt: str = "probeguard-holdout-v1") -> Tensor:
    """Bool ``[N]``: the rows to hold out, by a hash of their id (deterministic, independent
    of row order and of the other rows; about ``share`` of them).

    >>> held_out(["a", "b", "c"], 0.0).tolist(), held_out(["a", "b", "c"], 1.0).tolist()
    ([False, False, False], [True, True, True])
    """
    if not 0.0 <= share <= 1.0:
        raise ProbeError(f"held-out share must be in [0, 1], got {share}")
    buckets = [
        int.from_bytes(hashlib.sha256(f"{salt}\n{i}".encode()).digest()[:8], "big") % 10_000
        for i in ids
    ]
    return torch.tensor([b < share * 10_000 for b in buckets], dtype=torch.bool)


def stratified_folds(data: ProbeDataset, k: int, seed: int = 0) -> Tensor:
    """Fold index ``[N]`` in ``0..k-1``, each class spread evenly over the folds; rows
    with the same id in the same fold.

    >>> import torch
    >>> d = ProbeDataset([1], ["a", "b"], "multiclass", torch.tensor([0] * 6 + [1] * 3),
    ...                  [str(i) for i in range(9)], summaries=torch.zeros(1, 9, 2))
    >>> [int((stratified_folds(d, 3)[6:] == f).sum()) for f in range(3)]
    [1, 1, 1]
    """
    if k < 2:
        raise ProbeError(f"cross-validation needs at least 2 folds, got {k}")
    if len(data) < k:
        raise ProbeError(f"{len(data)} rows cannot make {k} folds")
    strata = data.targets if data.task == "multiclass" else (data.targets.sum(1) > 0).long()
    g = torch.Generator().manual_seed(seed)
    fold = torch.empty(len(data), dtype=torch.int64)
    offset = 0
    for value in torch.unique(strata):
        rows = (strata == value).nonzero().flatten()
        rows = rows[torch.randperm(len(rows), generator=g)]
        # Continue the round-robin where the previous class stopped: folds stay equal-sized.
        fold[rows] = (torch.arange(len(rows)) + offset) % k
        offset += len(rows)
    # Copies of one row (a recipe that repeats hard examples) share a fold: a copy on each
    # side would score a row with a model that trained on it.
    first: dict[str, int] = {}
    for i, row_id in enumerate(data.ids):
        fold[i] = fold[first.setdefault(row_id, i)]
    return fold


def cross_validate(
    spec: ProbeSpec,
    data: ProbeDataset,
    config: FitConfig = FitConfig(),
    *,
    folds: int = 5,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> CVResult:
    """Steps 1-3 of the module docstring: ``folds`` fits, the choice and the fold figures
    (:mod:`probes.offline.cv`); with ``config.seeds`` above one, all of it once per seed
    (its own folds, initialization and batch order), the epochs chosen on every run's
    curve, each fold reported at the choices of its own seed's other folds, and the
    out-of-fold scores the mean of each row's logits over the seeds."""
    # One standardization for every fold (no labels in it): the folds' weights then mean
    # the same thing, which the soup averages.
    stats = data.input_stats() if config.standardize else None
    runs: list[FoldRun] = []
    states: list[list[dict[str, Tensor]]] = []
    for seed in range(config.seed, config.seed + config.seeds):
        seeded = replace(config, seed=seed)
        assign = stratified_folds(data, folds, seed)
        for i in range(folds):
            run, epoch_states = _fit_fold(spec, data, seeded, assign, i, stats, progress)
            runs.append(run)
            states.append(epoch_states)
    span = max(len(r.curve) for r in runs)
    runs = [r.padded(span) for r in runs]
    reports = [
        report
        for first in range(0, len(runs), folds)
        for report in fold_reports(spec, runs[first : first + folds], config.operating_point)
    ]
    soup = config.final == "soup"
    return choose_from_folds(
        spec, data.targets, runs, reports, config.operating_point, states if soup else []
    )


def _fit_fold(
    spec: ProbeSpec,
    data: ProbeDataset,
    config: FitConfig,
    assign: Tensor,
    i: int,
    stats: tuple[Tensor, Tensor] | None,
    progress: Callable[[dict[str, float]], None] | None,
) -> tuple[FoldRun, list[dict[str, Tensor]]]:
    """Step 1 for fold ``i``: fit on the other folds with early stopping on fold ``i``,
    keeping fold ``i``'s probabilities (and, for the soup, the weights) after every epoch
    (with several seeds, the progress rows name ``config.seed``, this run's)."""
    held = (assign == i).nonzero().flatten()
    rest = (assign != i).nonzero().flatten()
    val = data.subset(held)
    tag = {"seed": float(config.seed)} if config.seeds > 1 else {}

    def tagged(row: dict[str, float]) -> None:
        if progress is not None:
            progress({**tag, "fold": i + 1, **row})

    started = time.perf_counter()
    result = fit(
        build_probe(spec, seed=config.seed),
        data.subset(rest),
        val,
        config,
        progress=tagged,
        record_val_probs=True,
        keep_states=config.final == "soup",
        input_stats=stats,
        reference=False,
    )
    curve = [epoch_score(spec, p, val.targets, config.monitor)[0] for p in result.val_probs]
    seconds = time.perf_counter() - started
    run = FoldRun(held, val.targets, result.val_probs, curve, result.best_epoch, seconds)
    return run, result.epoch_states


def calibrate_cv(
    spec: ProbeSpec, data: ProbeDataset, cv: CVResult, config: FitConfig, *, folds: int = 5
) -> CVResult:
    """``cv`` with each head calibrated on its out-of-fold logits (:func:`probes.calibration.
    fit_heads`; the logits come back from ``cv.oof_probs``) and the thresholds chosen again,
    at ``config.operating_point``, on the calibrated out-of-fold probabilities.

    ``calibration_report``: the headline ECE (:func:`probes.metrics.evaluate`) of the
    out-of-fold probabilities before, and after calibration cross-fitted over ``folds``
    parts of the rows (each part calibrated by the fit on the others), so that figure was
    not tuned on the rows it is measured on."""
    logits, targets = raw_logits(spec, cv.oof_probs), data.targets

    def calibrated_by(calibration: dict[str, HeadCalibration], rows: Tensor) -> Tensor:
        return calibrated_probabilities(
            spec.model_copy(update={"calibration": calibration}), logits[rows]
        )

    calibration = fit_heads(spec, logits, targets, labels_seen=len(data))
    crossed = torch.empty_like(cv.oof_probs)
    part = stratified_folds(data, folds, config.seed)
    for i in range(folds):
        rows = part == i
        crossed[rows] = calibrated_by(fit_heads(spec, logits[~rows], targets[~rows]), rows)
    probs = calibrated_by(calibration, torch.ones(len(data), dtype=torch.bool))
    tuned = spec.model_copy(update={"calibration": calibration})
    thresholds = choose_thresholds(tuned, probs, targets, point=config.operating_point)
    tuned = tuned.model_copy(update={"thresholds": thresholds})
    return replace(
        cv,
        oof_probs=probs,
        thresholds=thresholds,
        oof_report=evaluate(tuned, probs, targets),
        calibration=calibration,
        calibration_report={
            "ece_uncalibrated": float(evaluate(spec, cv.oof_probs, targets)["ece"]),
            "ece": float(evaluate(spec, crossed, targets)["ece"]),
        },
    )


def fit_cv(
    spec: ProbeSpec,
    data: ProbeDataset,
    config: FitConfig = FitConfig(),
    *,
    folds: int = 5,
    calibrate: bool = False,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> tuple[FitResult, CVResult]:
    """Cross-validate, then make the final probe (:func:`refit`: the fold models' soup, or a
    fit on every row) with the chosen thresholds (and, with ``calibrate``, the calibration:
    :func:`calibrate_cv`).
    The result's ``val_report`` is the pooled out-of-fold report."""
    started = time.perf_counter()
    cv = cross_validate(spec, data, config, folds=folds, progress=progress)
    if calibrate:
        cv = calibrate_cv(spec, data, cv, config, folds=folds)
    return refit(spec, data, config, cv, started=started, progress=progress), cv


def refit(
    spec: ProbeSpec,
    data: ProbeDataset,
    config: FitConfig,
    cv: CVResult,
    *,
    started: float | None = None,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> FitResult:
    """Step 4: the soup of ``cv.fold_states`` (``config.final == "soup"``) or a fit on every
    row of ``data`` for ``cv.epochs``, with ``cv.thresholds`` (and ``cv.calibration`` when
    there is one); ``val_report`` is the pooled out-of-fold report, ``seconds`` counts from
    ``started``."""
    started = time.perf_counter() if started is None else started
    if config.final == "soup" and cv.fold_states:
        soup = _soup(spec, data, config, cv, started)
        if soup is not None:
            return soup

    def tagged(row: dict[str, float]) -> None:
        if progress is not None:
            progress({"fold": 0, **row})

    final = fit(
        build_probe(spec, seed=config.seed),
        data,
        None,
        replace(config, max_epochs=cv.epochs),
        progress=tagged,
    )
    if cv.calibration:
        final.probe.set_calibration(cv.calibration)
    final.probe.set_thresholds(cv.thresholds)
    final.val_report = cv.oof_report
    final.seconds = time.perf_counter() - started
    return final


def mean_state(states: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The mean of several models' state dicts (same keys and shapes): a soup's weights."""
    return {
        key: torch.stack([s[key].double() for s in states]).mean(0).to(value.dtype)
        for key, value in states[0].items()
    }


def _soup(
    spec: ProbeSpec, data: ProbeDataset, config: FitConfig, cv: CVResult, started: float
) -> FitResult | None:
    """The probe whose weights are the mean of the fold models' at ``cv.epochs``, or None
    when that mean is no model of the data: fold models that left the shared basin (a high
    learning rate on little data) average to weights that score the rows they all trained
    on worse than each fold scored rows it never saw."""
    probe = build_probe(spec, seed=config.seed)
    probe.load_state_dict(mean_state(cv.fold_states))
    probe.eval()
    seen = float(epoch_score(spec, predict_dataset(probe, data), data.targets, "auprc")[0])
    unseen = statistics.fmean(f.auprc for f in cv.folds)
    if not seen >= unseen:
        log.warning(
            "the soup of the fold models scores AUPRC %.3f on their training rows, below "
            "the folds' %.3f out of fold: refitting on every row instead",
            seen,
            unseen,
        )
        return None
    if cv.calibration:
        probe.set_calibration(cv.calibration)
    probe.set_thresholds(cv.thresholds)
    return FitResult(
        probe=probe,
        best_epoch=cv.epochs,
        epochs=cv.epochs,
        steps=0,
        examples=0,
        seconds=time.perf_counter() - started,
        val_report=cv.oof_report,
        train_rows=len(data),
        train_counts=dict(zip(data.labels, data.class_counts().tolist(), strict=True)),
        drift=drift_reference(probe, data),
        soup_of=len(cv.fold_states),
    )


def select_depth(
    spec: ProbeSpec,
    data: ProbeDataset,
    config: FitConfig = FitConfig(),
    *,
    folds: int = 5,
    epsilon: float = 0.01,
    depths: list[int] | None = None,
    calibrate: bool = False,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> tuple[FitResult, CVResult, DepthSearch]:
    """Search the depth/quality trade-off by cross-validation, then refit at the choice.

    For every candidate depth ``d`` (:func:`depth_candidates` of ``spec.layers``) the
    probe ``spec`` restricted to the layers ``<= d`` is cross-validated (:func:`cross_validate`,
    same folds, same config); the chosen depth is the shallowest whose mean fold AUPRC is
    within ``epsilon`` of the best (:func:`choose_depth`), and the final probe reads only
    its layers, so a scorer serving it stops its forward pass there. Cost: ``folds`` fits
    per candidate plus one refit (shallow candidates are cheaper: fewer layers). With
    ``calibrate``, the chosen depth's probe is calibrated (:func:`calibrate_cv`).
    """
    started = time.perf_counter()
    rows = []
    for depth in depth_candidates(list(spec.layers), depths):
        layers = [i for i in spec.layers if i <= depth]
        sub = ProbeSpec.model_validate({**spec.model_dump(), "layers": layers})
        t0 = time.perf_counter()

        def tagged(row: dict[str, float], depth: int = depth) -> None:
            if progress is not None:
                progress({"depth": depth, **row})

        cv = cross_validate(sub, data.select_layers(layers), config, folds=folds, progress=tagged)
        rows.append(DepthRow(depth, layers, cv, time.perf_counter() - t0))
    chosen, best = choose_depth({r.depth: r.auprc[0] for r in rows}, epsilon)
    search = DepthSearch(rows=rows, chosen=chosen, best=best, epsilon=epsilon)
    pick = search.row(chosen)
    sub = ProbeSpec.model_validate({**spec.model_dump(), "layers": pick.layers})
    if calibrate:
        pick.cv = calibrate_cv(sub, data, pick.cv, config, folds=folds)
    final = refit(
        sub, data.select_layers(pick.layers), config, pick.cv, started=started, progress=progress
    )
    return final, pick.cv, search
