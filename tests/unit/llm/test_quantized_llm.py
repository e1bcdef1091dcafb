"""The int8-quantized frozen LLM (PROBEGUARD_LLM_QUANTIZE=int8), on the tiny random model:
its fingerprint differs, so probes trained on one kind of states are refused on the other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from probes.checkpoint import checkpoint_to_bytes, probe_from_bytes
from probes.errors import IncompatibleCheckpoint
from probes.probe import build_probe
from schemas import CheckpointManifest, LLMFingerprint, ProbeSpec
from worker.errors import ConfigError
from worker.llm.extract import HiddenStateExtractor
from worker.llm.load import load_llm, quantize_llm
from worker.llm.tiny import make_tiny_llm
from worker.settings import Settings

TEXTS = ["hello there, how are you?", "you are a terrible person", "ok"]


def spec(hidden: int) -> ProbeSpec:
    return ProbeSpec(
        name="toxicity",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=hidden,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )


def test_quantized_llm_has_its_own_fingerprint_and_close_states() -> None:
    plain = make_tiny_llm()
    quant = quantize_llm(make_tiny_llm(), "int8")
    assert plain.fingerprint.quantization is None
    assert quant.fingerprint.quantization == "torch-int8-dynamic"
    assert quant.fingerprint != plain.fingerprint
    assert quant.fingerprint.digest != plain.fingerprint.digest
    # Every other part of the identity is the same model's.
    assert quant.fingerprint.model_copy(update={"quantization": None}) == plain.fingerprint
    assert not any(isinstance(m, torch.nn.Linear) for m in quant.model.modules())
    a = HiddenStateExtractor(plain, max_tokens=32).extract(TEXTS, layers=[1, 2, 4]).hidden
    b = HiddenStateExtractor(quant, max_tokens=32).extract(TEXTS, layers=[1, 2, 4]).hidden
    assert a.shape == b.shape and torch.isfinite(b).all()
    assert not torch.equal(a, b)  # really quantized ...
    cos = torch.nn.functional.cosine_similarity(a.flatten(2), b.flatten(2), dim=-1)
    assert cos.min() > 0.9  # ... and still the same model's states


def test_unquantized_fingerprint_serializes_as_before() -> None:
    fp = make_tiny_llm().fingerprint
    assert b"quantization" not in fp.encode()  # old digests, signatures and caches hold
    quant = fp.model_copy(update={"quantization": "torch-int8-dynamic"})
    assert LLMFingerprint.decode(quant.encode()) == quant
    assert LLMFingerprint.decode(fp.encode()) == fp


@pytest.mark.parametrize("trained_on", ["plain", "int8"])
def test_a_probe_is_refused_on_the_other_kind_of_states(trained_on: str) -> None:
    plain = make_tiny_llm().fingerprint
    quant = quantize_llm(make_tiny_llm(), "int8").fingerprint
    mine, other = (plain, quant) if trained_on == "plain" else (quant, plain)
    blob, manifest = checkpoint_to_bytes(build_probe(spec(32)), llm=mine, version=3)
    assert CheckpointManifest.decode(manifest).llm == mine
    probe_from_bytes(blob, manifest, mine)  # fine on the states it was trained on
    with pytest.raises(IncompatibleCheckpoint, match="trained on another LLM: quantization"):
        probe_from_bytes(blob, manifest, other)


def test_load_llm_quantizes_when_asked(tmp_path: Path) -> None:
    make_tiny_llm(tmp_path)
    directory = tmp_path / "tiny-llama-0"
    plain = load_llm(Settings(model=str(directory), cache_dir=tmp_path / "c"))
    quant = load_llm(Settings(model=str(directory), cache_dir=tmp_path / "c", llm_quantize="int8"))
    assert plain.fingerprint.quantization is None
    assert quant.fingerprint == plain.fingerprint.model_copy(
        update={"quantization": "torch-int8-dynamic"}
    )


def test_quantization_is_refused_where_torch_cannot_run_it() -> None:
    for bad in ({"device": "cuda"}, {"device": "cuda:1"}, {"dtype": "bfloat16"}):
        with pytest.raises(ValidationError, match="CPU in float32 only"):
            Settings(llm_quantize="int8", **bad)  # type: ignore[arg-type]
    llm = make_tiny_llm()
    llm.model.to(torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="CPU in float32 only"):
        quantize_llm(llm, "int8")
    twice = quantize_llm(make_tiny_llm(), "int8")
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_llm(twice, "int8")
