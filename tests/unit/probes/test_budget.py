"""Flag thresholds for a false-positive budget on benign text (probes.budget)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probes.budget import budget_thresholds, flag_margin, flag_rates
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
