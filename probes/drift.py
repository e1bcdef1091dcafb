"""Drift: live traffic's hidden states and scores against the probe's training statistics.

Two numbers, cheap enough to compute on every scored message from what the probe computes
anyway (:meth:`Probe.predict_proba_pooled`):

* per layer, the **standardized mean shift** of a one-number summary of the pooled state:
  ``r = sqrt(mean_d z_d²)``, the RMS of the probe's normalized per-layer summary ``z``
  (``[L, B, D]``; normalized by the training set's per-dimension statistics, so ``r`` is
  about 1 on familiar text and grows on states the probe never saw). Over a window of live
  messages, ``(mean(r) − μ_train) / σ_train``: how many training standard deviations the
  average message has moved (an effect size, so the same threshold holds for any window);
* the **population stability index** of the drift score (the highest probability among the
  flag labels, else among all labels) over :data:`~schemas.DRIFT_BINS` equal bins of [0, 1]:
  ``PSI = Σ_b (p_b − q_b) · ln(p_b / q_b)``, live shares ``p`` against training shares ``q``
  (both floored at :data:`PSI_FLOOR`, so an empty bin counts as rare, not impossible).
  Rules of thumb: below 0.1 stable, 0.1–0.25 moderate, above 0.25 a shift.

The training side is a :class:`~schemas.DriftReference` in the checkpoint's manifest
(:func:`reference`); the live side a :class:`DriftWindow` of the last messages.

>>> ref = DriftReference(examples=4, layer_mean=[1.0], layer_std=[0.5],
...                      score_bins=[0.5, 0.5] + [0.0] * 8)
>>> mean_shift(ref, [2.0])
[2.0]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from probes.probe import Probe
from schemas import DRIFT_BINS, DriftReference, ProbeSpec

__all__ = [
    "PSI_FLOOR",
    "DriftWindow",
    "drift_score",
    "mean_shift",
    "pooled_rms",
    "probe_reference",
    "psi",
    "reference",
    "score_bins",
]

PSI_FLOOR = 1e-4  # smallest share a bin counts with (ln(0) is not a number)
STD_FLOOR = 1e-6  # a layer whose summary never varied in training: any move is a shift


def pooled_rms(pooled: Tensor) -> Tensor:
    """``[L, B, D]`` normalized summaries -> ``[L, B]``: the RMS over dimensions."""
    return pooled.float().pow(2).mean(dim=-1).sqrt()


def drift_score(spec: ProbeSpec, probs: Tensor) -> Tensor:
    """``[B, C]`` probabilities -> ``[B]``: the highest among ``spec``'s own flag labels
    (whatever a deployment lets flag), else among all labels."""
    cols = [spec.labels.index(x) for x in spec.flag_labels] or list(range(len(spec.labels)))
    return probs[:, cols].float().max(dim=1).values


def score_bins(scores: Tensor) -> Tensor:
    """``[B]`` scores in [0, 1] -> ``[B]`` bin indices (1.0 falls in the last bin)."""
    return (scores.float().clamp(0.0, 1.0) * DRIFT_BINS).long().clamp_max(DRIFT_BINS - 1)


def psi(expected: Sequence[float], counts: Sequence[int | float]) -> float:
    """PSI of observed ``counts`` per bin against ``expected`` shares (see the module)."""
    if len(expected) != len(counts):
        raise ValueError(f"{len(counts)} bins observed, {len(expected)} expected")
    n = float(sum(counts))
    if n <= 0:
        return 0.0
    total = 0.0
    for q, c in zip(expected, counts, strict=True):
        p, q = max(c / n, PSI_FLOOR), max(q, PSI_FLOOR)
        total += (p - q) * math.log(p / q)
    return total


def mean_shift(ref: DriftReference, live_mean: Sequence[float]) -> list[float]:
    """Per layer ``(live mean − training mean) / training std`` of the pooled-state RMS."""
    if len(live_mean) != len(ref.layer_mean):
        raise ValueError(
            f"{len(live_mean)} layers observed, the reference has {len(ref.layer_mean)}"
        )
    return [
        (m - mu) / max(sd, STD_FLOOR)
        for m, mu, sd in zip(live_mean, ref.layer_mean, ref.layer_std, strict=True)
    ]


def reference(
    spec: ProbeSpec, batches: Iterable[tuple[Tensor, Tensor, Tensor | None]]
) -> DriftReference | None:
    """The training statistics of ``batches`` of ``(rms [L, B], probs [B, C], weights [B])``
    (``weights``: how many training examples each row stands for, None for one each; a
    class-balanced replay buffer weights its rows back to the stream's class shares).
    None when there are no rows."""
    L = len(spec.layers)
    w_sum, n = 0.0, 0
    s1 = torch.zeros(L, dtype=torch.float64)
    s2 = torch.zeros(L, dtype=torch.float64)
    bins = torch.zeros(DRIFT_BINS, dtype=torch.float64)
    for rms, probs, weights in batches:
        w = torch.ones(rms.shape[1]) if weights is None else weights
        w = w.double().cpu()
        r = rms.double().cpu()  # [L, B]
        s1 += (r * w).sum(dim=1)
        s2 += (r * r * w).sum(dim=1)
        bins.index_add_(0, score_bins(drift_score(spec, probs)).cpu(), w)
        w_sum += float(w.sum())
        n += rms.shape[1]
    if n == 0 or w_sum <= 0:
        return None
    mean = s1 / w_sum
    std = (s2 / w_sum - mean * mean).clamp_min(0).sqrt()
    return DriftReference(
        examples=n,
        layer_mean=[round(float(x), 6) for x in mean],
        layer_std=[round(float(x), 6) for x in std],
        score_bins=[float(x) for x in bins / bins.sum()],
    )


def probe_reference(
    probe: Probe, batches: Iterable[tuple[Tensor, Tensor | None, Tensor | None]]
) -> DriftReference | None:
    """:func:`reference` of ``probe`` on its training data: ``(hidden, mask, weights)``
    batches as ``probe.predict_proba_many`` takes them (tokens with a mask, or summaries)."""

    def rows() -> Iterable[tuple[Tensor, Tensor, Tensor | None]]:
        for hidden, mask, weights in batches:
            probs, pooled = probe.predict_proba_pooled(hidden, mask)
            yield pooled_rms(pooled), probs, weights

    return reference(probe.spec, rows())


class DriftWindow:
    """The last ``size`` messages' pooled-state RMS per layer and score bin (a ring)."""

    def __init__(self, layers: int, size: int) -> None:
        if size < 1:
            raise ValueError(f"a drift window needs at least one message, not {size}")
        self.rms = torch.zeros(size, layers, dtype=torch.float64)  # [W, L]
        self.bins = torch.zeros(size, dtype=torch.long)  # [W]
        self.size, self.next, self.filled = size, 0, 0

    def add(self, rms: Tensor, bins: Tensor) -> None:
        """``rms`` ``[L, B]`` and ``bins`` ``[B]`` of one batch; the oldest rows make room."""
        rows = rms.detach().double().cpu().T[-self.size :]  # [B, L]
        idx = (self.next + torch.arange(len(rows))) % self.size
        self.rms[idx] = rows
        self.bins[idx] = bins.detach().cpu()[-self.size :]
        self.next = int((self.next + len(rows)) % self.size)
        self.filled = min(self.size, self.filled + len(rows))

    def layer_sum(self) -> list[float]:
        return [float(x) for x in self.rms[: self.filled].sum(dim=0)]

    def counts(self) -> list[int]:
        return torch.bincount(self.bins[: self.filled], minlength=DRIFT_BINS).tolist()

    def shift(self, ref: DriftReference) -> list[float]:
        """Per-layer standardized mean shift of the window against ``ref``."""
        n = max(1, self.filled)
        return mean_shift(ref, [s / n for s in self.layer_sum()])

    def psi(self, ref: DriftReference) -> float:
        return psi(ref.score_bins, self.counts())
