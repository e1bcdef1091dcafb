"""Scoring a batch with several probes from one LLM pass, and isolating rows that fail."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import torch

from probes.checkpoint import checkpoint_to_bytes
from probes.probe import Prepared, build_probe
from schemas import ChatMessage, CheckpointManifest, DecidedRecord, HeadSpec, ProbeSpec
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.batch import BatchScorer
from worker.scoring.served import ProbeSlot, ServedProbe

TEXTS = ["hello there", "XXXX ZZZZ !!!", "see you tomorrow", "QQQQ ####", "fine"]


def messages() -> list[ChatMessage]:
    now = datetime(2026, 11, 30, tzinfo=UTC)
    return [
        ChatMessage(message_id=f"m-{i}", conversation_id="c", text=t, created_at=now)
        for i, t in enumerate(TEXTS)
    ]


def served(
    extractor: HiddenStateExtractor, name: str, layers: list[int], seed: int, pool: str = "mean"
) -> ServedProbe:
    spec = ProbeSpec(
        name=name,
        token_pool=pool,  # type: ignore[arg-type]
        layer_mix="scalar_mix",
        layers=layers,
        hidden_size=extractor.hidden_size,
        task="multiclass",
        labels=["ok", "bad"],
        flag_labels=["bad"],
    )
    probe = build_probe(spec, seed=seed)
    probe.set_thresholds({"bad": 0.5})
    _, manifest = checkpoint_to_bytes(probe, llm=extractor.fingerprint, version=seed)
    return ServedProbe(probe.eval(), CheckpointManifest.decode(manifest))


class Counting(HiddenStateExtractor):
    """Counts the forward passes of the LLM."""

    def __init__(self) -> None:
        super().__init__(make_tiny_llm(), max_tokens=64, batch_size=16)
        self.passes: list[tuple[int, ...]] = []

    def extract(self, texts: Any, layers: Any) -> Any:
        self.passes.append(tuple(layers))
        return super().extract(texts, layers)


def test_two_probes_on_different_layers_share_one_llm_pass() -> None:
    ex = Counting()
    a = served(ex, "toxicity", [1, 2], seed=1)
    b = served(ex, "spam", [2, 4], seed=2)  # non-contiguous in the union [1, 2, 4]
    both = BatchScorer(ex, {"toxicity": ProbeSlot("toxicity", a), "spam": ProbeSlot("spam", b)})
    scores = both.score(messages())
    assert ex.passes == [(1, 2, 4)]  # one pass, the union of the layers
    alone = {
        name: BatchScorer(ex, {name: ProbeSlot(name, p)}).score(messages())
        for name, p in (("toxicity", a), ("spam", b))
    }
    for pos in range(len(TEXTS)):
        got = {r.probe: r for r in scores.results[pos]}
        assert set(got) == {"toxicity", "spam"}
        for name in got:
            (expected,) = alone[name].results[pos]
            assert got[name].version == expected.version
            for label, p in expected.scores.items():
                assert math.isclose(got[name].scores[label], p, abs_tol=1e-5)
            assert got[name].flagged == expected.flagged


def test_a_probe_that_flags_makes_the_decision_flag() -> None:
    ex = Counting()
    a = served(ex, "toxicity", [1, 2], seed=1)
    b = served(ex, "spam", [2, 4], seed=2)
    a.probe.set_thresholds({"bad": 0.0})  # flags everything
    b.probe.set_thresholds({"bad": 1.0})  # flags nothing (p >= 1.0 never holds here)
    scores = BatchScorer(
        ex, {"toxicity": ProbeSlot("toxicity", a), "spam": ProbeSlot("spam", b)}
    ).score(messages())
    for results in scores.results.values():
        flags = {r.probe: r.flagged for r in results}
        assert flags == {"toxicity": True, "spam": False}


def test_a_nan_row_costs_that_row_only() -> None:
    ex = Counting()
    a = served(ex, "toxicity", [1, 2], seed=1)
    original = a.probe.predict_proba_pooled

    def nan_in_row_1(
        hidden: torch.Tensor | Prepared, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, pooled = original(hidden, mask)
        probs = probs.clone()
        probs[1] = float("nan")  # e.g. a half-precision overflow for this one text
        return probs, pooled

    a.probe.predict_proba_pooled = nan_in_row_1  # type: ignore[method-assign]
    scores = BatchScorer(ex, {"toxicity": ProbeSlot("toxicity", a)}).score(messages())
    assert set(scores.errors) == {1} and "NaN" in scores.errors[1]
    assert sorted(scores.results) == [0, 2, 3, 4]
    assert (1, "toxicity") not in scores.decisions


def test_the_forward_pass_stops_at_the_deepest_layer_a_served_probe_reads() -> None:
    """A shallower probe (e.g. from `fit --depth auto`) is a cheaper forward: blocks above
    the deepest layer that the live or canary probe reads never run."""
    from tests.unit.llm.test_extract import count_block_calls

    ex = Counting()
    shallow = served(ex, "toxicity", [1, 2], seed=1)
    slot = ProbeSlot("toxicity", shallow)
    with count_block_calls(ex.llm) as calls:
        BatchScorer(ex, {"toxicity": slot}).score(messages())
    assert [c > 0 for c in calls] == [True, True, False, False]  # blocks 1-2 of 4
    slot.canary, slot.canary_share = served(ex, "toxicity", [1, 3], seed=2), 0.5
    with count_block_calls(ex.llm) as calls:
        BatchScorer(ex, {"toxicity": slot}).score(messages())
    assert [c > 0 for c in calls] == [True, True, True, False]  # the canary reads layer 3


@pytest.mark.parametrize("pool", ["mean", "mha"])
def test_probes_pay_for_real_tokens_not_the_polls_longest_message(
    pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll's states are padded to its longest message; the probe runs on length-sorted
    groups trimmed to their own width (at most PROBE_BATCH_TOKENS padded tokens per call),
    with the same scores as one call over the padded poll."""
    import worker.scoring.probe_run as probe_run_module

    ex = HiddenStateExtractor(make_tiny_llm(), max_tokens=64)
    probe = served(ex, "toxicity", [1, 2], seed=3, pool=pool)
    now = datetime(2026, 11, 30, tzinfo=UTC)
    texts = ["x" * 60] + [f"hi {i}" for i in range(20)] + ["medium length text here"] * 3
    msgs = [
        ChatMessage(message_id=f"m-{i}", conversation_id="c", text=t, created_at=now)
        for i, t in enumerate(texts)
    ]
    whole = BatchScorer(ex, {"toxicity": ProbeSlot("toxicity", probe)}).score(msgs)
    calls: list[tuple[int, int]] = []
    original = probe.probe.predict_proba_pooled

    def recording(
        hidden: torch.Tensor | Prepared, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert mask is not None
        calls.append(tuple(mask.shape))  # type: ignore[arg-type]
        return original(hidden, mask)

    probe.probe.predict_proba_pooled = recording  # type: ignore[method-assign]
    monkeypatch.setattr(probe_run_module, "PROBE_BATCH_TOKENS", 128)
    grouped = BatchScorer(ex, {"toxicity": ProbeSlot("toxicity", probe)}).score(msgs)
    widest = 61  # "<s>" + 60 characters
    assert len(calls) > 1 and all(b * t <= 128 or b == 1 for b, t in calls)
    padded = sum(b * t for b, t in calls)
    assert padded < 0.5 * len(texts) * widest  # one call would have run 24 x 61
    assert sorted(grouped.results) == list(range(len(texts)))
    for pos, results in whole.results.items():
        (a,), (b,) = results, grouped.results[pos]
        assert a.flagged == b.flagged
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


def multi_head(
    extractor: HiddenStateExtractor, version: int, thresholds: dict[str, float]
) -> ServedProbe:
    """Heads toxicity (``toxic``), spam (``spam``) and topic (``a``/``b``, never flags)."""
    spec = ProbeSpec(
        name="moderation",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=extractor.hidden_size,
        task="multilabel",
        labels=["toxic", "spam", "a", "b"],
        heads=[
            HeadSpec(name="toxicity", task="multilabel", labels=["toxic"]),
            HeadSpec(name="spam", task="multilabel", labels=["spam"]),
            HeadSpec(name="topic", task="multiclass", labels=["a", "b"]),
        ],
        flag_labels=["toxic", "spam"],
        thresholds=thresholds,
    )
    probe = build_probe(spec, seed=version)
    _, manifest = checkpoint_to_bytes(probe, llm=extractor.fingerprint, version=version)
    return ServedProbe(probe.eval(), CheckpointManifest.decode(manifest))


def test_multi_head_decisions_name_the_heads_that_flagged_whatever_the_flag_policy() -> None:
    ex = Counting()
    live = multi_head(ex, 1, {"toxic": 0.0, "spam": 1.0})  # toxicity flags all, spam none
    canary = multi_head(ex, 2, {"toxic": 1.0, "spam": 0.0})  # the other way round
    slot = ProbeSlot("moderation", live, canary, canary_share=0.5)
    # The deployment lets only spam flag: live's verdicts allow, its toxicity head still counts.
    scores = BatchScorer(ex, {"moderation": slot}, shadow=True, flag_heads=frozenset({"spam"}))
    got = scores.score(messages())
    assert got.heads == {
        ("moderation", 1): ("toxicity", "spam"),
        ("moderation", 2): ("toxicity", "spam"),
    }
    for pos in range(len(TEXTS)):
        d = got.decisions[(pos, "moderation")]
        assert (d.v, d.f, d.h, d.sv, d.sf, d.sh) == (1, False, ["toxicity"], 2, True, ["spam"])
        (result,) = got.results[pos]
        assert result.heads is not None and not result.heads["toxicity"].flagged
    # A single-head probe's decision and stored record read as before heads existed.
    single = BatchScorer(ex, {"toxicity": ProbeSlot("toxicity", served(ex, "toxicity", [1], 3))})
    plain = single.score(messages())
    assert plain.heads == {} and plain.decisions[(0, "toxicity")].h is None
    record = DecidedRecord(p={"toxicity": plain.decisions[(0, "toxicity")]}).encode()
    assert b'"h"' not in record and b'"sh"' not in record


def test_the_timings_split_the_probe_from_building_the_results() -> None:
    ex = Counting()
    a = served(ex, "toxicity", [1, 2], seed=1)
    scores = BatchScorer(ex, {"toxicity": ProbeSlot("toxicity", a)}).score(messages())
    assert scores.extract_s > 0 and scores.probe_s > 0
    # bench/score_engine.py reports the probe (probe_s - build_s) and build_s apart.
    assert 0 < scores.build_s < scores.probe_s


def test_the_cpu_the_llm_takes_is_counted_apart_from_the_rest() -> None:
    # Issue 44: bench/scale.py's CPU per message mixed the stand-in LLM's passes with the
    # host path it sizes; the process's CPU while the LLM runs is now counted apart.
    class Burning(Counting):
        def extract(self, texts: Any, layers: Any) -> Any:
            end = time.process_time() + 0.05
            while time.process_time() < end:  # an LLM pass that costs 50 ms of CPU
                pass
            return super().extract(texts, layers)

    ex = Burning()
    a = served(ex, "toxicity", [1, 2], seed=1)
    scores = BatchScorer(ex, {"toxicity": ProbeSlot("toxicity", a)}).score(messages())
    assert scores.extract_cpu_s >= 0.05


def test_off_the_cpu_the_probe_reads_a_calls_rows_in_one_call() -> None:
    from worker.scoring.probe_run import PROBE_BATCH_TOKENS, probe_batch_tokens

    assert probe_batch_tokens(torch.device("cpu")) == PROBE_BATCH_TOKENS  # groups by length
    assert probe_batch_tokens(torch.device("cuda", 0)) >= 256 * 256  # a call of 256 x 256


def test_each_rows_head_results_are_its_own_when_rows_differ() -> None:
    from probes.decision import decide
    from schemas import DEFAULT_LIMITS, HeadResult
    from worker.scoring.probe_run import _head_results, _judged_heads

    spec = multi_head(Counting(), 1, {"toxic": 0.5, "spam": 0.5}).probe.spec
    probs = torch.tensor(  # columns toxic, spam, a, b
        [[0.9, 0.1, 0.7, 0.3], [0.1, 0.9, 0.2, 0.8], [0.9, 0.9, 0.6, 0.4], [0.1, 0.1, 0.3, 0.7]]
    )
    rows = _head_results(spec, decide(spec, probs), DEFAULT_LIMITS)

    def head(predicted: list[str], flagged: bool) -> HeadResult:
        return HeadResult(predicted=predicted, flagged=flagged)

    assert rows == [
        {"toxicity": head(["toxic"], True), "spam": head([], False), "topic": head(["a"], False)},
        {"toxicity": head([], False), "spam": head(["spam"], True), "topic": head(["b"], False)},
        {
            "toxicity": head(["toxic"], True),
            "spam": head(["spam"], True),
            "topic": head(["a"], False),
        },
        {"toxicity": head([], False), "spam": head([], False), "topic": head(["b"], False)},
    ]
    judged, flagged = _judged_heads(spec, decide(spec, probs))
    assert judged == ("toxicity", "spam")
    assert flagged == [["toxicity"], ["spam"], ["toxicity", "spam"], []]
