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
# How the thresholds are chosen: label by label (recall_thresholds), all at once
# (joint_thresholds), or all at once with every label's own recall counted beside the
# sources' (joint_thresholds' ``own``).
BudgetRule = Literal["greedy", "joint", "heads"]

__all__ = [
    "BudgetPrice",
    "BudgetRule",
    "budget_thresholds",
    "flag_margin",
    "flag_rates",
    "joint_thresholds",
    "recall_thresholds",
]

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


def _checked(
    benign: Tensor,
    groups: Sequence[str],
    unsafe: Tensor,
    C: int,
    budget: float | Mapping[str, float],
) -> tuple[Mapping[str, float], dict[str, Tensor]]:
    """The rules' common arguments checked: each group's budget and its benign rows."""
    shares = {g: budget for g in set(groups)} if isinstance(budget, float | int) else budget
    if set(groups) - set(shares) or not all(0.0 <= x < 1.0 for x in shares.values()):
        raise ProbeError(f"budget must be in [0, 1) for every group, got {budget}")
    if benign.dim() != 2 or benign.shape[1] != C or unsafe.dim() != 2 or unsafe.shape[1] != C:
        raise ProbeError(
            f"benign {tuple(benign.shape)} / unsafe {tuple(unsafe.shape)} vs {C} labels"
        )
    parts = _groups(groups, len(benign))
    if not parts:
        raise ProbeError("no benign rows to choose thresholds on")
    return shares, parts


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
    C = len(labels)
    shares, parts = _checked(benign, groups, unsafe, C, budget)
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


def joint_thresholds(
    benign: Tensor,
    groups: Sequence[str],
    unsafe: Tensor,
    unsafe_groups: Sequence[str],
    labels: Sequence[str],
    *,
    budget: float | Mapping[str, float],
    temperature: float = 0.25,
    steps: int = 1500,
    at_least: Mapping[str, float] | None = None,
    at_most: Mapping[str, float] | None = None,
    own: Mapping[str, Tensor] | None = None,
) -> dict[str, float]:
    """Per label, the threshold chosen for every label at once: the policy flags at most
    ``budget`` of every benign group (as :func:`recall_thresholds`), and among such
    thresholds these maximize the mean over unsafe groups of the log of each group's
    recall. The log prefers spreading the benign budget over the unsafe groups to buying
    one group a little more with another's share, so two labels that buy about the same
    do not decide, on the last bits of their scores, which one takes a scarce group's
    whole allowance (the greedy rule's chain of discrete choices did: 1e-4 of noise moved
    the default's AILuminate recall between 64 and 76 %, docs/default-probe.md).

    The flags are smoothed (``sigmoid((logit p - logit t) / temperature)``, "any label"
    as one minus the product of the labels' complements), the over-budget share of each
    group is a quadratic penalty, a thousandth of the budget used breaks ties between
    ways to the same recall, and L-BFGS (at most ``steps`` iterations) climbs from every
    label at an equal share of each group. The result is then made exact: every threshold
    moves by the same logit, the least for which no group is over its budget. Each step
    is continuous in the scores, so scores that move a little move the thresholds a
    little (at ``temperature`` 0.25, chosen before any measurement; 0.1 let them jump).

    ``at_least`` / ``at_most``: per label, bounds the thresholds keep (one of them; the
    thresholds of a tighter / looser budget, so that a looser budget never raises a
    threshold; ``at_most`` must itself keep every group within ``budget``).

    ``own``: per label, a mask over the unsafe rows (those positive for it). Each label's
    own recall on its rows (its flag alone, not the policy's) is then a group of its own,
    and the objective weighs the sources' mean log recall and the labels' half each, so
    the budget is not met by setting a label out of reach (at zero recall its log costs
    as much as a source's would): every head stays in use.
    """
    C = len(labels)
    shares, parts = _checked(benign, groups, unsafe, C, budget)
    if temperature <= 0 or steps < 0:
        raise ProbeError(f"temperature must be > 0 and steps >= 0, got {temperature}, {steps}")
    if at_least is not None and at_most is not None:
        raise ProbeError("at_least and at_most: one bound at a time")
    eps = 1e-6
    b = benign.double()
    zb = torch.logit(b.clamp(eps, 1 - eps))
    zu = torch.logit(unsafe.double().clamp(eps, 1 - eps))
    cap = torch.tensor([shares[g] for g in parts], dtype=torch.float64)
    sizes = torch.stack([rows.double().sum() for rows in parts.values()])
    allowed = (cap * sizes + 1e-9).floor()
    # Row-averaging matrices: group x row.
    mean_b = torch.stack([rows.double() / rows.sum() for rows in parts.values()])
    unsafe_parts = _groups(unsafe_groups, len(unsafe))
    if not unsafe_parts:
        raise ProbeError("no unsafe rows to choose thresholds for")
    mean_u = torch.stack([rows.double() / rows.sum() for rows in unsafe_parts.values()])
    own_cols, mean_own = _own(own or {}, labels, len(unsafe))
    # The start: each label flags the same share of every group (its strictest quantile).
    start = [
        max(_threshold(b[rows, j], float(shares[g]) / max(C, 1)) for g, rows in parts.items())
        for j in range(C)
    ]
    bound, sign = (at_least, 1.0) if at_least is not None else (at_most, -1.0)
    theta0 = torch.logit(torch.tensor(start, dtype=torch.float64).clamp(eps, 1 - eps))
    if bound is not None:
        if set(bound) != set(labels):
            raise ProbeError(f"bounds for {sorted(bound)}, labels {sorted(labels)}")
        limit = torch.tensor([bound[x] for x in labels], dtype=torch.float64)
        edge = torch.logit(limit.clamp(eps, 1 - eps))
        # theta = edge + sign * softplus(phi): on the bound's side of it, whatever phi.
        gap = (sign * (theta0 - edge)).clamp(min=1e-3)
        phi = torch.log(torch.expm1(gap)).requires_grad_(True)
    else:
        phi = theta0.clone().requires_grad_(True)

    def thetas() -> Tensor:
        if bound is None:
            return phi
        return edge + sign * torch.nn.functional.softplus(phi)

    slack = torch.maximum(cap, 0.5 / sizes)  # the penalty's scale per group

    def soft_any(z: Tensor) -> Tensor:
        logs = torch.nn.functional.logsigmoid((thetas() - z) / temperature)
        return 1 - torch.exp(logs.sum(1))

    optimizer = torch.optim.LBFGS(
        [phi], lr=1.0, max_iter=steps, tolerance_grad=1e-10, tolerance_change=1e-14,
        history_size=20, line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure() -> Tensor:
        optimizer.zero_grad()
        recall = mean_u @ soft_any(zu)
        spent = mean_b @ soft_any(zb)
        over = torch.relu(spent - cap) / slack
        gain = torch.log(recall + 1e-3).mean()
        if own_cols:
            flags = torch.sigmoid((zu[:, own_cols] - thetas()[own_cols]) / temperature)
            mine = (mean_own * flags.T).sum(1)  # each label's own recall on its rows
            gain = (gain + torch.log(mine + 1e-3).mean()) / 2
        loss = -gain + 1e3 * over.pow(2).sum() + 1e-3 * spent.sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    theta = thetas().detach()

    def within(t: Tensor) -> bool:
        flagged = (b >= t).any(dim=1).double()
        return bool((mean_b @ flagged * sizes <= allowed + 1e-9).all())

    def at(shift: float) -> Tensor:
        """The thresholds moved by ``shift``, kept on their bound's side of it."""
        t = torch.sigmoid(theta + shift)
        if bound is None:
            return t
        return torch.maximum(t, limit) if sign > 0 else torch.minimum(t, limit)

    # The least common shift that keeps every group within its budget (flags only fall as
    # the shift grows; past the highest benign score nothing is flagged, or, under
    # ceilings, the ceilings themselves are reached, which must fit).
    if bound is not None and sign < 0 and not within(limit):
        raise ProbeError("at_most's thresholds flag more than the budget allows")
    high = float(zb.max() - theta.min()) + 1.0 if len(zb) else 0.0
    low = float(zb.min() - theta.max()) - 1.0 if len(zb) else 0.0
    if within(at(low)):
        high = low
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if within(at(mid)) else (mid, high)
    t = at(high)
    return dict(zip(labels, [min(1.0, float(x)) for x in t], strict=True))


def _own(own: Mapping[str, Tensor], labels: Sequence[str], n: int) -> tuple[list[int], Tensor]:
    """joint_thresholds' ``own``: the columns of the labels it gives rows for, and the
    row-averaging matrix ``[len(columns), n]`` over the ``n`` unsafe rows (each label's
    row: one over its count on its rows, zero elsewhere)."""
    if unknown := sorted(set(own) - set(labels)):
        raise ProbeError(f"own recall asked for labels {unknown} not among {list(labels)}")
    cols, means = [], []
    for j, label in enumerate(labels):
        rows = own.get(label)
        if rows is None:
            continue
        if rows.shape != (n,):
            raise ProbeError(f"{label}: a mask of {tuple(rows.shape)} for {n} unsafe rows")
        if bool(rows.any()):
            cols.append(j)
            means.append(rows.double() / rows.double().sum())
    return cols, (torch.stack(means) if means else torch.zeros(0, n, dtype=torch.float64))
