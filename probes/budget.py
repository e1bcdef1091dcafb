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

from collections.abc import Mapping, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from probes.errors import ProbeError

# What a newly flagged benign row costs the budget rule (recall_thresholds).
BudgetPrice = Literal["share", "scarcity"]

__all__ = ["BudgetPrice", "budget_thresholds", "flag_margin", "flag_rates", "recall_thresholds"]

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


def recall_thresholds(
    benign: Tensor,
    groups: Sequence[str],
    unsafe: Tensor,
    unsafe_groups: Sequence[str],
    labels: Sequence[str],
    *,
    budget: float | Mapping[str, float],
    price: BudgetPrice = "share",
) -> dict[str, float]:
    """Per label, the threshold that spends the benign ``budget`` where it buys the most:
    the policy flags at most ``budget`` of every benign group (rows ``benign [N, C]``,
    ``groups``; ``budget``: one share for all, or one per group), and among such
    thresholds these maximize the recall on the unsafe rows (``unsafe [M, C]``, each of
    ``unsafe_groups`` weighing the same, so a large source does not outvote a small one).

    Greedy: every threshold starts just above its column's highest benign score (no
    benign row flagged); each step lowers the one threshold, down to the next unsafe row
    it does not flag yet, whose step gains the most weighted recall per benign row newly
    flagged (a benign row another label already flags costs nothing), as long as every
    group stays within the budget. Equal shares (:func:`budget_thresholds`) spend the
    budget on labels that buy nothing: ten labels at a tenth each flagged few unsafe rows.

    ``price``: what a newly flagged benign row costs. ``share``: its share of its group
    (one over the group's size). ``scarcity``: its share of what its group may still flag
    (one over the rows the group's budget has left), so a step that spends most of a
    group's remaining allowance costs as much as it forecloses.
    """
    if price not in get_args(BudgetPrice):
        raise ProbeError(f"price must be 'share' or 'scarcity', got {price!r}")
    shares = {g: budget for g in set(groups)} if isinstance(budget, float | int) else budget
    if set(groups) - set(shares) or not all(0.0 <= x < 1.0 for x in shares.values()):
        raise ProbeError(f"budget must be in [0, 1) for every group, got {budget}")
    C = len(labels)
    if benign.dim() != 2 or benign.shape[1] != C or unsafe.dim() != 2 or unsafe.shape[1] != C:
        raise ProbeError(
            f"benign {tuple(benign.shape)} / unsafe {tuple(unsafe.shape)} vs {C} labels"
        )
    parts = _groups(groups, len(benign))
    if not parts:
        raise ProbeError("no benign rows to choose thresholds on")
    b, u = benign.double(), unsafe.double()
    size = torch.zeros(len(b), dtype=torch.float64)  # each benign row: 1 / its group's size
    allowed = {g: int(shares[g] * int(rows.sum()) + 1e-9) for g, rows in parts.items()}
    group_of = torch.zeros(len(b), dtype=torch.long)
    names = list(parts)
    for k, g in enumerate(names):
        size[parts[g]] = 1.0 / float(parts[g].sum())
        group_of[parts[g]] = k
    limit = torch.tensor([allowed[g] for g in names], dtype=torch.long)
    weight = torch.zeros(len(u), dtype=torch.float64)
    for rows in _groups(unsafe_groups, len(u)).values():
        weight[rows] = 1.0 / float(rows.sum())
    # Start just above each column's highest benign score: no benign row flagged.
    t = b.max(dim=0).values.add(_ABOVE).clamp(max=1.0)
    hit_b = (b >= t).sum(dim=1)  # labels flagging each benign row
    hit_u = (u >= t).sum(dim=1)
    while True:
        best: tuple[float, float, int, float] | None = None
        flagged = torch.bincount(group_of[hit_b > 0], minlength=len(names))
        for j in range(C):
            # The step down to the next unsafe row not flagged yet.
            open_u = (hit_u == 0) & (u[:, j] < t[j])
            if not bool(open_u.any()):
                continue
            lower = float(u[open_u, j].max())
            new_b = (b[:, j] >= lower) & (hit_b == 0)
            extra = torch.bincount(group_of[new_b], minlength=len(names))
            if bool((flagged + extra > limit).any()):
                continue
            gain = float(weight[open_u & (u[:, j] >= lower)].sum())
            if price == "share":
                cost = float(size[new_b].sum())
            else:  # each group's rows over what its budget has left
                cost = float((extra / (limit - flagged).clamp(min=1)).sum())
            ratio = gain / (cost + 1e-12)
            if best is None or (ratio, gain) > (best[0], best[1]):
                best = (ratio, gain, j, lower)
        if best is None:
            break
        _, _, j, lower = best
        hit_b += ((b[:, j] >= lower) & (b[:, j] < t[j])).long()
        hit_u += ((u[:, j] >= lower) & (u[:, j] < t[j])).long()
        t[j] = lower
    return dict(zip(labels, [min(1.0, float(x)) for x in t], strict=True))
