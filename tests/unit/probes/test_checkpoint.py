"""Checkpoint format: tampering, foreign LLMs and broken blobs are refused with clear errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from probes import (
    CheckpointError,
    IncompatibleCheckpoint,
    build_probe,
    checkpoint_to_bytes,
    load_checkpoint,
    probe_from_bytes,
    save_checkpoint,
)
from probes.checkpoint import MANIFEST_FILE, TENSORS_FILE
from schemas import CheckpointManifest, TrainingCounters
from tests.unit.synthetic import FINGERPRINT, make_spec


@pytest.fixture
def blobs() -> tuple[bytes, bytes]:
    probe = build_probe(make_spec("gate", "scalar_mix"), seed=0)
    return checkpoint_to_bytes(
        probe,
        llm=FINGERPRINT,
        version=2,
        parent=1,
        counters=TrainingCounters(labels_seen=10, steps=3),
        metrics={"val_f1": 0.5},
    )


def test_manifest_describes_the_checkpoint(blobs: tuple[bytes, bytes]) -> None:
    _, manifest = blobs
    m = CheckpointManifest.decode(manifest)
    assert (m.version, m.parent, m.counters.steps, m.metrics) == (2, 1, 3, {"val_f1": 0.5})
    assert m.llm == FINGERPRINT and m.spec.token_pool == "gate"


def test_flipped_tensor_byte_is_refused(blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = blobs
    bad = bytearray(blob)
    bad[-3] ^= 0x01
    with pytest.raises(CheckpointError, match=r"sha256 .* does not match"):
        probe_from_bytes(bytes(bad), manifest, FINGERPRINT)


def test_manifest_with_another_hash_is_refused(blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = blobs
    data = json.loads(manifest)
    data["tensors_sha256"] = "0" * 64
    with pytest.raises(CheckpointError, match="tampered"):
        probe_from_bytes(blob, json.dumps(data), FINGERPRINT)


def test_foreign_llm_is_refused_naming_the_field(blobs: tuple[bytes, bytes]) -> None:
    blob, manifest = blobs
    other = FINGERPRINT.model_copy(update={"tokenizer_sha256": "c" * 64})
    with pytest.raises(IncompatibleCheckpoint, match="tokenizer_sha256"):
        probe_from_bytes(blob, manifest, other)


def test_invalid_manifest_is_refused(blobs: tuple[bytes, bytes]) -> None:
    blob, _ = blobs
    with pytest.raises(CheckpointError, match="invalid checkpoint manifest"):
        probe_from_bytes(blob, b'{"probe": "x"}', FINGERPRINT)
    with pytest.raises(CheckpointError, match="invalid checkpoint manifest"):
        probe_from_bytes(blob, b"not json", FINGERPRINT)


def _rehash(manifest: bytes, blob: bytes) -> bytes:
    import hashlib

    data = json.loads(manifest)
    data["tensors_sha256"] = hashlib.sha256(blob).hexdigest()
    return json.dumps(data).encode()


def test_consistent_but_wrong_tensors_are_refused(blobs: tuple[bytes, bytes]) -> None:
    _, manifest = blobs
    wrong_shape = st_save({"head.weight": torch.zeros(2, 2)})
    with pytest.raises(IncompatibleCheckpoint, match="missing"):
        probe_from_bytes(wrong_shape, _rehash(manifest, wrong_shape), FINGERPRINT)
    probe = build_probe(make_spec("gate", "scalar_mix"), seed=0)
    tensors = {k: v.clone() for k, v in probe.state_dict().items()}
    tensors["head.bias"][0] = float("nan")
    nan_blob = st_save(tensors)
    with pytest.raises(CheckpointError, match="NaN"):
        probe_from_bytes(nan_blob, _rehash(manifest, nan_blob), FINGERPRINT)
    garbage = b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"
    with pytest.raises(CheckpointError, match="unreadable"):
        probe_from_bytes(garbage, _rehash(manifest, garbage), FINGERPRINT)


def test_signed_checkpoints() -> None:
    probe = build_probe(make_spec("mean", "gate"), seed=0)
    blob, manifest = checkpoint_to_bytes(probe, llm=FINGERPRINT, signing_key=b"k1")
    probe_from_bytes(blob, manifest, FINGERPRINT, signing_key=b"k1")
    with pytest.raises(CheckpointError, match="signature does not verify"):
        probe_from_bytes(blob, manifest, FINGERPRINT, signing_key=b"k2")
    unsigned_blob, unsigned = checkpoint_to_bytes(probe, llm=FINGERPRINT)
    with pytest.raises(CheckpointError, match="unsigned"):
        probe_from_bytes(unsigned_blob, unsigned, FINGERPRINT, signing_key=b"k1")


def test_files_round_trip_and_missing_files(tmp_path) -> None:
    probe = build_probe(make_spec("max", "single"), seed=0)
    save_checkpoint(probe, tmp_path / "c", llm=FINGERPRINT)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [MANIFEST_FILE, TENSORS_FILE]
    loaded, _ = load_checkpoint(tmp_path / "c", FINGERPRINT)
    assert loaded.spec == probe.spec
    (tmp_path / "c" / TENSORS_FILE).unlink()
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "c", FINGERPRINT)


def test_thresholds_travel_in_the_spec() -> None:
    probe = build_probe(make_spec("mean", "single"), seed=0)
    probe.set_thresholds({"toxic": 0.3})
    blob, manifest = checkpoint_to_bytes(probe, llm=FINGERPRINT)
    loaded, _ = probe_from_bytes(blob, manifest, FINGERPRINT)
    assert loaded.spec.thresholds == {"toxic": 0.3}


GOLDEN = Path(__file__).parents[2] / "reference" / "golden"


@pytest.mark.parametrize("kind", sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()))
def test_golden_checkpoints_of_this_release_still_load_and_agree(kind: str) -> None:
    # Written once by tests/reference/golden_checkpoints.py; never regenerated. A renamed
    # state-dict key, a changed spec default, manifest schema, signature or format tag
    # would silently orphan every checkpoint stored in Redis: here it fails.
    from safetensors.torch import load_file

    from tests.reference.golden_checkpoints import FINGERPRINT as GOLDEN_LLM
    from tests.reference.golden_checkpoints import KEY

    directory = GOLDEN / kind
    probe, manifest = load_checkpoint(directory, GOLDEN_LLM, signing_key=KEY)
    assert (manifest.version, manifest.parent, manifest.counters.labels_seen) == (7, 6, 12)
    inputs = load_file(str(directory / "inputs.safetensors"))
    expected = json.loads((directory / "expected.json").read_text())
    got = probe.predict_proba_many(inputs["hidden"], inputs["mask"])
    torch.testing.assert_close(got, torch.tensor(expected["probabilities"]), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_another_format_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load as st_load

    from tests.reference.golden_checkpoints import FINGERPRINT as GOLDEN_LLM

    directory = GOLDEN / "mean-scalar_mix"
    blob = (directory / "tensors.safetensors").read_bytes()
    future = st_save(st_load(blob), metadata={"format": "probeguard-probe/2"})
    manifest = CheckpointManifest.decode((directory / "manifest.json").read_bytes())
    manifest = manifest.model_copy(
        update={"tensors_sha256": hashlib.sha256(future).hexdigest(), "signature": None}
    )
    with pytest.raises(IncompatibleCheckpoint, match="probeguard-probe/2"):
        probe_from_bytes(future, manifest.encode(), GOLDEN_LLM)
