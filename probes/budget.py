"""Flag thresholds for a false-positive budget on benign text.

A verdict is flagged when any flagging head is (``probes.decision``), so every head adds
its own false positives: eleven heads each at its F1 maximum, chosen on mixtures where
positives are common, flagged a third of ordinary chat. Here the operating point is chosen
on benign rows instead: each flagging label ``l`` gets the threshold that flags a share
``a`` of every benign group's rows (the highest of the groups' ``1 - a`` quantiles of
``p_l``), and ``a`` is the largest share for which the *whole* policy (any label) flags at
most ``budget`` of each group. Every group is held to the budget on its own, so a large
group of easy text does not buy a small group of hard text a worse rate.

>>> import torch
>>> probs = torch.tensor([[0.1, 0.2], [0.9, 0.1], [0.2, 0.8], [0.3, 0.3]])
>>> t = budget_thresholds(probs, ["a", "a", "a", "a"], ["x", "y"], budget=0.25)
>>> flagged = (probs >= torch.tensor([t["x"], t["y"]])).any(1)
>>> float(flagged.float().mean()) <= 0.25
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from probes.errors import ProbeError

__all__ = ["budget_thresholds", "flag_margin", "flag_rates"]

# Thresholds sit just above the benign score they must not flag.
_ABOVE = 1e-6


def _threshold(scores: Tensor, share: float) -> float:
    """The least threshold that flags at most ``share`` of ``scores`` (``p >= t`` flags)."""
    ordered = scores.double().sort(descending=True).values
    k = int(share * len(ordered) + 1e-9)  # rows that may be flagged
    if k >= len(ordered):
        return 0.0
    return min(1.0, float(ordered[k]) + _ABOVE)


def _groups(groups: Sequence[str], n: int) -> dict[str, Tensor]:
    if len(groups) != n:
        raise ProbeError(f"{len(groups)} group names for {n} rows")
    names = sorted(set(groups))
    return {g: torch.tensor([x == g for x in groups]) for g in names}


def flag_rates(
    probs: Tensor, groups: Sequence[str], thresholds: Sequence[float]
) -> dict[str, float]:
    """Per group, the share of its rows ``[N, C]`` that any column flags (``p >= t``)."""
    flagged = (probs.double() >= torch.tensor(thresholds, dtype=torch.float64)).any(dim=1)
    return {
        g: float(flagged[rows].double().mean()) for g, rows in _groups(groups, len(probs)).items()
    }


def budget_thresholds(
    probs: Tensor,
    groups: Sequence[str],
    labels: Sequence[str],
    *,
    budget: float,
    steps: int = 40,
) -> dict[str, float]:
    """Per label, the threshold on benign rows' probabilities ``probs [N, C]`` (columns:
    ``labels``; rows: benign texts, ``groups[i]`` the source of row ``i``) such that the
    policy "any label at or above its threshold" flags at most ``budget`` of every group
    (module docstring). Bisection over the per-label share ``a`` in ``[0, budget]``."""
    if not 0.0 <= budget < 1.0:
        raise ProbeError(f"budget must be in [0, 1), got {budget}")
    if probs.dim() != 2 or probs.shape[1] != len(labels):
        raise ProbeError(f"probs {tuple(probs.shape)} do not match {len(labels)} labels")
    parts = _groups(groups, len(probs))
    if not parts:
        raise ProbeError("no benign rows to choose thresholds on")

    def at(share: float) -> list[float]:
        return [
            max(_threshold(probs[rows, j], share) for rows in parts.values())
            for j in range(len(labels))
        ]

    def worst(share: float) -> float:
        return max(flag_rates(probs, groups, at(share)).values())

    low, high = 0.0, budget
    if worst(high) <= budget:
        low = high
    else:
        for _ in range(steps):
            mid = (low + high) / 2
            low, high = (mid, high) if worst(mid) <= budget else (low, mid)
    return dict(zip(labels, at(low), strict=True))


def flag_margin(probs: Tensor, thresholds: Sequence[float]) -> Tensor:
    """``[N]``: how far the most flagging column of ``probs [N, C]`` is past its threshold,
    in logits (``max_l logit(p_l) - logit(t_l)``): ``>= 0`` exactly when the policy flags.
    One score per row that ranks by the policy, whatever head would flag it (what the
    card's "any head" AUPRC ranks by)."""
    eps = 1e-7
    p = probs.double().clamp(eps, 1 - eps)
    t = torch.tensor(thresholds, dtype=torch.float64).clamp(eps, 1 - eps)
    return (torch.logit(p) - torch.logit(t)).amax(dim=1).float()
