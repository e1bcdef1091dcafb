"""The contract every registered probe kind (token pool × layer mix × task) must honour."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from probes import (
    LAYER_MIXES,
    TOKEN_POOLS,
    ProbeError,
    build_probe,
    checkpoint_to_bytes,
    load_checkpoint,
    probe_from_bytes,
    probe_kinds,
    save_checkpoint,
)
from probes.kinds.pooling import SUMMARIES
from probes.learner import Learner
from schemas import ProbeSpec
from schemas.probe import LayerMix, TokenPool
from tests.unit.synthetic import FINGERPRINT, make_spec, random_batch, task_of, toy_task

KINDS = [(p, m, t) for p, m in probe_kinds() for t in ("multiclass", "multilabel", "multihead")]
IDS = [f"{p}-{m}-{t}" for p, m, t in KINDS]


def test_registry_covers_the_spec_vocabulary() -> None:
    assert set(TOKEN_POOLS) == set(get_args(TokenPool))
    assert set(LAYER_MIXES) == set(get_args(LayerMix))


@pytest.fixture(params=KINDS, ids=IDS)
def spec(request: pytest.FixtureRequest) -> ProbeSpec:
    pool, mix, task = request.param
    return make_spec(pool, mix, task)


def test_output_shape_and_probabilities(spec: ProbeSpec) -> None:
    probe = build_probe(spec, seed=0)
    hidden, mask = random_batch(len(spec.layers))
    logits = probe(hidden, mask)
    assert logits.shape == (6, len(spec.labels))
    probs = probe.predict_proba_many(hidden, mask)
    assert ((probs >= 0) & (probs <= 1)).all()
    if spec.task == "multiclass":
        torch.testing.assert_close(probs.sum(dim=1), torch.ones(6))
    assert probe.layers == tuple(spec.layers)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_never_changes_the_result(spec: ProbeSpec, side: str) -> None:
    probe = build_probe(spec, seed=0).eval()
    hidden, mask = random_batch(len(spec.layers))
    L, B, T, D = hidden.shape
    pad = 5
    garbage = torch.full((L, B, pad, D), float("nan"))
    garbage[..., ::2, :] = 1e4  # huge values and NaN: neither may leak in
    if side == "right":
        padded_h = torch.cat([hidden, garbage], dim=2)
        padded_m = torch.cat([mask, torch.zeros(B, pad, dtype=torch.bool)], dim=1)
    else:
        # Left padding: move each row's real tokens to the end.
        padded_h = torch.cat([garbage, torch.zeros_like(hidden)], dim=2)
        padded_m = torch.zeros(B, T + pad, dtype=torch.bool)
        for b in range(B):
            n = int(mask[b].sum())
            padded_h[:, b, T + pad - n :] = hidden[:, b, :n]
            padded_h[:, b, pad : T + pad - n] = float("nan")
            padded_m[b, T + pad - n :] = True
    with torch.no_grad():
        torch.testing.assert_close(
            probe(padded_h, padded_m), probe(hidden, mask), atol=1e-5, rtol=1e-5
        )


def test_gradients_reach_every_parameter(spec: ProbeSpec) -> None:
    probe = build_probe(spec, seed=0)
    hidden, mask, y = toy_task(len(spec.layers), task_of(spec))
    learner = Learner(probe)
    learner.loss(probe(hidden, mask), y).backward()
    for name, p in probe.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


def test_lion_steps_lower_the_loss(spec: ProbeSpec) -> None:
    probe = build_probe(spec, seed=0)
    hidden, mask, y = toy_task(len(spec.layers), task_of(spec))
    learner = Learner(probe, lr=3e-3)
    with torch.no_grad():
        before = float(learner.loss(probe.eval()(hidden, mask), y))
    for _ in range(40):
        learner.learn_many(hidden, mask, y)
    with torch.no_grad():
        after = float(learner.loss(probe.eval()(hidden, mask), y))
    assert after < 0.75 * before, f"loss {before:.3f} -> {after:.3f}"
    assert learner.steps == 40


def test_save_load_gives_identical_outputs(spec: ProbeSpec, tmp_path) -> None:
    probe = build_probe(spec, seed=0)
    hidden, mask, y = toy_task(len(spec.layers), task_of(spec))
    learner = Learner(probe, lr=1e-3)
    for _ in range(3):
        learner.learn_many(hidden, mask, y)
    probe.set_input_stats(torch.randn(len(spec.layers), 16), torch.rand(len(spec.layers), 16) + 0.5)
    expected = probe.predict_proba_many(hidden, mask)

    blob, manifest = checkpoint_to_bytes(probe, llm=FINGERPRINT, version=3)
    loaded, m = probe_from_bytes(blob, manifest, FINGERPRINT)
    assert m.version == 3 and m.spec == probe.spec
    assert torch.equal(loaded.predict_proba_many(hidden, mask), expected)

    save_checkpoint(probe, tmp_path / "ckpt", llm=FINGERPRINT)
    from_file, _ = load_checkpoint(tmp_path / "ckpt", FINGERPRINT)
    assert torch.equal(from_file.predict_proba_many(hidden, mask), expected)


def test_spec_round_trip(spec: ProbeSpec) -> None:
    probe = build_probe(spec, seed=0)
    assert ProbeSpec.decode(probe.spec.encode()) == spec
    rebuilt = build_probe(probe.spec, seed=1)
    shapes = {k: v.shape for k, v in probe.state_dict().items()}
    assert shapes == {k: v.shape for k, v in rebuilt.state_dict().items()}


def test_deterministic_under_a_seed(spec: ProbeSpec) -> None:
    def run() -> torch.Tensor:
        torch.manual_seed(123)  # dropout and anything else that draws from the global RNG
        probe = build_probe(spec, seed=7)
        hidden, mask, y = toy_task(len(spec.layers), task_of(spec))
        learner = Learner(probe, lr=1e-3)
        for _ in range(3):
            learner.learn_many(hidden, mask, y)
        return probe.predict_proba_many(hidden, mask)

    assert torch.equal(run(), run())
    a = build_probe(spec, seed=7).state_dict()
    b = build_probe(spec, seed=7).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_layer_weights_are_a_distribution(spec: ProbeSpec) -> None:
    probe = build_probe(spec, seed=0)
    hidden, mask = random_batch(len(spec.layers))
    for w in (probe.layer_weights(), probe.layer_weights(hidden, mask)):
        assert w.shape == (len(spec.layers),)
        torch.testing.assert_close(w.sum(), torch.tensor(1.0))
    entropy = probe.layer_entropy(hidden, mask)
    assert 0.0 <= entropy <= math.log(len(spec.layers)) + 1e-6


def test_summaries_score_like_tokens_for_separable_pools(spec: ProbeSpec) -> None:
    probe = build_probe(spec, seed=0).eval()
    L = len(spec.layers)
    probe.set_input_stats(torch.randn(L, 16), torch.rand(L, 16) + 0.5)
    hidden, mask = random_batch(L)
    if not probe.separable:
        with pytest.raises(Exception, match="needs token-level states"):
            probe(hidden.mean(dim=2))
        return
    with torch.no_grad():
        summaries = SUMMARIES[spec.token_pool](hidden, mask)  # what a cache stores
        torch.testing.assert_close(probe(summaries), probe(hidden, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_norm", [False, True])
def test_mha_variants_keep_the_contract(layer_norm: bool) -> None:
    spec = make_spec("mha", "gate", layer_norm=layer_norm, dropout=0.2)
    probe = build_probe(spec, seed=0)
    hidden, mask, y = toy_task(len(spec.layers), task_of(spec))
    Learner(probe).loss(probe.train()(hidden, mask), y).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in probe.parameters())
    probe.eval()
    pad = torch.full((3, hidden.shape[1], 4, 16), float("nan"))
    padded_mask = torch.cat([mask, torch.zeros(mask.shape[0], 4, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(
            probe(torch.cat([hidden, pad], dim=2), padded_mask), probe(hidden, mask)
        )
    probe.pool.gradient_checkpointing = True
    probe.train()
    probe.zero_grad()
    Learner(probe).loss(probe(hidden, mask), y).backward()  # attention recomputed in backward
    assert all(p.grad is not None for p in probe.parameters())


def test_invalid_inputs_are_named() -> None:
    probe = build_probe(make_spec("gate", "scalar_mix"), seed=0)
    hidden, mask = random_batch(3)
    with pytest.raises(ProbeError, match="need a mask"):
        probe(hidden)
    with pytest.raises(ProbeError, match=r"the probe reads 3 layers \[1, 2, 4\] of size 16"):
        probe(hidden[:2], mask)
    empty = mask.clone()
    empty[2] = False
    with pytest.raises(ProbeError, match=r"rows \[2\] of the batch have no real token"):
        probe(hidden, empty)
    with pytest.raises(ProbeError, match="needs token-level states"):
        probe(hidden.mean(dim=2))
    with pytest.raises(ProbeError, match="scale must be positive"):
        probe.set_input_stats(torch.zeros(3, 16), torch.zeros(3, 16))


@pytest.mark.parametrize("layout", ["right", "left", "holes", "empty_row"])
def test_span_pooling_equals_the_masked_reference(layout: str) -> None:
    """Mean/max read only each row's real tokens when they form one run; any mask layout
    gives the masked reference, and NaN in the padding never leaks in."""
    from probes.kinds.pooling import masked_max, masked_mean, real_spans

    g = torch.Generator().manual_seed(3)
    L, B, T, D = 3, 5, 9, 4
    hidden = torch.randn(L, B, T, D, generator=g)
    lengths = torch.tensor([9, 1, 4, 7, 2])
    pos = torch.arange(T)[None, :]
    mask = pos < lengths[:, None]
    if layout == "left":
        mask = mask.flip(1)
    elif layout == "holes":
        mask[0, 3] = False
    elif layout == "empty_row":
        mask[1] = False
    hidden = hidden.masked_fill(~mask[None, :, :, None], float("nan"))
    assert (real_spans(mask) is None) == (layout == "holes")

    keep = mask[None, :, :, None]
    zeroed = hidden.masked_fill(~keep, 0.0)
    mean_ref = zeroed.sum(2) / mask.sum(1).clamp(min=1)[None, :, None]
    max_ref = hidden.masked_fill(~keep, float("-inf")).amax(2)
    torch.testing.assert_close(masked_mean(hidden, mask), mean_ref)
    torch.testing.assert_close(masked_max(hidden, mask), max_ref)

    # The scoring gate takes the same span path; compare with its masked formula.
    from probes.kinds.gate import ScoringGate
    from tests.registry_helpers import toxicity_spec

    gate = ScoringGate(
        toxicity_spec(D, layers=list(range(L))).model_copy(update={"token_pool": "gate"})
    )
    shift, scale = torch.randn(L, D, generator=g), torch.rand(L, D, generator=g) + 0.5
    with torch.no_grad():
        weights = gate.scores(zeroed, mask, shift, scale)  # [L, B, T]
        gate_ref = (torch.einsum("lbt,lbtd->lbd", weights, zeroed) - shift[:, None]) / scale[
            :, None
        ]
        got = gate(hidden, mask, shift, scale)
    real = mask.any(dim=1)  # an empty row has no weights to compare (NaN in the reference)
    torch.testing.assert_close(got[:, real], gate_ref[:, real])
    assert torch.isfinite(got[:, real]).all()
