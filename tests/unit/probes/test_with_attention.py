"""A mean-pool probe given an attention pool: the same scores until it learns, then an
attention block that learns too (the updater fine-tuning the packaged default)."""

from __future__ import annotations

import pytest
import torch

from probes import Probe, ProbeError, build_probe, checkpoint_to_bytes, probe_from_bytes
from probes.learner import Learner
from probes.probe import with_attention
from schemas import HeadCalibration
from tests.unit.synthetic import FINGERPRINT, make_spec, random_batch, toy_task, trained


def trained_mean_probe() -> Probe:
    """A two-head mean-pool probe whose every tensor is off its initial value, with a
    calibration and thresholds, as the packaged default has."""
    probe = trained("mean", "scalar_mix")
    probe.set_calibration(
        {"toxicity": HeadCalibration(temperature=0.6, bias=[-0.4], labels_seen=100)}
    )
    probe.set_thresholds({"toxic": 0.8, "spam": 0.3})
    return probe


def test_it_scores_exactly_as_the_mean_pool_did() -> None:
    probe = trained_mean_probe().eval()
    attending = with_attention(probe, d_inner=4, num_heads=1).eval()
    spec = attending.spec
    assert spec.token_pool == "mha" and spec.d_inner == 4 and spec.num_heads == 1
    # Everything the decisions read is carried: heads, calibration, thresholds, flags.
    assert spec.model_dump(exclude={"token_pool", "d_inner", "num_heads"}) == (
        probe.spec.model_dump(exclude={"token_pool", "d_inner", "num_heads"})
    )
    hidden, mask = random_batch(len(probe.layers))
    torch.testing.assert_close(
        attending.predict_proba_many(hidden, mask),
        probe.predict_proba_many(hidden, mask),
        rtol=0,
        atol=1e-6,
    )
    # Through a checkpoint as a scorer loads a published version.
    blob, manifest = checkpoint_to_bytes(attending, llm=FINGERPRINT)
    loaded, _ = probe_from_bytes(blob, manifest, FINGERPRINT)
    torch.testing.assert_close(
        loaded.eval().predict_proba_many(hidden, mask),
        probe.predict_proba_many(hidden, mask),
        rtol=0,
        atol=1e-6,
    )


def test_the_attention_block_learns_not_only_the_heads() -> None:
    attending = with_attention(trained_mean_probe())

    def block() -> tuple[torch.Tensor, torch.Tensor]:
        state = attending.state_dict()
        return state["pool.qkv"].clone(), state["pool.out"].clone()

    qkv, out = block()
    assert not out.any()
    lion = Learner(attending, lr=1e-3)
    hidden, mask, y = toy_task(len(attending.layers), "multihead")
    for _ in range(3):
        lion.learn_many(hidden, mask, y)
    # The output projection moves at the first step, the projections behind it at the next.
    qkv_now, out_now = block()
    assert out_now.abs().min() > 0
    assert not torch.equal(qkv_now, qkv)


def test_the_input_probe_is_left_as_it_was() -> None:
    probe = trained_mean_probe()
    before = {k: v.clone() for k, v in probe.state_dict().items()}
    spec = probe.spec
    with_attention(probe)
    assert probe.spec == spec
    assert all(torch.equal(v, before[k]) for k, v in probe.state_dict().items())


@pytest.mark.parametrize("pool", ["mha", "max", "gate"])
def test_only_a_mean_pool_is_given_attention(pool: str) -> None:
    mix = "gate" if pool == "gate" else "scalar_mix"
    with pytest.raises(ProbeError, match="only a mean pool"):
        with_attention(build_probe(make_spec(pool, mix), seed=0))
