"""int8 checkpoints: they round-trip, score like fp32, shrink, and are verified like fp32."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from probes import CheckpointError, IncompatibleCheckpoint, build_probe, probe_from_bytes
from probes.checkpoint import checkpoint_to_bytes, weight_format
from probes.kinds import probe_kinds
from probes.probe import Probe
from probes.quantize import dequantize_state, quantize_state
from schemas import CheckpointManifest
from tests.unit.synthetic import FINGERPRINT, D, make_spec, random_batch


def _trained_like(pool: str, mix: str) -> Probe:
    """A probe with non-trivial weights and normalization statistics (one outlier dim)."""
    probe = build_probe(make_spec(pool, mix), seed=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in probe.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    L = len(probe.layers)
    shift = torch.randn(L, D, generator=g)
    shift[:, 0] = 400.0  # a "massive activation" dimension
    scale = torch.rand(L, D, generator=g) * 3 + 0.05
    scale[:, 0] = 60.0
    probe.set_input_stats(shift, scale)
    return probe


@pytest.mark.parametrize(("pool", "mix"), probe_kinds())
def test_int8_round_trip_scores_like_fp32(pool: str, mix: str) -> None:
    probe = _trained_like(pool, mix)
    blob32, _ = checkpoint_to_bytes(probe, llm=FINGERPRINT)
    blob8, manifest8 = checkpoint_to_bytes(probe, llm=FINGERPRINT, weights="int8")
    assert (weight_format(blob32), weight_format(blob8)) == ("fp32", "int8")
    loaded, m = probe_from_bytes(blob8, manifest8, FINGERPRINT)
    assert m.spec == probe.spec
    assert all(v.dtype == torch.float32 for v in loaded.state_dict().values())
    hidden, mask = random_batch(len(probe.layers), seed=5)
    hidden = hidden * probe.scale[:, None, None] + probe.shift[:, None, None]  # in-distribution
    want = probe.predict_proba_many(hidden, mask)
    got = loaded.predict_proba_many(hidden, mask)
    assert (got - want).abs().max() < 0.1  # random, sharp probes; real F1 in bench/int8_probes.py


def test_normalization_error_is_small_in_every_dimension_despite_an_outlier() -> None:
    L = 3
    g = torch.Generator().manual_seed(0)
    # Like mean-pooled SmolLM2 states: means within a few stds of zero, stds over decades,
    # and one huge-activation dimension (far from zero in stds and in absolute value).
    scale = torch.rand(L, 64, generator=g) * 2 + 0.02
    shift = scale * 1.5 * torch.randn(L, 64, generator=g)
    shift[:, 7] = 1000.0
    scale[:, 7] = 100.0
    tensors, enc = quantize_state({"shift": shift, "scale": scale})
    assert enc == {"shift": "int8-over-scale", "scale": "int8-log"}
    # The steps stay small despite the outlier: the shift's in stds (a plain int8 row would
    # step by 1000 / 127 = 7.9, up to hundreds of the small dimensions' stds), the scale's
    # relative.
    step_shift = tensors["shift.qscale"][:, None]
    step_scale = tensors["scale.qscale"][:, None]
    assert float(step_shift.max()) < 0.06 and float(step_scale.max()) < 0.04
    back = dequantize_state(tensors, enc)
    # The normalized input z = (h - shift) / scale moves by at most half the shift's step
    # (in stds) plus the scale's relative rounding times |z|, in every dimension.
    z = torch.randn(L, 64, generator=g)
    h = shift + scale * z
    err = ((h - back["shift"]) / back["scale"] - z).abs()
    bound = step_shift / 2 + (torch.exp(step_scale / 2) - 1) * z.abs() * 1.001 + 1e-5
    assert bool((err <= bound).all()), float((err - bound).max())


def test_int8_of_a_real_sized_probe_is_under_30_percent_of_the_bytes() -> None:
    from schemas import LLMFingerprint, ProbeSpec

    spec = ProbeSpec(
        name="tox", token_pool="mean", layer_mix="scalar_mix", layers=list(range(31)),
        hidden_size=576, task="multiclass", labels=["ok", "toxic"], flag_labels=["toxic"],
    )  # fmt: skip
    llm = LLMFingerprint(
        model_id="x", source_sha256="a" * 64, num_layers=30, hidden_size=576,
        tokenizer_sha256="b" * 64,
    )  # fmt: skip
    probe = build_probe(spec, seed=0)
    blob32, _ = checkpoint_to_bytes(probe, llm=llm)
    blob8, _ = checkpoint_to_bytes(probe, llm=llm, weights="int8")
    assert len(blob8) <= 0.3 * len(blob32)


@pytest.fixture
def int8_blobs() -> tuple[bytes, bytes]:
    return checkpoint_to_bytes(_trained_like("gate", "scalar_mix"), llm=FINGERPRINT, weights="int8")


def _rehash(manifest: bytes, blob: bytes) -> bytes:
    m = CheckpointManifest.decode(manifest)
    return m.model_copy(update={"tensors_sha256": hashlib.sha256(blob).hexdigest()}).encode()


def _reblob(blob: bytes, tensors: dict[str, torch.Tensor], **meta: str) -> bytes:
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    return st_save(tensors, metadata={**header["__metadata__"], **meta})


def test_corrupt_int8_blob_is_refused(int8_blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = int8_blobs
    bad = bytearray(blob)
    bad[-5] ^= 0x01
    with pytest.raises(CheckpointError, match="sha256"):
        probe_from_bytes(bytes(bad), manifest, FINGERPRINT)


def test_int8_from_another_llm_is_refused(int8_blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = int8_blobs
    other = FINGERPRINT.model_copy(update={"source_sha256": "c" * 64})
    with pytest.raises(IncompatibleCheckpoint, match="source_sha256"):
        probe_from_bytes(blob, manifest, other)


def test_int8_signed_like_fp32() -> None:
    probe = _trained_like("mean", "gate")
    blob, manifest = checkpoint_to_bytes(probe, llm=FINGERPRINT, weights="int8", signing_key=b"k")
    probe_from_bytes(blob, manifest, FINGERPRINT, signing_key=b"k")
    with pytest.raises(CheckpointError, match="signature"):
        probe_from_bytes(blob, manifest, FINGERPRINT, signing_key=b"other")


def test_int8_that_does_not_fit_its_spec_is_refused(int8_blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = int8_blobs
    m = CheckpointManifest.decode(manifest)
    wider = m.model_copy(update={"spec": m.spec.model_copy(update={"layers": [1, 2]})})
    with pytest.raises(IncompatibleCheckpoint, match="shape"):
        probe_from_bytes(blob, wider.encode(), FINGERPRINT)


def test_int8_with_broken_pieces_is_refused(int8_blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = int8_blobs
    tensors = st_load(blob)
    cases = {
        "lacks": {k: v for k, v in tensors.items() if k != "head.weight"},
        "qscale": {k: v for k, v in tensors.items() if k != "head.weight.qscale"},
        "no encoding names": {**tensors, "extra": torch.zeros(2)},
        "finite and positive": {**tensors, "head.weight.qscale": -tensors["head.weight.qscale"]},
    }
    for message, broken in cases.items():
        b = _reblob(blob, broken)
        with pytest.raises(CheckpointError, match=message):
            probe_from_bytes(b, _rehash(manifest, b), FINGERPRINT)
    for encoding in ("not json", json.dumps({"head.weight": "int4"})):
        b = _reblob(blob, tensors, encoding=encoding)
        with pytest.raises(CheckpointError, match="encoding"):
            probe_from_bytes(b, _rehash(manifest, b), FINGERPRINT)


def test_int8_tensors_under_the_fp32_tag_are_refused(int8_blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = int8_blobs
    probe = build_probe(CheckpointManifest.decode(manifest).spec, seed=0)
    tensors = {k: v.contiguous() for k, v in probe.state_dict().items()}
    tensors["head.weight"] = st_load(blob)["head.weight"]  # int8
    b = st_save(tensors, metadata={"format": "probeguard-probe/1"})
    with pytest.raises(CheckpointError, match="not float32"):
        probe_from_bytes(b, _rehash(manifest, b), FINGERPRINT)


def test_unknown_weight_format_is_refused() -> None:
    probe = build_probe(make_spec("mean", "single"), seed=0)
    with pytest.raises(CheckpointError, match="int4"):
        checkpoint_to_bytes(probe, llm=FINGERPRINT, weights="int4")  # type: ignore[arg-type]
