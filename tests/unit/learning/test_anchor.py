"""Heads no label has reached keep their scores while another head learns."""

from __future__ import annotations

import math

import pytest
import torch

from probes import Probe, build_probe
from probes.learner import Learner
from tests.unit.synthetic import NUM_LAYERS, make_spec, toy_task
from worker.learning.anchor import Anchor
from worker.learning.config import LearningConfig
from worker.learning.online_learner import OnlineLearner

NAN = math.nan


def two_heads(pool: str = "mean") -> Probe:
    """``toxicity`` (binary: ``toxic``) and ``topic`` (multiclass: ``ok`` / ``spam``)."""
    return build_probe(make_spec(pool, "scalar_mix", "multihead"), seed=0)


def states(probe: Probe, n: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, mask, _ = toy_task(NUM_LAYERS, "multihead", n=n, seed=seed)
    return hidden[torch.tensor(probe.layers) - 1], mask


def test_fill_gives_each_head_no_label_reached_the_frozen_probes_own_probabilities() -> None:
    probe = two_heads()
    anchor = Anchor(probe)
    hidden, mask = states(probe)
    # toxicity labeled on every row, topic on none: topic's cells get the probe's softmax.
    targets = torch.tensor([[1.0, NAN, NAN], [0.0, NAN, NAN]] * 3)
    filled, held = anchor.fill(hidden, mask, targets)
    logits = probe.eval().predict_logits_many(hidden, mask)
    assert torch.equal(filled[:, 0], targets[:, 0])  # the labels as they are
    torch.testing.assert_close(filled[:, 1:], logits[:, 1:].softmax(dim=1))
    assert held == [1, 2]  # topic's columns: its own rows must not move
    # A label reaching topic in this batch releases it: nothing filled, even where unknown.
    targets[0, 1:] = torch.tensor([0.0, 1.0])
    assert anchor.fill(hidden, mask, targets) == (targets, [])


def test_a_binary_head_gets_the_sigmoid_and_a_head_once_reached_stays_released() -> None:
    probe = two_heads()
    anchor = Anchor(probe)
    hidden, mask = states(probe)
    topic_only = torch.tensor([[NAN, 1.0, 0.0]] * 6)
    filled, held = anchor.fill(hidden, mask, topic_only)
    assert held == [0]
    logits = probe.eval().predict_logits_many(hidden, mask)
    torch.testing.assert_close(filled[:, 0], logits[:, 0].sigmoid())
    anchor.labeled = anchor.reached(torch.tensor([[1.0, NAN, NAN]]))  # toxicity reached once
    assert anchor.labeled == {"toxicity"}
    assert anchor.fill(hidden, mask, topic_only)[0][:, 0].isnan().all()


def test_the_head_without_labels_keeps_its_scores_while_the_other_learns() -> None:
    """Labels for toxicity alone: with the anchor, topic's probabilities on fresh text
    stay near where they began; without it the shared layer mix carries them off."""
    hidden, mask, y = toy_task(NUM_LAYERS, "multihead", n=96, seed=2)
    hidden = hidden[torch.tensor([1, 2, 4]) - 1]
    y[:, 1:] = NAN  # only toxicity is labeled
    test_hidden, test_mask = states(two_heads(), n=32, seed=7)

    def drift(anchor: bool) -> float:
        start = two_heads()
        before = start.eval().predict_proba_many(test_hidden, test_mask)[:, 1:]
        topic_rows = start.head.weight[1:].detach().clone()
        config = LearningConfig(batch_size=16, lr=3e-3, anchor_unlabeled=anchor)
        learner = OnlineLearner(start, config)
        assert (learner.anchor is not None) == anchor
        for _ in range(3):
            for i in range(0, 96, 16):
                rows = slice(i, i + 16)
                learner.learn(hidden[:, rows], mask[rows], y[rows], [0] * 16)
        if anchor:  # held: no step moved topic's own weights
            assert torch.equal(learner.probe.head.weight[1:], topic_rows)
        after = learner.probe.eval().predict_proba_many(test_hidden, test_mask)[:, 1:]
        return float((after - before).abs().mean())

    held, free = drift(True), drift(False)
    assert held < free / 3, (held, free)


def test_soft_class_targets_give_the_loss_of_the_class_index_when_one_hot() -> None:
    probe = two_heads()
    lion = Learner(probe)
    logits = torch.randn(4, 3)
    hard = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [NAN, 1.0, 0.0], [1.0, NAN, NAN]])
    ce = torch.nn.functional.cross_entropy(logits[:3, 1:], torch.tensor([0, 1, 0]), reduction="sum")
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        logits[[0, 1, 3], 0], hard[[0, 1, 3], 0], reduction="sum"
    )
    torch.testing.assert_close(lion.loss(logits, hard), (ce + bce) / 6)


def test_a_held_head_that_agrees_with_its_opinion_adds_no_loss() -> None:
    """The loss the updater reports (``probeguard_updater_loss``) reads the held heads'
    terms as a divergence: zero where a head scores what it did, not their entropy."""
    probe = two_heads()
    anchor = Anchor(probe)
    hidden, mask = states(probe)
    nothing = torch.full((6, 3), NAN)  # no label: every head held at its own opinion
    filled, _ = anchor.fill(hidden, mask, nothing)
    logits = probe.eval().predict_logits_many(hidden, mask)
    lion = Learner(probe)
    assert float(lion.loss(logits, filled)) == pytest.approx(0.0, abs=1e-6)
    assert float(lion.loss(logits + 1.0, filled)) > 0.01  # and grows as it moves away


@pytest.mark.parametrize("case", ["fresh", "single head", "frozen shared part", "off"])
def test_no_anchor_where_there_is_nothing_to_hold(case: str) -> None:
    if case == "single head":
        probe = build_probe(make_spec("mean", "scalar_mix"), seed=0)
    else:
        probe = two_heads()
    config = LearningConfig(
        anchor_unlabeled=case != "off", freeze_shared=case == "frozen shared part"
    )
    assert OnlineLearner(probe, config, fresh=case == "fresh").anchor is None


def test_a_head_reached_forgets_its_held_opinions_in_replay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Replayed, the opinions held for a head would go on teaching it after its first
    label: they become unknown again, the labels stay."""
    probe = two_heads()
    learner = OnlineLearner(probe, LearningConfig(batch_size=8, replay_size=64))
    hidden, mask = states(probe, n=8)
    toxicity_only = torch.tensor([[1.0, NAN, NAN], [0.0, NAN, NAN]] * 4)
    learner.learn(hidden, mask, toxicity_only, [0, 3] * 4)
    stored = [e for bucket in learner.replay.buckets for e in bucket]
    assert len(stored) == 8
    assert all(not e.target.isnan().any() for e in stored)  # topic held: its opinion stored
    assert all(
        e.anchored is not None and e.anchored.tolist() == [False, True, True] for e in stored
    )
    topic = torch.tensor([[NAN, 1.0, 0.0]] * 8)
    with caplog.at_level("INFO", logger="worker.learning.anchor"):
        learner.learn(hidden, mask, topic, [1] * 8)
    assert "heads ['topic'] reached by a label" in caplog.text
    assert learner.anchor is not None and learner.anchor.labeled == {"toxicity", "topic"}
    replayed = [e for bucket in learner.replay.buckets for e in bucket]
    old = [e for e in replayed if not e.target[0].isnan()]
    assert len(old) == 8
    for e in old:  # the toxicity labels kept, topic's opinions gone
        assert e.target[1:].isnan().all() and e.anchored is not None and not e.anchored.any()


def test_a_batch_that_fails_leaves_its_heads_unreached(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch loop retries a failed batch: the heads it reached must not count as
    reached (their opinions would be dropped from replay for a label never learned)."""
    probe = two_heads()
    learner = OnlineLearner(probe, LearningConfig(batch_size=8))
    hidden, mask = states(probe, n=8)
    learner.learn(hidden, mask, torch.tensor([[1.0, NAN, NAN]] * 8), [0] * 8)
    assert learner.anchor is not None and learner.anchor.labeled == {"toxicity"}

    def out_of_memory(*_: object) -> float:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(learner.lion, "learn_chunks", out_of_memory)
    with pytest.raises(RuntimeError):
        learner.learn(hidden, mask, torch.tensor([[NAN, 1.0, 0.0]] * 8), [1] * 8)
    assert learner.anchor.labeled == {"toxicity"}
    stored = [e for bucket in learner.replay.buckets for e in bucket]
    assert all(e.anchored is not None and e.anchored[1:].all() for e in stored)
