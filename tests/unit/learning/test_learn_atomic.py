"""A batch that fails part-way (out of memory, a non-finite loss) leaves the learner as
it was: the batch loop retries it, then bisects it, and each pass used to test and train
on the same labels again (review L10: the prequential window counted them twice, the
first mini-batches' Lion steps and replay additions stayed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from probes import ProbeError, build_probe
from tests.unit.synthetic import NUM_LAYERS, make_spec, toy_task
from worker.learning.config import LearningConfig
from worker.learning.online_learner import OnlineLearner


def state(learner: OnlineLearner) -> dict[str, Any]:
    """Everything one batch may change, as plain values."""
    opt = learner.lion.optimizer.state_dict()["state"]
    return {
        "weights": {k: v.clone() for k, v in learner.probe.state_dict().items()},
        "momentum": {k: {n: t.clone() for n, t in s.items()} for k, s in opt.items()},
        "ema": {k: v.clone() for k, v in (learner.ema or {}).items()},
        "steps": (learner.lion.steps, learner.lion.examples),
        "seen": (learner.prequential.seen, len(learner.prequential.probs)),
        "replay": len(learner.replay),
        "warmup": None if learner.warmup is None else len(learner.warmup),
        "counters": learner.counters,
        "buckets": dict(learner.bucket_seen),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize(("fresh", "primed"), [(False, 16), (True, 8)])
def test_a_batch_that_fails_part_way_changes_nothing_and_its_retry_counts_once(
    monkeypatch: pytest.MonkeyPatch, fresh: bool, primed: int
) -> None:
    probe = build_probe(make_spec("mean", "scalar_mix"), seed=0)
    cfg = LearningConfig(batch_size=8, stats_warmup=16, ema_decay=0.9)
    learner = OnlineLearner(probe, cfg, fresh=fresh)
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=primed + 16, seed=3)
    hidden = hidden[torch.tensor(probe.layers) - 1]  # [L_sel, B, T, D]
    first, rest = slice(0, primed), slice(primed, primed + 16)
    learner.learn(hidden[:, first], mask[first], y[first], y[first].tolist())
    assert learner.warming_up == (fresh and primed < 16)
    before = state(learner)

    real, calls = learner.lion.learn_chunks, []

    def third_step_fails(chunks: Any) -> float:
        calls.append(1)
        if len(calls) == 3:  # after the first mini-batch's two steps
            raise ProbeError("loss is nan; refusing to step (check the inputs)")
        return real(chunks)

    monkeypatch.setattr(learner.lion, "learn_chunks", third_step_fails)
    with pytest.raises(ProbeError):
        learner.learn(hidden[:, rest], mask[rest], y[rest], y[rest].tolist())
    assert same(state(learner), before)

    monkeypatch.setattr(learner.lion, "learn_chunks", real)
    learner.learn(hidden[:, rest], mask[rest], y[rest], y[rest].tolist())  # the retry
    assert learner.prequential.seen == primed + 16
    assert learner.counters.labels_seen == primed + 16
    assert len(learner.replay) == primed + 16  # each example kept once
