"""The exit head: part of the probe's spec and state (checkpoints carry it), learned by the
same Lion steps, calibrated, and deciding only the confident rows."""

from __future__ import annotations

import json

import pytest
import torch

from probes import build_probe, checkpoint_to_bytes, probe_from_bytes
from probes.exit import (
    attach_exit,
    calibrated,
    exit_probabilities,
    exits,
    fit_calibration,
)
from probes.heads import add_head, remove_head
from probes.learner import Learner
from probes.probe import keep_layers
from schemas import ExitSpec, HeadSpec, ProbeResult, ProbeSpec
from tests.unit.synthetic import FINGERPRINT, make_spec, toy_task


def exit_spec(pool: str = "mha") -> ProbeSpec:
    return make_spec(pool, "scalar_mix", exit=ExitSpec(layer=2, allow_below=0.2))


def test_specs_without_an_exit_serialize_as_before_and_bad_exits_are_refused() -> None:
    assert "exit" not in json.loads(make_spec("mean", "scalar_mix").encode())
    spec = exit_spec()
    assert ProbeSpec.model_validate_json(spec.encode()) == spec
    data = spec.model_dump()
    for layer in (3, 4):  # not read by the probe / its deepest layer
        with pytest.raises(ValueError, match="exit layer"):
            ProbeSpec.model_validate({**data, "exit": {"layer": layer}})
    with pytest.raises(ValueError, match="flag_labels"):
        ProbeSpec.model_validate({**data, "flag_labels": []})


def test_results_without_depth_read_as_before() -> None:
    old = ProbeResult(probe="p", version=1, scores={"toxic": 0.1}, predicted=[], flagged=False)
    assert "depth" not in json.loads(old.encode())
    early = ProbeResult.model_validate({**old.model_dump(), "depth": 8})
    assert ProbeResult.model_validate_json(early.encode()).depth == 8


def test_checkpoint_round_trip_carries_the_exit_head() -> None:
    probe = build_probe(exit_spec(), seed=0)
    assert probe.exit_head is not None
    assert any(k.startswith("exit_head.") for k in probe.state_dict())
    blob, manifest = checkpoint_to_bytes(probe, llm=FINGERPRINT, signing_key=b"k" * 32)
    back, m = probe_from_bytes(blob, manifest, FINGERPRINT, signing_key=b"k" * 32)
    assert m.spec.exit == probe.spec.exit
    hidden, mask, _ = toy_task(3, "multiclass")
    torch.testing.assert_close(
        exit_probabilities(back, hidden[1], mask), exit_probabilities(probe, hidden[1], mask)
    )


@pytest.mark.parametrize(("pool", "exit_pool"), [("mean", "mean"), ("mha", "mha")])
def test_learner_steps_train_the_exit_head_on_the_same_labels(pool: str, exit_pool: str) -> None:
    torch.manual_seed(0)
    exit = ExitSpec(layer=2, allow_below=0.2, token_pool=exit_pool)  # type: ignore[arg-type]
    probe = build_probe(make_spec(pool, "scalar_mix", exit=exit), seed=0)
    hidden, mask, y = toy_task(3, "multiclass", n=96)
    assert probe.exit_head is not None
    before = probe.exit_head.head.weight.detach().clone()

    def exit_loss() -> float:
        assert probe.exit_head is not None
        logits = probe.exit_head(probe.exit_input(hidden), mask)
        return float(torch.nn.functional.cross_entropy(logits, y).detach())

    start = exit_loss()
    learner = Learner(probe, lr=3e-3)
    for _ in range(30):
        learner.learn_many(hidden, mask, y)
    assert not torch.equal(before, probe.exit_head.head.weight)
    assert exit_loss() < 0.5 * start


def test_calibration_thresholds_and_exits() -> None:
    spec = exit_spec()
    logits = torch.tensor([[3.0, -3.0, 0.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.0]])
    probs = calibrated(spec, logits, 1.0)
    torch.testing.assert_close(probs.sum(1), torch.ones(3))
    assert exits(spec, probs).tolist() == [True, False, False]  # toxic < 0.2 only in row 0
    flag = exits(spec, probs, flag_above=0.8, use_flag_above=True)
    assert flag.tolist() == [True, True, False]
    assert not exits(spec, probs, allow_below=0.0).any()
    # Overconfident logits: the fitted temperature is above 1.
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (400,), generator=g)
    noisy = torch.nn.functional.one_hot(y, 3).float() * 10
    flip = torch.rand(400, generator=g) < 0.3
    noisy[flip] = noisy[flip].roll(1, dims=1)
    temperature, bias = fit_calibration(spec, noisy, y)
    assert temperature > 2.0 and len(bias) == 3
    # Logits that read as balanced on rows 10 % of one class: the bias moves the mean
    # probability to the base rate, which a temperature alone cannot.
    y = (torch.rand(1000, generator=g) < 0.1).long() * 2  # class 2 ("toxic") in 10 %
    balanced = torch.randn(1000, 3, generator=g) * 0.1
    temperature, bias = fit_calibration(spec, balanced, y)
    probs = calibrated(spec, balanced, temperature, bias)
    assert abs(float(probs[:, 2].mean()) - 0.1) < 0.02
    assert abs(float(calibrated(spec, balanced, temperature)[:, 2].mean()) - 0.1) > 0.15


def test_attach_keep_layers_and_add_head() -> None:
    plain = build_probe(make_spec("mean", "scalar_mix"), seed=0)
    exit_probe = build_probe(exit_spec().exit_view(), seed=1)
    probe = attach_exit(plain, exit_probe, ExitSpec(layer=2, allow_below=0.1))
    hidden, mask, _ = toy_task(3, "multiclass")
    torch.testing.assert_close(probe(hidden, mask), plain(hidden, mask))  # same full probe
    assert probe.exit_head is not None
    torch.testing.assert_close(probe.exit_head(hidden[1:2], mask), exit_probe(hidden[1:2], mask))
    assert keep_layers(probe, [1, 2, 4]).spec.exit == probe.spec.exit
    assert keep_layers(probe, [1, 2]).spec.exit is None  # the exit layer became the deepest
    grown = add_head(probe, HeadSpec(name="extra", task="multilabel", labels=["insult"]))
    assert grown.exit_head is not None and grown.spec.exit == probe.spec.exit


def test_a_calibrated_exit_survives_adding_and_removing_a_head() -> None:
    """The exit's bias has one value per label: add_head refused any probe whose exit was
    calibrated ("the exit head's bias has 3 values for 4 labels"). A new label's bias is 0
    and its exit column scores 0.5 (zero rows), so a new flag label exits nothing early
    until it has learned; removing the head gives back the original exit exactly."""
    spec = exit_spec("mean")
    assert spec.exit is not None
    calibrated_exit = spec.exit.model_copy(update={"temperature": 1.5, "bias": [0.1, 0.2, -0.3]})
    probe = build_probe(spec.model_copy(update={"exit": calibrated_exit}), seed=0)
    grown = add_head(probe, HeadSpec(name="extra", task="multilabel", labels=["insult"]), flag=True)
    assert grown.spec.exit is not None and grown.spec.exit.bias == [0.1, 0.2, -0.3, 0.0]
    hidden, mask, _ = toy_task(3, "multiclass")
    states = grown.exit_input(hidden)[0]
    new = exit_probabilities(grown, states, mask)
    torch.testing.assert_close(new[:, :3], exit_probabilities(probe, states, mask))
    torch.testing.assert_close(new[:, 3], torch.full_like(new[:, 3], 0.5))
    assert not exits(grown.spec, new).any()  # insult's 0.5 is above allow_below
    back = remove_head(grown, "extra")
    assert back.spec.exit == probe.spec.exit
    torch.testing.assert_close(
        exit_probabilities(back, states, mask), exit_probabilities(probe, states, mask)
    )
