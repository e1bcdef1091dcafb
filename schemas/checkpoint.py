"""What travels beside a probe's tensors: the checkpoint manifest (its spec, the frozen LLM's
fingerprint, counters, metrics, stage, signature, drift statistics), ensembles of probes
over several LLMs, and the checkpoint event stream of a probe's versions.

The probe itself is described by :class:`schemas.probe.ProbeSpec`.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import (
    AwareDatetime,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from schemas.base import WireModel
from schemas.drift import DriftReference
from schemas.limits import LabelName
from schemas.messages import ProbeName
from schemas.probe import ProbeSpec

__all__ = [
    "CheckpointEvent",
    "CheckpointManifest",
    "EnsembleManifest",
    "EnsembleMember",
    "EventKind",
    "LLMFingerprint",
    "Stage",
    "TrainingCounters",
]

Stage = Literal["candidate", "canary", "live", "retired", "rolled_back"]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class LLMFingerprint(WireModel):
    """Identity of the frozen LLM a probe was trained on.

    Two fingerprints are compatible when every field matches; ``digest`` is a
    short stable summary for logs and metrics.
    """

    model_id: Annotated[str, Field(min_length=1, max_length=512)]
    source_sha256: Sha256Hex  # weights file(s) the model was loaded from
    num_layers: Annotated[int, Field(ge=1)]
    hidden_size: Annotated[int, Field(ge=1)]
    tokenizer_sha256: Sha256Hex
    # How the weights were transformed after loading, e.g. "torch-int8-dynamic" (the linear
    # layers quantized to int8, activations quantized per batch); None: as loaded. Hidden
    # states differ, so a probe trained on one is refused on the other.
    quantization: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")] | None = None
    # The text the model reads around a message, e.g. "chat-3f2a..." (the chat template's
    # ids around it, :mod:`worker.llm.chat_form`) or "prompt-..." (a prompt's); None: the
    # bare text. States differ, so a probe trained on one form is refused on the other.
    text_form: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Fingerprints without them serialize exactly as before these fields existed, so
        # their digests, signed manifests and caches stay valid, and older readers accept them.
        data: dict[str, object] = handler(self)
        for name in ("quantization", "text_form"):
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @property
    def form(self) -> str | None:
        """The kind of ``text_form`` (``"chat"``, ``"prompt"``; None: the bare text), which
        names cache variants and packaged-default folders."""
        return None if self.text_form is None else self.text_form.split("-", 1)[0]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()[:16]

    def diff(self, other: LLMFingerprint, *, mine: str = "this", theirs: str = "that") -> str:
        """The fields that differ, e.g. ``"num_layers: this 30 vs that 24"``; "" when equal."""
        return "; ".join(
            f"{name}: {mine} {getattr(self, name)!r} vs {theirs} {getattr(other, name)!r}"
            for name in type(self).model_fields
            if getattr(self, name) != getattr(other, name)
        )


class TrainingCounters(WireModel):
    labels_seen: Annotated[int, Field(ge=0)] = 0
    steps: Annotated[int, Field(ge=0)] = 0
    per_label: dict[LabelName, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)


class CheckpointManifest(WireModel):
    """Describes one checkpoint version; the tensors travel beside it as safetensors."""

    schema_version: Literal[1] = 1
    probe: ProbeName
    version: Annotated[int, Field(ge=0)]  # 0 only for checkpoints outside the registry
    parent: Annotated[int, Field(ge=0)] | None = None
    created_at: AwareDatetime
    spec: ProbeSpec
    llm: LLMFingerprint
    tensors_sha256: Sha256Hex
    counters: TrainingCounters = Field(default_factory=TrainingCounters)
    metrics: dict[Annotated[str, Field(max_length=128)], float] = Field(default_factory=dict)
    stage: Stage = "candidate"
    # HMAC-SHA256 over the manifest (without this field) and the tensors, when signing is on.
    signature: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    # Training statistics for drift monitoring (None: written before they existed, or by a
    # path that records none; such a version reports no drift).
    drift: DriftReference | None = None

    @model_serializer(mode="wrap")
    def _omit_no_drift(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Without drift statistics a manifest serializes exactly as before they existed, so
        # signatures over older manifests still verify and older readers accept it.
        data: dict[str, object] = handler(self)
        if data.get("drift") is None:
            data.pop("drift", None)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> CheckpointManifest:
        if self.spec.name != self.probe:
            raise ValueError(f"spec.name {self.spec.name!r} differs from probe {self.probe!r}")
        if self.parent is not None and self.parent >= self.version:
            raise ValueError("parent must be an older version than this one")
        if self.spec.hidden_size != self.llm.hidden_size:
            raise ValueError("spec.hidden_size differs from the LLM's hidden size")
        if self.spec.deepest_layer > self.llm.num_layers:
            raise ValueError("spec.layers reads beyond the LLM's last layer")
        if self.drift is not None and len(self.drift.layer_mean) != len(self.spec.layers):
            raise ValueError("drift statistics cover another number of layers than spec.layers")
        return self


class EnsembleMember(WireModel):
    """One probe of an :class:`EnsembleManifest`: its checkpoint folder (beside the
    ensemble's manifest), the LLM whose states it reads, and its manifest's sha256."""

    path: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,95}$")]
    llm: LLMFingerprint
    manifest_sha256: Sha256Hex


class EnsembleManifest(WireModel):
    """Probes over several frozen LLMs' states, one per LLM, whose calibrated
    probabilities are averaged (``combine``); ``thresholds`` apply to that mean.

    The members are ordinary checkpoints (each verified against its own LLM); this file
    pins each one's manifest by sha256, so a swapped member is refused before it loads.
    """

    schema_version: Literal[1] = 1
    probe: ProbeName
    created_at: AwareDatetime
    combine: Literal["mean"] = "mean"
    members: Annotated[list[EnsembleMember], Field(min_length=2, max_length=8)]
    thresholds: dict[LabelName, float] = Field(default_factory=dict)
    metrics: dict[Annotated[str, Field(max_length=128)], float] = Field(default_factory=dict)
    # HMAC-SHA256 over this manifest without the field, when signing is on.
    signature: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None

    @model_validator(mode="after")
    def _distinct(self) -> EnsembleManifest:
        if len({m.path for m in self.members}) != len(self.members):
            raise ValueError("two members share a folder")
        if len({m.llm.digest for m in self.members}) != len(self.members):
            raise ValueError("two members read the same LLM; an ensemble holds one per LLM")
        return self


# published: a new version (details.live: it went live at once)
# promoted: a version became live (previous = the live before)
# canary / canary_cleared: a canary trial started / ended without a verdict
# rolled_back: a version was judged bad (details.stage: "canary" or "live"; a live rollback
#   names the restored version in details.restored); never auto-promoted again
# pinned / unpinned: automatic stage changes frozen / resumed
EventKind = Literal[
    "published",
    "promoted",
    "canary",
    "canary_cleared",
    "rolled_back",
    "pinned",
    "unpinned",
]


class CheckpointEvent(WireModel):
    """One entry of a probe's checkpoint event stream (Redis stream, never pub/sub)."""

    schema_version: Literal[1] = 1
    kind: EventKind
    probe: ProbeName
    version: Annotated[int, Field(ge=1)] | None = None
    previous: Annotated[int, Field(ge=1)] | None = None  # e.g. the live version before a change
    reason: Annotated[str, Field(max_length=2000)] = ""
    details: dict[Annotated[str, Field(max_length=128)], float | int | str | bool | None] = Field(
        default_factory=dict
    )
    actor: Annotated[str, Field(max_length=256)] = ""
    at: AwareDatetime
