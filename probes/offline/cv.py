"""What a cross-validation chooses from its folds' runs, and the figures it reports.

Steps 2 and 3 of :mod:`probes.offline.select`: the folds have been fitted (each kept its
probabilities after every epoch); here the epochs and thresholds are chosen from those
runs, and each fold is reported at choices made on the *other* folds only. Kept apart
from the fitting so the honesty rule (no figure tuned on the rows it measures) reads in
one place.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from probes.calibration import calibrated_probabilities, raw_logits
from probes.errors import ProbeError
from probes.metrics import choose_thresholds, evaluate
from schemas import HeadCalibration, OperatingPoint, ProbeSpec

__all__ = ["CVResult", "FoldReport", "FoldRun", "choose_from_folds", "fold_reports", "oof_mean"]


@dataclass
class FoldReport:
    """One fold's figures, at an epoch and thresholds chosen on the other folds."""

    fold: int
    rows: int
    positives: int  # flagged rows (headline), or rows with any label
    epoch: int  # chosen from the other folds' curves
    own_best_epoch: int  # this fold's own best (not used for anything it reports)
    thresholds: dict[str, float]
    f1: float
    precision: float
    recall: float
    auprc: float
    seconds: float
    recall_at_1pct_fpr: float  # headline recall where 1 % of negatives are flagged
    ece: float  # calibration error of the fold's (uncalibrated) probabilities


@dataclass
class CVResult:
    """What :func:`probes.offline.select.cross_validate` chose, and the honest per-fold
    figures behind it."""

    folds: list[FoldReport]
    epochs: int  # E*: epochs for the final refit
    thresholds: dict[str, float]  # chosen on all out-of-fold probabilities at E*
    curve: list[float]  # mean monitored score per epoch
    fold_curves: list[list[float]]  # each fold's monitored score per epoch (padded: _pad)
    oof_probs: Tensor  # [N, C] out-of-fold probabilities at E*, in row order
    oof_report: dict[str, Any] = field(default_factory=dict)  # at `thresholds` (tuned on it)
    fold_states: list[dict[str, Tensor]] = field(default_factory=list)  # weights at E* (soup)
    # calibrate_cv: per head, fitted on the out-of-fold logits (oof_probs, thresholds and
    # oof_report are then the calibrated ones), and its ECE before and after.
    calibration: dict[str, HeadCalibration] = field(default_factory=dict)
    calibration_report: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Mean and spread (sample standard deviation) of the fold figures."""
        out: dict[str, float] = {"folds": float(len(self.folds)), "epochs": float(self.epochs)}
        for key in ("f1", "precision", "recall", "auprc"):
            values = [getattr(f, key) for f in self.folds]
            out[f"{key}_mean"] = statistics.fmean(values)
            out[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        return out


@dataclass
class FoldRun:
    """One fold's fit: its held-out rows and what they scored after every epoch."""

    held: Tensor  # [n] indices of the fold's rows
    targets: Tensor  # the fold's targets, in the order of ``held``
    probs: list[Tensor]  # per epoch: [n, C] probabilities of the fold's rows
    curve: list[float]  # per epoch: the monitored score on the fold
    best_epoch: int  # the fold's own early-stopping choice
    seconds: float

    def padded(self, length: int) -> FoldRun:
        """The run with its epochs padded to ``length`` (:func:`_pad`)."""
        return replace(self, probs=_pad(self.probs, length), curve=_pad(self.curve, length))


def _headline(report: dict[str, Any]) -> tuple[float, float, float]:
    """``(precision, recall, support)`` of the headline decision of an ``evaluate`` report."""
    if "flagged" in report:
        f = report["flagged"]
        return f["precision"], f["recall"], f["support"]
    present = [v for v in report["per_class"].values() if v["support"] > 0]
    mean = statistics.fmean
    return (
        mean(v["precision"] for v in present),
        mean(v["recall"] for v in present),
        sum(v["support"] for v in present),
    )


def _best_epoch(curves: list[list[float]]) -> tuple[int, list[float]]:
    """``(epoch, mean curve)``: the 1-based epoch maximizing the mean over ``curves``
    (all of one length; see :func:`_pad`)."""
    mean = [statistics.fmean(c[e] for c in curves) for e in range(len(curves[0]))]
    return 1 + max(range(len(mean)), key=lambda e: mean[e]), mean


def _pad(values: list, length: int) -> list:
    """A fold that early stopping ended first keeps its last epoch for the epochs it did not
    run: it stopped after ``patience`` epochs without improvement, so its last epoch is past
    its best, and padding with it never flatters a longer run."""
    return values + [values[-1]] * (length - len(values))


def fold_reports(spec: ProbeSpec, runs: list[FoldRun], point: OperatingPoint) -> list[FoldReport]:
    """Step 3: each fold's figures at the epoch and thresholds the *other* folds choose
    (``runs`` padded to one length)."""
    reports = []
    for i, run in enumerate(runs):
        others = [r for j, r in enumerate(runs) if j != i]
        epoch, _ = _best_epoch([r.curve for r in others])
        pooled = torch.cat([r.probs[epoch - 1] for r in others])
        truth = torch.cat([r.targets for r in others])
        thresholds = choose_thresholds(spec, pooled, truth, point=point)
        tuned = spec.model_copy(update={"thresholds": thresholds})
        report = evaluate(tuned, run.probs[epoch - 1], run.targets)
        precision, recall, support = _headline(report)
        reports.append(
            FoldReport(
                fold=i + 1,
                rows=len(run.held),
                positives=int(support),
                epoch=epoch,
                own_best_epoch=run.best_epoch,
                thresholds=thresholds,
                f1=float(report["f1"]),
                precision=float(precision),
                recall=float(recall),
                auprc=float(report["auprc"]),
                seconds=run.seconds,
                recall_at_1pct_fpr=float(report["recall_at_1pct_fpr"]),
                ece=float(report["ece"]),
            )
        )
    return reports


def oof_mean(spec: ProbeSpec, rows: int, parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """``[rows, C]`` probabilities from ``parts`` (held row indices, their probabilities):
    a row held once keeps its probabilities as they are; a row held by several parts gets
    those of the mean of its logits (:func:`probes.calibration.raw_logits`).

    >>> spec = ProbeSpec(name="t", token_pool="mean", layer_mix="single", layers=[1],
    ...     hidden_size=8, task="multilabel", labels=["a"])
    >>> held, p = torch.tensor([0, 1]), torch.sigmoid(torch.tensor([[-2.0], [2.0]]))
    >>> oof_mean(spec, 2, [(held, p), (held[:1], torch.sigmoid(torch.tensor([[4.0]])))])
    tensor([[0.7311],
            [0.8808]])
    """
    count = torch.zeros(rows, dtype=torch.int64)
    for held, _ in parts:
        count[held] += 1
    if not bool((count > 0).all()):
        raise ProbeError(f"{int((count == 0).sum())} rows have no out-of-fold probabilities")
    oof = torch.empty(rows, len(spec.labels))
    if bool((count == 1).all()):
        for held, probs in parts:
            oof[held] = probs
        return oof
    logits = torch.zeros(rows, len(spec.labels), dtype=torch.float64)
    for held, probs in parts:
        logits[held] += raw_logits(spec, probs).double()
    return calibrated_probabilities(spec, (logits / count[:, None]).float())


def choose_from_folds(
    spec: ProbeSpec,
    targets: Tensor,
    runs: list[FoldRun],
    reports: list[FoldReport],
    point: OperatingPoint,
    states: list[list[dict[str, Tensor]]],
) -> CVResult:
    """Step 2: the epochs maximizing the folds' mean curve and the thresholds on the pooled
    out-of-fold probabilities at those epochs (``targets``: every row's, in row order;
    ``states``: each fold's weights per epoch for the soup, or none). Runs of several
    seeds hold each row once per seed: its out-of-fold probabilities are then those of the
    mean of its logits (:func:`oof_mean`), as the soup's are near the mean of its members'."""
    epochs, curve = _best_epoch([r.curve for r in runs])
    oof = oof_mean(spec, len(targets), [(r.held, r.probs[epochs - 1]) for r in runs])
    thresholds = choose_thresholds(spec, oof, targets, point=point)
    tuned = spec.model_copy(update={"thresholds": thresholds})
    # A fold that stopped early contributes its last epoch (as its curve does, _pad).
    at_best = [s[min(epochs, len(s)) - 1] for s in states]
    return CVResult(
        folds=reports,
        epochs=epochs,
        thresholds=thresholds,
        curve=curve,
        fold_curves=[r.curve for r in runs],
        oof_probs=oof,
        oof_report=evaluate(tuned, oof, targets),
        fold_states=at_best,
    )
