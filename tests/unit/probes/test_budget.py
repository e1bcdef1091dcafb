"""Flag thresholds for a false-positive budget on benign text (probes.budget)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probes.budget import (
    budget_thresholds,
    flag_margin,
    flag_rates,
    joint_thresholds,
    recall_thresholds,
)
from probes.errors import ProbeError


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 6),
    st.sampled_from([0.0, 0.01, 0.05, 0.2]),
)
def test_every_group_stays_within_the_budget(seed: int, labels: int, budget: float) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 200
    probs = torch.rand(n, labels, generator=g) ** 3
    groups = ["a" if i % 3 else "b" for i in range(n)]
    names = [f"l{j}" for j in range(labels)]
    t = budget_thresholds(probs, groups, names, budget=budget)
    rates = flag_rates(probs, groups, [t[x] for x in names])
    assert max(rates.values()) <= budget + 1e-9


def test_the_whole_budget_is_spent_not_just_each_head_within_it() -> None:
    # Two heads flag different benign rows: each alone at the budget would double it.
    probs = torch.zeros(100, 2)
    probs[:10, 0] = torch.linspace(0.5, 0.9, 10)
    probs[10:20, 1] = torch.linspace(0.5, 0.9, 10)
    t = budget_thresholds(probs, ["g"] * 100, ["x", "y"], budget=0.1)
    rate = flag_rates(probs, ["g"] * 100, [t["x"], t["y"]])["g"]
    assert 0.08 <= rate <= 0.1  # close to the budget, never above it


def test_a_small_hard_group_is_held_to_the_budget_on_its_own() -> None:
    easy = torch.zeros(1000, 1)
    hard = torch.linspace(0.0, 1.0, 50)[:, None]
    probs = torch.cat([easy, hard])
    groups = ["easy"] * 1000 + ["hard"] * 50
    t = budget_thresholds(probs, groups, ["x"], budget=0.1)
    assert flag_rates(probs, groups, [t["x"]])["hard"] <= 0.1


def test_a_larger_budget_never_raises_a_threshold() -> None:
    probs = torch.rand(300, 3, generator=torch.Generator().manual_seed(1))
    groups = ["a"] * 300
    tight = budget_thresholds(probs, groups, ["x", "y", "z"], budget=0.02)
    loose = budget_thresholds(probs, groups, ["x", "y", "z"], budget=0.1)
    assert all(loose[k] <= tight[k] for k in tight)


def test_flag_margin_is_non_negative_exactly_where_the_policy_flags() -> None:
    probs = torch.tensor([[0.2, 0.7], [0.6, 0.1], [0.3, 0.3]])
    margin = flag_margin(probs, [0.5, 0.8])
    assert (margin >= 0).tolist() == [False, True, False]


def test_bad_arguments_are_refused_with_the_reason() -> None:
    with pytest.raises(ProbeError, match="budget"):
        budget_thresholds(torch.zeros(2, 1), ["a", "a"], ["x"], budget=1.0)
    with pytest.raises(ProbeError, match="labels"):
        budget_thresholds(torch.zeros(2, 2), ["a", "a"], ["x"], budget=0.1)
    with pytest.raises(ProbeError, match="group names"):
        budget_thresholds(torch.zeros(2, 1), ["a"], ["x"], budget=0.1)


def test_scarcity_pricing_spends_a_small_groups_allowance_where_it_buys_more() -> None:
    # Benign: group a (100 rows, 5 may be flagged), group b (1,000 rows, 100 may be).
    # Label x reaches half of source u1 by flagging a's rows 0-4 (all of a's allowance);
    # label y reaches 6 of source u2's 10 rows by flagging a's row 5 and 80 of b's. Both
    # cannot be had: a would be flagged 6 times. Priced by share of group, x looks cheap
    # (5 of 100 rows against 1 of 100 + 80 of 1,000); priced by what each group has left,
    # both spend all of an allowance (5 of 5; 1 of 5 + 80 of 100) and y buys more.
    benign = torch.zeros(1100, 2)
    benign[:5, 0] = 0.75
    benign[5, 1] = 0.75
    benign[100:180, 1] = 0.75
    groups = ["a"] * 100 + ["b"] * 1000
    unsafe = torch.zeros(20, 2)
    unsafe[:5, 0] = 0.7  # u1: 5 of its 10 rows within x's reach
    unsafe[10:16, 1] = 0.7  # u2: 6 of its 10 rows within y's reach
    unsafe_groups = ["u1"] * 10 + ["u2"] * 10

    def recall(price: str) -> tuple[dict[str, float], float]:
        t = recall_thresholds(
            benign,
            groups,
            unsafe,
            unsafe_groups,
            ["x", "y"],
            budget={"a": 0.05, "b": 0.1},
            price=price,  # type: ignore[arg-type]
        )
        hit = (unsafe >= torch.tensor([t["x"], t["y"]])).any(dim=1).float()
        rates = flag_rates(benign, groups, [t["x"], t["y"]])
        assert rates["a"] <= 0.05 and rates["b"] <= 0.1
        return t, float(hit[:10].mean() + hit[10:].mean())

    (share, by_share), (scarce, by_scarcity) = recall("share"), recall("scarcity")
    assert share["x"] <= 0.7 < share["y"] and by_share == pytest.approx(0.5)
    assert scarce["y"] <= 0.7 < scarce["x"] and by_scarcity == pytest.approx(0.6)
    with pytest.raises(ProbeError, match="price must be"):
        recall("cheapest")


def _two_labels_two_sources() -> tuple[torch.Tensor, list[str], torch.Tensor, list[str]]:
    """One benign group of 100 rows, 10 of which may be flagged. Label x reaches source
    u1's rows only by flagging benign rows 0-19, one for one; label y the same for u2
    with rows 20-39. Every way of spending the ten rows buys the same summed recall."""
    benign = torch.full((100, 2), 0.1)
    steps = torch.linspace(0.55, 0.95, 20)
    benign[:20, 0] = steps + 0.005
    benign[20:40, 1] = steps + 0.005
    unsafe = torch.full((40, 2), 0.1)
    unsafe[:20, 0] = steps
    unsafe[20:, 1] = steps
    return benign, ["a"] * 100, unsafe, ["u1"] * 20 + ["u2"] * 20


def _recalls(unsafe: torch.Tensor, t: dict[str, float]) -> list[float]:
    hit = (unsafe >= torch.tensor([t["x"], t["y"]])).any(dim=1).float()
    return [float(hit[:20].mean()), float(hit[20:].mean())]


def test_joint_thresholds_share_the_budget_where_the_greedy_rule_gives_it_all_away() -> None:
    benign, groups, unsafe, unsafe_groups = _two_labels_two_sources()
    args = (benign, groups, unsafe, unsafe_groups, ["x", "y"])
    greedy = _recalls(unsafe, recall_thresholds(*args, budget=0.1))
    assert sorted(greedy) == [0.0, pytest.approx(0.5)]  # all of it to one source
    runs = []
    for draw in range(4):  # and as 1e-4 of noise moves the scores, the same split
        gen = torch.Generator().manual_seed(draw)
        b, u = (x * (1 + 1e-4 * draw * torch.randn(x.shape, generator=gen)) for x in args[:3:2])
        t = joint_thresholds(b, groups, u, unsafe_groups, ["x", "y"], budget=0.1)
        assert flag_rates(benign, groups, [t["x"], t["y"]])["a"] <= 0.1
        runs.append(_recalls(unsafe, t))
    assert all(r == pytest.approx([0.25, 0.25], abs=0.05) for r in runs)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.01, 0.05, 0.2]))
def test_joint_thresholds_keep_every_group_within_its_budget(seed: int, budget: float) -> None:
    g = torch.Generator().manual_seed(seed)
    benign, unsafe = torch.rand(300, 3, generator=g) ** 3, torch.rand(60, 3, generator=g)
    groups = ["a" if i % 3 else "b" for i in range(300)]
    budgets = {"a": budget, "b": budget / 2}
    t = joint_thresholds(
        benign, groups, unsafe, ["u"] * 30 + ["v"] * 30, ["x", "y", "z"], budget=budgets, steps=30
    )
    rates = flag_rates(benign, groups, [t[x] for x in "xyz"])
    assert all(rates[k] <= budgets[k] + 1e-9 for k in rates)
    with pytest.raises(ProbeError, match="no unsafe rows"):
        joint_thresholds(benign, groups, unsafe[:0], [], ["x", "y", "z"], budget=0.1)
    with pytest.raises(ProbeError, match="temperature"):
        joint_thresholds(benign, groups, unsafe, ["u"] * 60, ["x", "y", "z"], budget=0.1,
                         temperature=0.0)  # fmt: skip


def test_joint_thresholds_keep_their_bounds_so_a_looser_budget_never_raises_one() -> None:
    g = torch.Generator().manual_seed(3)
    benign, unsafe = torch.rand(400, 3, generator=g) ** 2, torch.rand(80, 3, generator=g)
    groups, unsafe_groups = ["a"] * 400, ["u"] * 40 + ["v"] * 40
    args = (benign, groups, unsafe, unsafe_groups, ["x", "y", "z"])
    mid = joint_thresholds(*args, budget=0.05, steps=50)
    loose = joint_thresholds(*args, budget=0.1, steps=50, at_most=mid)
    tight = joint_thresholds(*args, budget=0.02, steps=50, at_least=mid)
    assert all(loose[k] <= mid[k] <= tight[k] for k in mid)
    # ... and each still spends its own budget: not just the neighbour's thresholds.
    assert any(loose[k] < mid[k] for k in mid) and any(tight[k] > mid[k] for k in mid)
    for t, budget in ((loose, 0.1), (tight, 0.02)):
        assert flag_rates(benign, groups, [t[x] for x in "xyz"])["a"] <= budget
    # A ceiling that itself flags too much is refused, as are two bounds at once.
    with pytest.raises(ProbeError, match="at_most"):
        joint_thresholds(*args, budget=0.02, steps=5, at_most=loose)
    with pytest.raises(ProbeError, match="one bound"):
        joint_thresholds(*args, budget=0.05, at_least=mid, at_most=mid)


def test_the_heads_rule_keeps_a_label_in_use_that_the_joint_rule_sets_out_of_reach() -> None:
    # y's positives (the first 10 unsafe rows) are flagged by x already: for the policy's
    # recall y buys nothing, so the joint rule spends no budget on it and the y head flags
    # none of its own rows (a self-harm head set out of reach while an unsafe head flags
    # its rows in development, and not the first-person lines it alone ranks).
    g = torch.Generator().manual_seed(0)
    benign = torch.rand(400, 2, generator=g) ** torch.tensor([3.0, 6.0])
    unsafe = torch.rand(40, 2, generator=g) * torch.tensor([0.5, 1.0]) + torch.tensor([0.5, 0.0])
    unsafe[:10, 0], unsafe[:10, 1] = 0.99, 0.8 + 0.15 * torch.rand(10, generator=g)
    groups, unsafe_groups = ["a"] * 400, ["u"] * 40
    own = {"y": torch.arange(40) < 10}
    args = (benign, groups, unsafe, unsafe_groups, ["x", "y"])

    def own_recall(t: dict[str, float]) -> float:
        return float((unsafe[:10, 1] >= t["y"]).float().mean())

    def recall(t: dict[str, float]) -> float:
        return float((unsafe >= torch.tensor([t["x"], t["y"]])).any(dim=1).float().mean())

    joint = joint_thresholds(*args, budget=0.05)
    heads = joint_thresholds(*args, budget=0.05, own=own)
    assert own_recall(joint) <= 0.1 < 0.5 <= own_recall(heads)
    for t in (joint, heads):
        assert flag_rates(benign, groups, [t["x"], t["y"]])["a"] <= 0.05
    # ... at a small cost to the policy's recall, not all of it.
    assert recall(heads) >= 0.75 * recall(joint)
    with pytest.raises(ProbeError, match="not among"):
        joint_thresholds(*args, budget=0.05, own={"z": own["y"]})
    with pytest.raises(ProbeError, match="mask"):
        joint_thresholds(*args, budget=0.05, own={"y": own["y"][:5]})
