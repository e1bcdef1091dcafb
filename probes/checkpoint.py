"""Checkpoints: safetensors tensors + a JSON :class:`CheckpointManifest`. Never pickle.

The byte-level pair is what the Redis registry stores as two values; the file
functions put the same two blobs in a directory (``tensors.safetensors`` and
``manifest.json``). Loading checks, in order: the manifest parses, the sha256
of the tensor bytes matches the manifest, the HMAC signature (when a key is
given; see below), the LLM fingerprint, the format tag, then the tensor names, shapes, dtypes and
values against a probe freshly built from the manifest's spec. Any failure raises
:class:`CheckpointError` (or :class:`IncompatibleCheckpoint`) naming the value.

Two tensor formats, named by the ``format`` tag of the safetensors metadata (covered by
the sha256 and the signature like every byte of the blob): ``probeguard-probe/1``, the
fp32 state dict, and ``probeguard-probe-int8/1`` (``weights="int8"``), int8 with
per-row scales (:mod:`probes.quantize`; about a quarter of the bytes). An int8
checkpoint is dequantized to fp32 on load: the probe then serves as usual.

Signatures come in two kinds. A file's (``deployment=None``: ``probeguard fit``, the
seed checkpoint, versions published before binding existed) covers the manifest and the
tensors. A registry version's is also *bound* to its deployment: the Redis key prefix
and the probe's name are signed with it (:func:`sign`), so a checkpoint copied from
another deployment that shares the key (staging) does not verify in this one. A registry
read passes ``deployment``; an unbound signature is then accepted only where the caller
says something else of this deployment vouches for it (``unbound_ok``: its signed stage
pointers name the checkpoint's sha256).

::

    blob, manifest = checkpoint_to_bytes(probe, llm=fingerprint, version=7)
    probe2, m = probe_from_bytes(blob, manifest, expected_fingerprint=fingerprint)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Literal

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from probes.errors import CheckpointError, IncompatibleCheckpoint
from probes.files import atomic_write, private_dir
from probes.probe import Probe, build_probe
from probes.quantize import dequantize_state, quantize_state
from schemas import (
    CheckpointManifest,
    DriftReference,
    LLMFingerprint,
    Stage,
    TrainingCounters,
    describe_error,
)
from schemas.messages import utcnow

__all__ = [
    "FORMATS",
    "MANIFEST_FILE",
    "TENSORS_FILE",
    "WeightFormat",
    "checkpoint_to_bytes",
    "load_checkpoint",
    "probe_from_bytes",
    "save_checkpoint",
    "sign",
    "verify_signature",
    "weight_format",
]

FORMAT = "probeguard-probe/1"
FORMAT_INT8 = "probeguard-probe-int8/1"
FORMATS = {"fp32": FORMAT, "int8": FORMAT_INT8}
WeightFormat = Literal["fp32", "int8"]
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sign(
    manifest: CheckpointManifest, tensor_bytes: bytes, key: bytes, deployment: str | None = None
) -> str:
    """HMAC-SHA256 over the manifest (without its signature) and the tensor bytes; with
    ``deployment`` (a registry's Redis key prefix) bound to it and the probe's name too.

    The bound form starts with a JSON array, the unbound one with the manifest's JSON
    object: the two can never collide."""
    unsigned = manifest.model_copy(update={"signature": None}).encode()
    bound = b"" if deployment is None else _binding(deployment, manifest.probe)
    return hmac.new(key, bound + unsigned + b"\0" + tensor_bytes, hashlib.sha256).hexdigest()


def _binding(deployment: str, probe: str) -> bytes:
    record = ["probeguard-checkpoint-binding/1", deployment, probe]
    return json.dumps(record, separators=(",", ":")).encode() + b"\0"


def verify_signature(
    manifest: CheckpointManifest,
    tensor_bytes: bytes,
    key: bytes,
    deployment: str | None = None,
    *,
    unbound_ok: bool = False,
) -> Literal["bound", "unbound"]:
    """Which signature ``manifest`` carries: ``"bound"`` to ``deployment``, or ``"unbound"``
    (a file's); raises :class:`CheckpointError` when it has none that verifies. With
    ``deployment`` an unbound one is refused unless ``unbound_ok`` (see the module
    docstring); without, only the unbound kind verifies."""
    name = f"{manifest.probe}@{manifest.version}"
    if manifest.signature is None:
        raise CheckpointError(f"checkpoint {name!r} is unsigned but a signing key is configured")
    if deployment is not None and hmac.compare_digest(
        manifest.signature, sign(manifest, tensor_bytes, key, deployment)
    ):
        return "bound"
    if not hmac.compare_digest(manifest.signature, sign(manifest, tensor_bytes, key)):
        where = "" if deployment is None else f" for deployment {deployment!r}"
        raise CheckpointError(
            f"checkpoint {name!r}: signature does not verify{where} (another key, another "
            "deployment, or tampered)"
        )
    if deployment is not None and not unbound_ok:
        raise CheckpointError(
            f"checkpoint {name!r}: its signature is not bound to deployment {deployment!r} "
            "(a file's, or published before signatures were bound) and nothing of this "
            "deployment vouches for it; an operator who trusts it promotes it with --force"
        )
    return "unbound"


def checkpoint_to_bytes(
    probe: Probe,
    *,
    llm: LLMFingerprint,
    version: int = 0,
    parent: int | None = None,
    counters: TrainingCounters | None = None,
    metrics: dict[str, float] | None = None,
    stage: Stage = "candidate",
    created_at: datetime | None = None,
    signing_key: bytes | None = None,
    weights: WeightFormat = "fp32",
    drift: DriftReference | None = None,
    deployment: str | None = None,
) -> tuple[bytes, bytes]:
    """Serialize ``probe`` to ``(safetensors bytes, manifest JSON bytes)``; ``weights="int8"``
    stores int8 with per-row scales (see the module docstring); ``drift``: the training
    statistics drift monitoring compares live traffic with (signed like the rest);
    ``deployment`` binds the signature to a registry's key prefix."""
    if weights not in FORMATS:
        raise CheckpointError(f"unknown weight format {weights!r}; known: {sorted(FORMATS)}")
    state = {
        k: v.detach().to("cpu", torch.float32).contiguous() for k, v in probe.state_dict().items()
    }
    meta = {"format": FORMATS[weights], "probe": probe.spec.name}
    if weights == "int8":
        tensors, encodings = quantize_state(state)
        meta["encoding"] = json.dumps(encodings, sort_keys=True)
    else:
        tensors = state
    blob = st_save(tensors, metadata=meta)
    try:
        manifest = CheckpointManifest(
            probe=probe.spec.name,
            version=version,
            parent=parent,
            created_at=created_at or utcnow(),
            spec=probe.spec,
            llm=llm,
            tensors_sha256=_sha256(blob),
            counters=counters or TrainingCounters(),
            metrics={k: float(v) for k, v in (metrics or {}).items()},
            stage=stage,
            drift=drift,
        )
    except ValidationError as exc:
        raise CheckpointError(
            f"cannot describe probe {probe.spec.name!r}: {describe_error(exc)[1]}"
        ) from exc
    if signing_key is not None:
        signature = sign(manifest, blob, signing_key, deployment)
        manifest = manifest.model_copy(update={"signature": signature})
    return blob, manifest.encode()


def _check_tensors(probe: Probe, tensors: dict[str, torch.Tensor], name: str) -> None:
    expected = {k: tuple(v.shape) for k, v in probe.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise IncompatibleCheckpoint(
            f"checkpoint {name!r} tensors do not fit its spec: "
            f"missing {missing}, unexpected {unexpected}"
        )
    for key, shape in expected.items():
        got = tuple(tensors[key].shape)
        if got != shape:
            raise IncompatibleCheckpoint(
                f"checkpoint {name!r} tensor {key!r} has shape {got}, spec needs {shape}"
            )
        if tensors[key].dtype != torch.float32:
            raise CheckpointError(
                f"checkpoint {name!r} tensor {key!r} is {tensors[key].dtype}, not float32"
            )
        if not torch.isfinite(tensors[key]).all():
            raise CheckpointError(f"checkpoint {name!r} tensor {key!r} holds NaN or inf")


def _metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header's metadata (empty when absent or the header is unreadable:
    loading then reports the real problem)."""
    if len(blob) < 8:
        return {}
    size = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8 : 8 + size])
    except (ValueError, UnicodeDecodeError):
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return {k: v for k, v in meta.items() if isinstance(v, str)} if isinstance(meta, dict) else {}


def _format_tag(blob: bytes) -> str | None:
    return _metadata(blob).get("format")


def weight_format(blob: bytes) -> str:
    """``"fp32"`` or ``"int8"``: how a checkpoint blob stores its weights (``"fp32"`` for
    blobs without a tag, as written before the tag existed; ``"unknown"`` for a foreign tag)."""
    tag = _format_tag(blob)
    if tag is None:
        return "fp32"
    return next((k for k, v in FORMATS.items() if v == tag), "unknown")


def _state_from(
    tensors: dict[str, torch.Tensor], blob: bytes, name: str
) -> dict[str, torch.Tensor]:
    """The fp32 state dict a blob holds (int8 blobs dequantized)."""
    if _format_tag(blob) != FORMAT_INT8:
        return tensors
    try:
        encodings = json.loads(_metadata(blob).get("encoding", ""))
    except ValueError:
        encodings = None
    if not isinstance(encodings, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in encodings.items()
    ):
        raise CheckpointError(f"int8 checkpoint {name!r} has no readable 'encoding' metadata")
    try:
        return dequantize_state(tensors, encodings)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {name!r}: {exc}") from exc


def probe_from_bytes(
    tensor_bytes: bytes,
    manifest_json: bytes | str,
    expected_fingerprint: LLMFingerprint | None,
    *,
    signing_key: bytes | None = None,
    deployment: str | None = None,
    unbound_ok: bool = False,
) -> tuple[Probe, CheckpointManifest]:
    """Rebuild a probe from the two blobs, verifying everything (see the module docstring).

    ``expected_fingerprint`` is the LLM this process runs; ``None`` skips that check
    and is meant for offline inspection only. ``deployment`` and ``unbound_ok``: the
    signature's binding, as :func:`verify_signature`.
    """
    try:
        manifest = CheckpointManifest.decode(manifest_json)
    except ValidationError as exc:
        raise CheckpointError(f"invalid checkpoint manifest: {describe_error(exc)[1]}") from exc
    name = f"{manifest.probe}@{manifest.version}"
    digest = _sha256(tensor_bytes)
    if digest != manifest.tensors_sha256:
        raise CheckpointError(
            f"checkpoint {name!r}: tensor sha256 {digest[:16]}… does not match the manifest's "
            f"{manifest.tensors_sha256[:16]}… (corrupt or tampered)"
        )
    if signing_key is not None:
        verify_signature(manifest, tensor_bytes, signing_key, deployment, unbound_ok=unbound_ok)
    if expected_fingerprint is not None and manifest.llm != expected_fingerprint:
        raise IncompatibleCheckpoint(
            f"checkpoint {name!r} was trained on another LLM: "
            f"{manifest.llm.diff(expected_fingerprint, mine='checkpoint', theirs='this LLM')}"
        )
    fmt = _format_tag(tensor_bytes)
    if fmt is not None and fmt not in FORMATS.values():
        raise IncompatibleCheckpoint(
            f"checkpoint {name!r} is in format {fmt!r}; this release reads "
            f"{sorted(FORMATS.values())}"
        )
    try:
        tensors = st_load(tensor_bytes)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {name!r}: unreadable safetensors data: {exc}") from exc
    tensors = _state_from(tensors, tensor_bytes, name)
    probe = build_probe(manifest.spec)
    _check_tensors(probe, tensors, name)
    probe.load_state_dict(tensors, strict=True)
    probe.eval()
    return probe, manifest


def save_checkpoint(
    probe: Probe, directory: str | os.PathLike[str], **kwargs: object
) -> CheckpointManifest:
    """Write ``tensors.safetensors`` then ``manifest.json`` into ``directory`` (atomically each).

    Keyword arguments are those of :func:`checkpoint_to_bytes`.
    """
    out = private_dir(directory)
    blob, manifest = checkpoint_to_bytes(probe, **kwargs)  # type: ignore[arg-type]
    atomic_write(out / TENSORS_FILE, blob)
    atomic_write(out / MANIFEST_FILE, manifest)
    return CheckpointManifest.decode(manifest)


def load_checkpoint(
    directory: str | os.PathLike[str],
    expected_fingerprint: LLMFingerprint | None,
    *,
    signing_key: bytes | None = None,
) -> tuple[Probe, CheckpointManifest]:
    """Load and verify a checkpoint directory written by :func:`save_checkpoint`."""
    path = Path(directory)
    try:
        blob = (path / TENSORS_FILE).read_bytes()
        manifest = (path / MANIFEST_FILE).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc
    return probe_from_bytes(blob, manifest, expected_fingerprint, signing_key=signing_key)
