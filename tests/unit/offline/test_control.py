"""Control tasks: deterministic, balance-preserving, and blind to the real label."""

from __future__ import annotations

import random

import pytest
import torch

from probes import ProbeError
from probes.offline.control import control_key, control_targets, label_predictability


def zipf_keys(n: int, vocab: int = 400, seed: int = 0) -> list[str]:
    """First words the way chat messages have them: a few very common, a long tail."""
    rng = random.Random(seed)
    weights = [1 / (r + 1) for r in range(vocab)]
    return [f"w{k}" for k in rng.choices(range(vocab), weights=weights, k=n)]


def imbalanced(n: int, shares: list[float], seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(torch.tensor(shares), n, replacement=True, generator=g)


def test_the_key_is_the_first_word_type() -> None:
    assert control_key("Write a story") == control_key("write, please") == "write"
    assert control_key("!!!") == "" and control_key("  42 apples") == "42"


def test_deterministic_and_independent_of_row_order() -> None:
    keys, real = zipf_keys(3000), imbalanced(3000, [0.7, 0.2, 0.1])
    first = control_targets(keys, real)
    assert torch.equal(first, control_targets(keys, real))
    perm = torch.randperm(3000, generator=torch.Generator().manual_seed(2))
    shuffled = control_targets([keys[i] for i in perm.tolist()], real[perm])
    assert torch.equal(shuffled, first[perm])
    # A function of the key: every message with the same first word gets the same label.
    by_key: dict[str, set[int]] = {}
    for k, c in zip(keys, first.tolist(), strict=True):
        by_key.setdefault(k, set()).add(c)
    assert all(len(v) == 1 for v in by_key.values())
    # Another salt, another function.
    assert not torch.equal(first, control_targets(keys, real, salt="other"))


@pytest.mark.parametrize("shares", [[0.93, 0.07], [0.4, 0.3, 0.2, 0.1]])
def test_same_class_balance(shares: list[float]) -> None:
    keys, real = zipf_keys(3000), imbalanced(3000, shares)
    control = control_targets(keys, real)
    want = torch.bincount(real, minlength=len(shares))
    got = torch.bincount(control, minlength=len(shares))
    assert torch.equal(got, want)  # the long tail of rare first words fills every quota
    # Every key distinct: exactly the same counts.
    unique = control_targets([str(i) for i in range(3000)], real)
    assert torch.equal(torch.bincount(unique, minlength=len(shares)), want)


def test_multilabel_keeps_each_columns_positive_rate() -> None:
    keys = [str(i) for i in range(1000)]
    g = torch.Generator().manual_seed(0)
    real = (torch.rand(1000, 3, generator=g) < torch.tensor([0.05, 0.2, 0.5])).float()
    control = control_targets(keys, real)
    assert control.shape == real.shape and control.dtype == real.dtype
    assert torch.equal(control.sum(0), real.sum(0))
    assert not torch.equal(control[:, 0], control[:, 1])  # independent columns


def test_not_predictable_from_the_real_label() -> None:
    keys = zipf_keys(5000, seed=3)
    for shares in ([0.93, 0.07], [0.4, 0.3, 0.2, 0.1]):
        real = imbalanced(5000, shares, seed=4)
        control = control_targets(keys, real)
        accuracy, majority = label_predictability(real, control)
        assert accuracy - majority < 0.01, (accuracy, majority)
        assert (control != real).float().mean() > 0.1
    # A deliberately predictable "control" is caught by the same measure.
    accuracy, majority = label_predictability(real, real)
    assert accuracy == 1.0 and majority < 0.5


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ProbeError, match="3 keys for 2 targets"):
        control_targets(["a", "b", "c"], torch.tensor([0, 1]))
