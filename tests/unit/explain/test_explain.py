"""Explaining a verdict: per-layer decomposition and token weights (every probe kind, no
LLM), the logit lens and the LM-head loading on the tiny random LLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from probes import build_probe, probe_kinds
from probes.explain import layer_breakdown, token_weights
from probes.probe import Probe
from tests.unit.synthetic import make_spec, random_batch
from worker.errors import LensUnavailable
from worker.llm.extract import HiddenStateExtractor
from worker.llm.lens import LogitLens
from worker.llm.load import LoadedLLM, load_llm
from worker.llm.tiny import NUM_LAYERS, make_tiny_llm, tiny_model, tiny_tokenizer
from worker.settings import Settings

KINDS = probe_kinds()
TEXT = "you are an idiot"


def scrambled_probe(pool: str, mix: str, task: str = "multiclass", seed: int = 0) -> Probe:
    """A probe whose every parameter and statistic is random (not the near-uniform init)."""
    probe = build_probe(make_spec(pool, mix, task), seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        L, D = probe.shift.shape
        probe.set_input_stats(torch.randn(L, D, generator=g), torch.rand(L, D, generator=g) + 0.5)
    return probe.eval()


# --- score by layer ------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["multiclass", "multilabel"])
@pytest.mark.parametrize(("pool", "mix"), KINDS)
def test_layers_recombine_into_the_probes_own_forward(pool: str, mix: str, task: str) -> None:
    probe = scrambled_probe(pool, mix, task)
    hidden, mask = random_batch(len(probe.layers))
    parts = layer_breakdown(probe, hidden, mask)
    L, B, C = len(probe.layers), hidden.shape[1], len(probe.labels)
    assert parts.logits.shape == (L, B, C) and parts.weights.shape == (L, B)
    assert parts.layers == probe.layers
    torch.testing.assert_close(parts.weights.sum(0), torch.ones(B))
    logits = probe(hidden, mask)
    torch.testing.assert_close(parts.mixed_logits, logits)
    torch.testing.assert_close(parts.recombined(), logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parts.mixed_probs, probe.predict_proba_many(hidden, mask))
    torch.testing.assert_close(parts.probs, probe.probabilities(parts.logits))


@pytest.mark.parametrize(("pool", "mix"), [k for k in KINDS if k[1] != "single"])
def test_a_layers_score_moves_only_with_that_layers_states(pool: str, mix: str) -> None:
    probe = scrambled_probe(pool, mix)
    hidden, mask = random_batch(len(probe.layers))
    before = layer_breakdown(probe, hidden, mask)
    changed = hidden.clone()
    changed[1] = torch.randn_like(changed[1]) * 3  # the second layer only
    after = layer_breakdown(probe, changed, mask)
    assert not torch.allclose(after.logits[1], before.logits[1], atol=1e-3)
    torch.testing.assert_close(after.logits[[0, 2]], before.logits[[0, 2]])
    assert not torch.allclose(after.mixed_logits, before.mixed_logits, atol=1e-3)


def test_cached_summaries_decompose_like_token_states() -> None:
    probe = scrambled_probe("mean", "scalar_mix")
    hidden, mask = random_batch(len(probe.layers))
    keep = mask[None, :, :, None]
    summaries = (hidden * keep).sum(2) / mask.sum(1)[None, :, None]  # [L, B, D]
    a, b = layer_breakdown(probe, hidden, mask), layer_breakdown(probe, summaries)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.weights, b.weights)


def test_breakdown_leaves_training_mode_alone() -> None:
    probe = scrambled_probe("gate", "gate").train()
    layer_breakdown(probe, *random_batch(len(probe.layers)))
    assert probe.training


# --- token weights -------------------------------------------------------------------------


@pytest.mark.parametrize("pool", sorted({p for p, _ in KINDS}))
def test_token_weights_sum_to_one_over_real_tokens_and_ignore_padding(pool: str) -> None:
    probe = scrambled_probe(pool, "scalar_mix")
    hidden, mask = random_batch(len(probe.layers), batch=5, tokens=8, seed=3)
    mask[1, 5:] = False  # row 1 is padded
    tw = token_weights(probe, hidden, mask)
    L, B, T = hidden.shape[:3]
    assert tw.weights.shape == (L, B, T) and tw.description
    torch.testing.assert_close(tw.weights.sum(-1), torch.ones(L, B))
    assert (tw.weights >= 0).all()
    assert (tw.weights.masked_select(~mask[None].expand(L, -1, -1)) == 0).all()
    # Whatever the padding holds (even NaN), the real tokens' weights do not move ...
    noisy = hidden.clone()
    noisy[:, ~mask] = float("nan")
    torch.testing.assert_close(token_weights(probe, noisy, mask).weights, tw.weights)
    # ... and equal those of the row alone, without padding.
    alone = token_weights(probe, hidden[:, 1:2, :5], mask[1:2, :5]).weights
    torch.testing.assert_close(alone[:, 0], tw.weights[:, 1, :5], atol=1e-5, rtol=1e-5)


def test_gate_token_weights_are_the_gates_own_softmax() -> None:
    probe = scrambled_probe("gate", "scalar_mix")
    hidden, mask = random_batch(len(probe.layers))
    tw = token_weights(probe, hidden, mask)
    assert tw.kind == "gate"
    # Pooling with these weights reproduces the probe's summaries.
    real = hidden.masked_fill(~mask[None, ..., None], 0)
    pooled = torch.einsum("lbt,lbtd->lbd", tw.weights, real)
    expected = (pooled - probe.shift[:, None]) / probe.scale[:, None]
    torch.testing.assert_close(probe.summarize(hidden, mask), expected, atol=1e-5, rtol=1e-5)


def test_mean_max_and_last_token_weights() -> None:
    hidden, mask = random_batch(3, batch=4, tokens=6, seed=5)
    n = mask.sum(1)  # [B]
    mean = token_weights(scrambled_probe("mean", "scalar_mix"), hidden, mask)
    assert mean.kind == "uniform"
    torch.testing.assert_close(mean.weights[0, :, 0], 1.0 / n.float())
    last = token_weights(scrambled_probe("last", "scalar_mix"), hidden, mask)
    assert last.kind == "single" and (last.weights[:, torch.arange(4), n - 1] == 1).all()
    top = token_weights(scrambled_probe("max", "scalar_mix"), hidden, mask)
    assert top.kind == "max_share"
    # A token that holds the maximum in every dimension gets all the weight.
    hidden[:, 0, 2] = 100.0
    wins = token_weights(scrambled_probe("max", "scalar_mix"), hidden, mask).weights
    assert (wins[:, 0, 2] == 1).all()


# --- the LM head and the logit lens ----------------------------------------------------------


@pytest.fixture(scope="module")
def causal() -> tuple[object, LoadedLLM]:
    """A tiny Llama with its own (untied) LM head, and the LoadedLLM built from it."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(vocab_size=len(tokenizer), lm_head="own")
    return model, LoadedLLM.from_model(model, tokenizer, model_id="tiny-causal")


def _own_next_token_logits(model: object, llm: LoadedLLM, text: str) -> torch.Tensor:
    ids = llm.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1]  # type: ignore[operator]


def test_from_model_splits_base_and_head(causal) -> None:
    model, llm = causal
    assert llm.lm_head is model.lm_head and llm.lm_head_missing is None
    assert llm.model is model.model and llm.num_layers == NUM_LAYERS
    base = make_tiny_llm()  # same seed, same base weights, no head
    assert base.lm_head is None and "without its LM head" in (base.lm_head_missing or "")
    again = LoadedLLM.from_model(model.model, llm.tokenizer, model_id="tiny-llama-0")
    assert base.fingerprint == again.fingerprint


@pytest.mark.parametrize("k", [1, 5])
def test_lens_gives_k_decoded_tokens_per_layer(causal, k: int) -> None:
    _, llm = causal
    lens = LogitLens(llm)
    layers = tuple(range(NUM_LAYERS + 1))
    ex = HiddenStateExtractor(llm, max_tokens=64).extract([TEXT], layers)
    rows = lens.top_k(ex.hidden[:, 0, ex.mask[0].sum() - 1], layers, k)
    assert [r.layer for r in rows] == list(layers)
    for r in rows:
        assert len(r.tokens) == len(r.probs) == len(r.token_ids) == k
        assert r.tokens == [llm.tokenizer.decode([i]) for i in r.token_ids]
        assert r.probs == sorted(r.probs, reverse=True) and 0 < sum(r.probs) <= 1 + 1e-6


def test_top_layers_lens_is_the_models_own_next_token_prediction(causal) -> None:
    model, llm = causal
    lens = LogitLens(llm)
    top = NUM_LAYERS
    ex = HiddenStateExtractor(llm, max_tokens=64).extract([TEXT, "hi"], [top])
    state = ex.hidden[0, 0, int(ex.mask[0].sum()) - 1]  # [D], last real token of TEXT
    own = _own_next_token_logits(model, llm, TEXT)
    torch.testing.assert_close(lens.logits(state, top), own, atol=1e-4, rtol=1e-4)
    (row,) = lens.top_k(state[None], (top,), 5)
    assert row.token_ids == own.topk(5).indices.tolist()
    # Lower layers go through the final norm first: not the same map.
    mid = lens.logits(state, top - 1)
    assert not torch.allclose(mid, own, atol=1e-3)


def test_lens_needs_a_head_and_a_final_norm() -> None:
    with pytest.raises(LensUnavailable, match="no LM head: the model was loaded without"):
        LogitLens(make_tiny_llm())
    bert = make_tiny_llm(arch="bert")
    with pytest.raises(LensUnavailable, match="no LM head"):
        LogitLens(bert)


def test_load_llm_keeps_the_head_only_when_asked(tmp_path: Path) -> None:
    with_head = make_tiny_llm(tmp_path, lm_head="own")
    directory = tmp_path / "tiny-llama-0-own"
    plain = load_llm(Settings(model=str(directory), cache_dir=tmp_path / "cache"))
    assert plain.lm_head is None and with_head.lm_head is not None
    # The same identity and the same hidden states: the scoring path is unchanged.
    assert plain.fingerprint == with_head.fingerprint
    assert type(plain.model) is type(with_head.model)
    a = HiddenStateExtractor(plain, max_tokens=64).extract([TEXT], [0, 2, 4])
    b = HiddenStateExtractor(with_head, max_tokens=64).extract([TEXT], [0, 2, 4])
    torch.testing.assert_close(a.hidden, b.hidden)


def test_load_llm_with_a_tied_head(tmp_path: Path) -> None:
    llm = make_tiny_llm(tmp_path, lm_head="tied")
    assert llm.lm_head is not None
    head, embed = llm.lm_head.weight, llm.model.get_input_embeddings().weight
    assert isinstance(head, torch.Tensor) and isinstance(embed, torch.Tensor)
    assert head.data_ptr() == embed.data_ptr()
    LogitLens(llm)


def test_load_llm_without_head_weights_says_why(tmp_path: Path) -> None:
    make_tiny_llm(tmp_path)  # a base model: untied, no lm_head.weight saved
    settings = Settings(model=str(tmp_path / "tiny-llama-0"), cache_dir=tmp_path / "cache")
    llm = load_llm(settings, lm_head=True)
    assert llm.lm_head is None and "have no LM head (lm_head.weight missing" in str(
        llm.lm_head_missing
    )
    assert llm.fingerprint == load_llm(settings).fingerprint
    make_tiny_llm(tmp_path, arch="bert")
    bert = Settings(model=str(tmp_path / "tiny-bert-0"), cache_dir=tmp_path / "cache")
    assert "bert model has no causal LM head" in str(load_llm(bert, lm_head=True).lm_head_missing)


@pytest.mark.parametrize("max_chunks", [1, 3])
def test_token_ids_line_up_with_the_extracted_positions(max_chunks: int) -> None:
    ex = HiddenStateExtractor(make_tiny_llm(), max_tokens=8, max_chunks=max_chunks)
    text = "a fairly long message"
    ids = ex.token_ids(text)
    out = ex.extract([text], [1])
    assert len(ids) == int(out.mask[0].sum())
    assert ids.count(ex.llm.tokenizer.bos_token_id) == min(max_chunks, 3)


# --- the Ecco views: ranks across positions, two tokens compared ------------------------------


def _direct_logits(model: object, llm: LoadedLLM, text: str) -> torch.Tensor:
    """``[L+1, n, V]``: each hidden-state index through final norm + LM head, computed from the
    HF model directly (its top index is already normalized: the model's own logits)."""
    ids = llm.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)  # type: ignore[operator]
        hs = out.hidden_states  # L+1 x [1, n, D]
        inner = [model.lm_head(model.model.norm(h[0])) for h in hs[:-1]]  # type: ignore[attr-defined]
    return torch.stack([*inner, out.logits[0]])


def test_ranks_at_every_layer_and_position_match_a_direct_computation(causal) -> None:
    model, llm = causal
    lens = LogitLens(llm)
    layers = tuple(range(NUM_LAYERS + 1))
    ex = HiddenStateExtractor(llm, max_tokens=64).extract([TEXT], layers)
    n = int(ex.mask[0].sum())
    states = ex.hidden[:, 0, :n]  # [L+1, n, D]
    direct = _direct_logits(model, llm, TEXT)  # [L+1, n, V]
    target = llm.tokenizer.convert_tokens_to_ids("e")
    ranks = lens.ranks(states, layers, torch.full((n,), target))
    assert ranks.shape == (NUM_LAYERS + 1, n) and ranks.dtype == torch.int64
    want = (direct > direct[..., target : target + 1]).sum(-1) + 1
    assert torch.equal(ranks, want)
    # The model's own argmax has rank 1 at the top layer.
    top = direct[-1].argmax(-1)  # [n]
    assert (lens.ranks(states[-1:], layers[-1:], top) == 1).all()
    # Per-position targets: each position's actual next token.
    ids = llm.tokenizer(TEXT)["input_ids"]
    nxt = torch.tensor([*ids[1:], 0])
    got = lens.ranks(states, layers, nxt)
    want = (direct > direct.gather(-1, nxt[None, :, None].expand(len(layers), -1, 1))).sum(-1) + 1
    assert torch.equal(got, want)


def test_two_tokens_compared_match_a_direct_computation(causal) -> None:
    model, llm = causal
    lens = LogitLens(llm)
    layers = tuple(range(NUM_LAYERS + 1))
    ex = HiddenStateExtractor(llm, max_tokens=64).extract([TEXT], layers)
    direct = _direct_logits(model, llm, TEXT)[:, 3]  # [L+1, V] at position 3
    a, b = (llm.tokenizer.convert_tokens_to_ids(c) for c in ("a", "b"))
    pairs = lens.compare(ex.hidden[:, 0, 3], layers, a, b)
    assert [p.layer for p in pairs] == list(layers)
    probs = direct.softmax(-1)
    for p, logits, pr in zip(pairs, direct, probs, strict=True):
        assert p.logits == pytest.approx((float(logits[a]), float(logits[b])), abs=1e-4)
        assert p.difference == pytest.approx(float(logits[a] - logits[b]), abs=1e-4)
        assert p.probs == pytest.approx((float(pr[a]), float(pr[b])), abs=1e-6)
        assert p.ranks == (int((logits > logits[a]).sum()) + 1, int((logits > logits[b]).sum()) + 1)


def test_token_id_takes_one_token_and_says_why_not() -> None:
    from worker.errors import ExplainError
    from worker.explain.breakdown import token_id

    tok = tiny_tokenizer()
    assert token_id(tok, "e") == tok.convert_tokens_to_ids("e")
    assert token_id(tok, "' '") == tok.convert_tokens_to_ids(" ")  # a quoted literal
    with pytest.raises(ExplainError, match=r"'is' is 2 tokens for this model \('i', 's'\)"):
        token_id(tok, "is")
    with pytest.raises(ExplainError, match="not in the model's vocabulary"):
        token_id(tok, "é")
    with pytest.raises(ExplainError, match="is empty"):
        token_id(tok, "''")
