"""The cascade in BatchScorer: confident messages are decided by the exit head at its
layer (ProbeResult.depth), the others by the full probe, exactly as without a cascade."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import torch

from probes.checkpoint import checkpoint_to_bytes
from probes.exit import exit_probabilities, flag_risk
from probes.probe import build_probe
from schemas import ChatMessage, CheckpointManifest, ExitSpec, ProbeSpec, TokenPool
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.batch import BatchScorer, ExitPolicy
from worker.scoring.served import ProbeSlot, ServedProbe
from worker.settings import Settings

TEXTS = [f"message number {i} " + "x" * (i % 7) for i in range(24)]
EXIT_LAYER = 2


def messages() -> list[ChatMessage]:
    now = datetime(2026, 11, 30, tzinfo=UTC)
    return [
        ChatMessage(message_id=f"m-{i}", conversation_id=f"c-{i}", text=t, created_at=now)
        for i, t in enumerate(TEXTS)
    ]


def served(
    ex: HiddenStateExtractor, seed: int, allow_below: float = 0.0, exit_pool: TokenPool = "mean"
) -> ServedProbe:
    spec = ProbeSpec(
        name="tox",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, EXIT_LAYER, 4],
        hidden_size=ex.hidden_size,
        task="multiclass",
        labels=["ok", "bad"],
        flag_labels=["bad"],
        thresholds={"bad": 0.5},
        exit=ExitSpec(
            layer=EXIT_LAYER, token_pool=exit_pool, temperature=0.5, allow_below=allow_below
        ),
    )
    probe = build_probe(spec, seed=seed).eval()
    _, manifest = checkpoint_to_bytes(probe, llm=ex.fingerprint, version=seed)
    return ServedProbe(probe, CheckpointManifest.decode(manifest))


def exit_risks(ex: HiddenStateExtractor, s: ServedProbe) -> tuple[torch.Tensor, torch.Tensor]:
    """Every message's exit-head probabilities [N, C] and flag risk [N], from a full pass."""
    full = ex.extract(TEXTS, [EXIT_LAYER])
    probs = exit_probabilities(s.probe, full.hidden[0], full.mask)
    return probs, flag_risk(s.probe.spec, probs)


@pytest.fixture(scope="module")
def ex() -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=8)


@pytest.mark.parametrize("exit_pool", ["mean", "mha"])
def test_confident_messages_exit_and_the_others_score_as_without_a_cascade(
    ex: HiddenStateExtractor, exit_pool: TokenPool
) -> None:
    probe = served(ex, seed=1, exit_pool=exit_pool)
    probs, risk = exit_risks(ex, probe)
    low = float(risk.median())  # about half the messages are confident enough
    slot = {"tox": ProbeSlot("tox", probe)}
    plain = BatchScorer(ex, slot).score(messages())
    cascade = BatchScorer(ex, slot, exit_policy=ExitPolicy(allow_below=low)).score(messages())
    early = [pos for pos in range(len(TEXTS)) if risk[pos] < low]
    assert 0 < len(early) < len(TEXTS)
    assert not cascade.errors and sorted(cascade.results) == list(range(len(TEXTS)))
    for pos in range(len(TEXTS)):
        (got,) = cascade.results[pos]
        (full,) = plain.results[pos]
        if pos in early:
            assert got.depth == EXIT_LAYER and got.flagged == bool(probs[pos, 1] >= 0.5)
            assert got.scores["bad"] == pytest.approx(float(probs[pos, 1]), abs=1e-5)
        else:
            assert got.depth is None
            assert got.scores == pytest.approx(full.scores, abs=1e-5)
        assert cascade.decisions[(pos, "tox")].v == probe.version  # evidence for its version
    # Drift reads only the messages that reached the full probe.
    _, rms, _ = cascade.drift[("tox", probe.version)]
    assert rms.shape[1] == len(TEXTS) - len(early)


def test_checkpoint_thresholds_apply_unless_the_policy_overrides_them(
    ex: HiddenStateExtractor,
) -> None:
    _, risk = exit_risks(ex, served(ex, seed=1))
    low = float(risk.median())
    probe = served(ex, seed=1, allow_below=low)
    slot = {"tox": ProbeSlot("tox", probe)}

    def early(policy: ExitPolicy) -> int:
        out = BatchScorer(ex, slot, exit_policy=policy).score(messages())
        return sum(r.depth is not None for rs in out.results.values() for r in rs)

    assert early(ExitPolicy()) == int((risk < low).sum())
    assert early(ExitPolicy(allow_below=0.0)) == 0
    assert early(ExitPolicy(enabled=False)) == 0
    assert early(ExitPolicy(allow_below=0.0, flag_above=float(risk.max()) + 1e-6)) == 0
    assert early(ExitPolicy(allow_below=0.0, flag_above=float(risk.min()))) == len(TEXTS)


def test_a_canary_decides_its_share_with_its_own_exit_head(ex: HiddenStateExtractor) -> None:
    live, canary = served(ex, seed=1), served(ex, seed=2)
    live_probs, live_risk = exit_risks(ex, live)
    canary_probs, canary_risk = exit_risks(ex, canary)
    low = float(torch.cat([live_risk, canary_risk]).median())
    slot = ProbeSlot("tox", live, canary, canary_share=0.5)
    scorer = BatchScorer(ex, {"tox": slot}, exit_policy=ExitPolicy(allow_below=low))
    out = scorer.score(messages())
    routed = [scorer.sends_to_canary(m, slot) for m in messages()]
    assert any(routed) and not all(routed)
    for pos, to_canary in enumerate(routed):
        (got,) = out.results[pos]
        assert got.canary == to_canary
        assert got.version == (canary if to_canary else live).version
        risk, probs = (canary_risk, canary_probs) if to_canary else (live_risk, live_probs)
        assert (got.depth == EXIT_LAYER) == bool(risk[pos] < low)
        if got.depth is not None:
            assert got.scores["bad"] == pytest.approx(float(probs[pos, 1]), abs=1e-5)
    shadow = BatchScorer(ex, {"tox": slot}, shadow=True, exit_policy=ExitPolicy(allow_below=low))
    assert all(r.depth is None for rs in shadow.score(messages()).results.values() for r in rs)


def test_policy_from_settings() -> None:
    assert ExitPolicy.from_settings(Settings()) == ExitPolicy()
    off = Settings(exit="off", exit_allow_below=0.05, exit_flag_above=0.99)
    assert ExitPolicy.from_settings(off) == ExitPolicy(False, 0.05, 0.99)
    with pytest.raises(ValueError, match="exit_allow_below"):
        Settings(exit_allow_below=0.9)
