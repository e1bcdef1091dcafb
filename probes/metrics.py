"""Evaluation metrics (numpy; no scikit-learn dependency) and threshold selection.

- :func:`average_precision` is AUPRC as scikit-learn's ``average_precision_score``
  computes it (step-wise, no interpolation).
- :func:`best_f1_threshold` picks the threshold that maximizes F1 on a split;
  :func:`best_threshold` the one at an :class:`OperatingPoint` ("f1",
  "precision>=0.9": the most recall at that precision, "recall>=0.8": the most
  precision at that recall).
- :func:`recall_at_fpr` is the recall at 1 % false positives moderation services report;
  :func:`expected_calibration_error` (ECE) how far scores are from frequencies.
- :func:`evaluate` is the full report ``eval`` prints: F1 at the chosen
  thresholds, AUPRC, recall at 1 % FPR, ECE, accuracy, per-class precision/recall,
  confusion matrix.

Headline ``f1``/``auprc``/``recall_at_1pct_fpr``/``ece``: when the spec has flag labels,
the binary "flagged" decision (the moderation outcome; its score is the flag labels' summed
probability for a multiclass probe, their highest for a multilabel one); otherwise the
macro average over classes. A multi-head
probe is measured head by head, each on the rows that annotate it (``report["heads"]``),
and its headline is the macro average over its heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from probes.decision import decide, flagging_heads
from probes.targets import annotated, head_targets
from schemas import OperatingPoint, ProbeSpec

__all__ = [
    "average_precision",
    "benign_rows",
    "best_f1_threshold",
    "best_threshold",
    "choose_thresholds",
    "evaluate",
    "evaluate_policy",
    "expected_calibration_error",
    "percentile",
    "precision_recall_f1",
    "recall_at_fpr",
]


def _ranked(y: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct thresholds (descending) with true and false positives at each."""
    order = np.argsort(-score, kind="mergesort")
    s, yt = score[order], y[order].astype(np.int64)
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]  # last index of each distinct score
    tps = np.cumsum(yt)[last]
    fps = (last + 1) - tps
    return s[last], tps, fps


def average_precision(y: np.ndarray, score: np.ndarray) -> float:
    """AUPRC of scores for binary targets; NaN when there is no positive."""
    y = np.asarray(y).astype(bool)
    if y.sum() == 0:
        return float("nan")
    _, tps, fps = _ranked(y, np.asarray(score, dtype=np.float64))
    precision = tps / (tps + fps)
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def recall_at_fpr(y: np.ndarray, score: np.ndarray, fpr: float = 0.01) -> float:
    """The most recall at a false-positive rate of at most ``fpr`` (what moderation
    services report beside AUPRC: how much is caught when 1 % of clean traffic is flagged).
    NaN without positives or negatives.

    >>> recall_at_fpr(np.array([0, 0, 1, 1]), np.array([0.1, 0.8, 0.9, 0.3]), fpr=0.0)
    0.5
    """
    y = np.asarray(y).astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, tps, fps = _ranked(y, np.asarray(score, dtype=np.float64))
    ok = fps / n_neg <= fpr + 1e-12
    return float(tps[ok].max() / n_pos) if ok.any() else 0.0


def expected_calibration_error(y: np.ndarray, score: np.ndarray, bins: int = 15) -> float:
    """ECE of probabilities ``score`` for binary targets ``y``: the rows fall into ``bins``
    equal-width bins of [0, 1] (``[k/bins, (k+1)/bins)``, the last one closed), and each
    bin's gap between its mean score and its share of positives counts by its share of the
    rows (Guo et al. 2017, on the positive class; 15 bins as they and most reports use).
    0 is perfectly calibrated; NaN without rows.

    >>> y, s = np.array([0, 1, 1, 0]), np.array([0.1, 0.2, 0.9, 0.95])
    >>> round(expected_calibration_error(y, s, bins=2), 4)  # (0.35 + 0.425) / 2
    0.3875
    """
    y = np.asarray(y).astype(np.float64)
    p = np.clip(np.asarray(score, dtype=np.float64), 0.0, 1.0)
    if len(y) == 0:
        return float("nan")
    which = np.minimum((p * bins).astype(np.int64), bins - 1)  # [N] bin of each row
    # n_b · |mean y_b - mean p_b| = |sum y_b - sum p_b|
    gap = np.abs(np.bincount(which, y, bins) - np.bincount(which, p, bins))  # [bins]
    return float(gap.sum() / len(y))


def best_f1_threshold(y: np.ndarray, score: np.ndarray) -> tuple[float, float]:
    """``(threshold, F1)`` maximizing F1 of ``score >= threshold``.

    The threshold sits halfway between the chosen score and the next lower
    one, so a slightly shifted score distribution keeps the same decisions.
    With no positive, returns ``(0.5, 0.0)``.
    """
    y = np.asarray(y).astype(bool)
    if y.sum() == 0 or len(y) == 0:
        return 0.5, 0.0
    s, tps, fps = _ranked(y, np.asarray(score, dtype=np.float64))
    f1 = 2 * tps / (2 * tps + fps + (tps[-1] - tps))
    i = int(np.argmax(f1))
    lower = s[i + 1] if i + 1 < len(s) else min(0.0, s[i])
    return float((s[i] + lower) / 2), float(f1[i])


def best_threshold(
    y: np.ndarray, score: np.ndarray, point: OperatingPoint = OperatingPoint()
) -> tuple[float, float]:
    """``(threshold, F1)`` of the threshold at ``point`` for ``score >= threshold``.

    ``precision>=X``: the most recall among thresholds whose precision reaches X; when
    none does, the highest precision (the split cannot support X). ``recall>=X``: the most
    precision among thresholds whose recall reaches X. Ties go to the higher F1. The
    threshold sits halfway to the next lower score, as in :func:`best_f1_threshold`.
    With no positive, returns ``(0.5, 0.0)``.

    >>> y, s = np.array([0, 1, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.5, 0.9])
    >>> best_threshold(y, s, OperatingPoint.parse("precision>=1.0"))
    (0.4, 0.8)
    """
    y = np.asarray(y).astype(bool)
    if y.sum() == 0 or len(y) == 0:
        return 0.5, 0.0
    s, tps, fps = _ranked(y, np.asarray(score, dtype=np.float64))
    precision, recall = tps / (tps + fps), tps / tps[-1]
    f1 = 2 * tps / (2 * tps + fps + (tps[-1] - tps))
    if point.metric == "f1":
        key = f1
    else:
        reached = (precision if point.metric == "precision" else recall) >= point.floor - 1e-12
        other = recall if point.metric == "precision" else precision
        if reached.any():
            key = np.where(reached, other + 1e-9 * f1, -1.0)
        else:  # unreachable floor (only possible for precision): its best
            key = precision + 1e-9 * f1
    i = int(np.argmax(key))
    lower = s[i + 1] if i + 1 < len(s) else min(0.0, s[i])
    return float((s[i] + lower) / 2), float(f1[i])


def precision_recall_f1(tp: float, fp: float, fn: float) -> tuple[float, float, float]:
    """Precision, recall and F1 from counts; 0.0 where a ratio is undefined."""
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return p, r, f


def _truth(spec: ProbeSpec, targets: Tensor) -> np.ndarray:
    """Targets as a ``[N, C]`` bool matrix (one-hot for multiclass)."""
    C = len(spec.labels)
    if spec.task == "multiclass":
        return np.eye(C, dtype=bool)[targets.numpy()]
    return targets.numpy() > 0.5


def choose_thresholds(
    spec: ProbeSpec,
    probs: Tensor,
    targets: Tensor,
    *,
    min_positives: int = 1,
    point: OperatingPoint = OperatingPoint(),
) -> dict[str, float]:
    """Per-label thresholds at the operating ``point`` (default: the F1 maximum) on this split.

    Multiclass: one for each flag label (none without flag labels: arg-max).
    Multilabel: one for every label. A label gets a threshold only when this split holds
    at least ``min_positives`` of its positives.
    """
    if spec.heads:
        per_head: dict[str, float] = {}
        for name, rows in annotated(spec, targets).items():
            cols = spec.head_columns(name)
            per_head |= choose_thresholds(
                spec.head_view(name),
                probs[rows][:, cols],
                head_targets(spec, targets, name),
                min_positives=min_positives,
                point=point,
            )
        return per_head
    truth, p = _truth(spec, targets), probs.double().numpy()
    wanted = spec.flag_labels if spec.task == "multiclass" else spec.labels
    out: dict[str, float] = {}
    for label in wanted:
        j = spec.labels.index(label)
        if min_positives > 0 and int(truth[:, j].sum()) >= min_positives:
            out[label] = min(1.0, max(0.0, best_threshold(truth[:, j], p[:, j], point)[0]))
    return out


def _flag_score(spec: ProbeSpec, p: np.ndarray) -> np.ndarray:
    idx = [spec.labels.index(label) for label in spec.flag_labels]
    if spec.task == "multiclass":
        return p[:, idx].sum(axis=1)  # P(any flag class)
    return p[:, idx].max(axis=1)


def evaluate(spec: ProbeSpec, probs: Tensor, targets: Tensor) -> dict[str, Any]:
    """The full report for probabilities ``[N, C]`` against targets, at ``spec.thresholds``."""
    if spec.heads:
        return _evaluate_heads(spec, probs, targets)
    truth, p = _truth(spec, targets), probs.double().numpy()
    decision = decide(spec, probs)
    C = len(spec.labels)
    if spec.task == "multiclass":
        pred = np.eye(C, dtype=bool)[decision.predicted.numpy()]
        accuracy = float((pred == truth).all(axis=1).mean())
    else:
        pred = decision.predicted.numpy()
        accuracy = float((pred == truth).all(axis=1).mean())  # exact match of the label set
    per_class: dict[str, dict[str, float]] = {}
    for j, label in enumerate(spec.labels):
        tp = float((pred[:, j] & truth[:, j]).sum())
        fp = float((pred[:, j] & ~truth[:, j]).sum())
        fn = float((~pred[:, j] & truth[:, j]).sum())
        prec, rec, f1 = precision_recall_f1(tp, fp, fn)
        per_class[label] = {
            "precision": prec,
            "recall": rec,
            "f1": f1,
            "auprc": average_precision(truth[:, j], p[:, j]),
            "recall_at_1pct_fpr": recall_at_fpr(truth[:, j], p[:, j]),
            "ece": expected_calibration_error(truth[:, j], p[:, j]),
            "support": int(truth[:, j].sum()),
            "threshold": spec.thresholds.get(label, float("nan")),
        }
    present = [v for v in per_class.values() if v["support"] > 0]
    report: dict[str, Any] = {
        "n": len(truth),
        "task": spec.task,
        "accuracy": accuracy,
        "macro_f1": float(np.mean([v["f1"] for v in present])) if present else float("nan"),
        "macro_auprc": float(np.mean([v["auprc"] for v in present])) if present else float("nan"),
        "per_class": per_class,
        "confusion": _confusion(spec, truth, pred, decision.predicted),
    }
    if spec.task == "multilabel":
        tp, fp = float((pred & truth).sum()), float((pred & ~truth).sum())
        report["micro_f1"] = precision_recall_f1(tp, fp, float((~pred & truth).sum()))[2]
    if spec.flag_labels:
        flag_idx = [spec.labels.index(label) for label in spec.flag_labels]
        y_flag = np.asarray(truth[:, flag_idx].any(axis=1))
        fl = decision.flagged.numpy()
        prec, rec, f1 = precision_recall_f1(
            float((fl & y_flag).sum()), float((fl & ~y_flag).sum()), float((~fl & y_flag).sum())
        )
        report["flagged"] = {
            "precision": prec,
            "recall": rec,
            "f1": f1,
            "auprc": average_precision(y_flag, _flag_score(spec, p)),
            "recall_at_1pct_fpr": recall_at_fpr(y_flag, _flag_score(spec, p)),
            "ece": expected_calibration_error(y_flag, _flag_score(spec, p)),
            "support": int(y_flag.sum()),
        }
        report["f1"], report["auprc"] = f1, report["flagged"]["auprc"]
        for key in ("recall_at_1pct_fpr", "ece"):
            report[key] = report["flagged"][key]
        report["headline"] = f"flagged ({', '.join(spec.flag_labels)})"
    else:
        report["f1"], report["auprc"] = report["macro_f1"], report["macro_auprc"]
        for key in ("recall_at_1pct_fpr", "ece"):
            report[key] = float(np.mean([v[key] for v in present])) if present else float("nan")
        report["headline"] = "macro over labels"
    return report


def _evaluate_heads(spec: ProbeSpec, probs: Tensor, targets: Tensor) -> dict[str, Any]:
    """Each head on the rows that annotate it; the headline is the macro over heads."""
    heads: dict[str, dict[str, Any]] = {}
    for name, rows in annotated(spec, targets).items():
        if rows.any():
            view, cols = spec.head_view(name), spec.head_columns(name)
            heads[name] = evaluate(view, probs[rows][:, cols], head_targets(spec, targets, name))
    per_class = {label: m for r in heads.values() for label, m in r["per_class"].items()}

    def macro(key: str) -> float:
        # A head whose rows here are all of one class has no AUPRC (or F1): it says nothing
        # of this split, and must not make the whole headline NaN (early stopping reads it).
        values = [r[key] for r in heads.values() if r[key] == r[key]]
        return float(np.mean(values)) if values else float("nan")

    return {
        "n": len(targets),
        "task": "multihead",
        "accuracy": macro("accuracy"),
        "macro_f1": macro("f1"),
        "macro_auprc": macro("auprc"),
        "per_class": per_class,
        "heads": heads,
        "f1": macro("f1"),
        "auprc": macro("auprc"),
        "recall_at_1pct_fpr": macro("recall_at_1pct_fpr"),
        "ece": macro("ece"),
        "headline": f"macro over {len(heads)} heads",
    }


def benign_rows(spec: ProbeSpec, targets: Tensor) -> Tensor:
    """``[N]`` bool: the rows of a multi-head probe's ``targets`` that annotate some head
    and are negative for every head they annotate (a multilabel head: none of its labels;
    a multiclass head: not one of its flag labels). A row unknown for every head is not
    benign: nothing is known of it."""
    ann = annotated(spec, targets)
    some = torch.zeros(len(targets), dtype=torch.bool)
    positive = torch.zeros(len(targets), dtype=torch.bool)
    for h in spec.head_specs:
        cols = spec.head_columns(h.name)
        part = targets[:, cols].nan_to_num(0.0) > 0.5  # [N, C_h]
        if h.task == "multiclass":
            counts = torch.tensor([x in spec.flag_labels for x in h.labels])
            part = part & counts[None]
        positive |= ann[h.name] & part.any(dim=1)
        some |= ann[h.name]
    return some & ~positive


def evaluate_policy(
    spec: ProbeSpec, probs: Tensor, targets: Tensor, flag_heads: frozenset[str] | None = None
) -> dict[str, Any]:
    """A multi-head probe's verdict ``flagged`` (any head of ``flag_heads``, ``None``: every
    head with flag labels, as :func:`probes.decision.flagging_heads`) measured like one
    more head: on the rows that annotate at least one flagging head, positive when one of
    their flag labels is, scored by the verdict's flag score (the flag labels' highest
    probability). ``benign``: of the rows negative for every head they annotate
    (:func:`benign_rows`), how many the policy flags and their share, the benign flag rate.
    """
    policy = flagging_heads(spec, flag_heads)
    heads = [h.name for h in policy.head_specs if any(x in policy.flag_labels for x in h.labels)]
    flagged = decide(policy, probs).flagged.numpy()  # [N]
    benign = benign_rows(spec, targets).numpy()
    n_benign = int(benign.sum())
    out: dict[str, Any] = {
        "heads": heads,
        "flag_labels": list(policy.flag_labels),
        "benign": {
            "n": n_benign,
            "flagged": int(flagged[benign].sum()),
            "rate": float(flagged[benign].mean()) if n_benign else float("nan"),
        },
    }
    idx = [spec.labels.index(x) for x in policy.flag_labels]
    if not idx:
        return out | {"n": 0, "positives": 0}
    flag_cols = targets[:, idx]  # [N, F]
    judged = (~flag_cols.isnan()).any(dim=1).numpy()
    y = (flag_cols.nan_to_num(0.0) > 0.5).any(dim=1).numpy()[judged]
    score = probs[:, idx].double().max(dim=1).values.numpy()[judged]
    fl = flagged[judged]
    prec, rec, f1 = precision_recall_f1(
        float((fl & y).sum()), float((fl & ~y).sum()), float((~fl & y).sum())
    )
    return out | {
        "n": int(judged.sum()),
        "positives": int(y.sum()),
        "precision": prec,
        "recall": rec,
        "f1": f1,
        "auprc": average_precision(y, score),
        "recall_at_1pct_fpr": recall_at_fpr(y, score),
        "flag_rate": float(fl.mean()) if len(fl) else float("nan"),
    }


def _confusion(spec: ProbeSpec, truth: np.ndarray, pred: np.ndarray, predicted: Tensor) -> dict:
    """Multiclass: ``C x C`` counts (rows true, columns predicted). Multilabel: per label
    ``[[tn, fp], [fn, tp]]``."""
    if spec.task == "multiclass":
        C = len(spec.labels)
        m = torch.zeros(C, C, dtype=torch.int64)
        m.index_put_(
            (torch.from_numpy(truth.argmax(axis=1)), predicted),
            torch.ones(len(truth), dtype=torch.int64),
            accumulate=True,
        )
        return {"labels": list(spec.labels), "matrix": m.tolist()}
    per_label = {}
    for j, label in enumerate(spec.labels):
        t, q = truth[:, j], pred[:, j]
        per_label[label] = [
            [int((~t & ~q).sum()), int((~t & q).sum())],
            [int((t & ~q).sum()), int((t & q).sum())],
        ]
    return {"labels": list(spec.labels), "per_label": per_label}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by the nearest-rank rule; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
