"""Probe specs and checkpoint manifests: everything needed to rebuild a probe."""

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
from schemas.limits import LabelName
from schemas.messages import ProbeName

__all__ = [
    "CheckpointEvent",
    "CheckpointManifest",
    "EventKind",
    "LLMFingerprint",
    "LayerMix",
    "ProbeSpec",
    "Stage",
    "Task",
    "TokenPool",
    "TrainingCounters",
]

TokenPool = Literal["mean", "max", "first", "last", "gate", "mha"]
LayerMix = Literal["single", "scalar_mix", "gate"]
Task = Literal["multiclass", "multilabel"]
Stage = Literal["candidate", "canary", "live", "retired", "rolled_back"]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ProbeSpec(WireModel):
    """The architecture and label space of a probe.

    Hidden-state indices follow transformers: ``0`` is the embedding output,
    ``i`` the output of decoder layer ``i``, ``num_layers`` the last layer.
    """

    schema_version: Literal[1] = 1
    name: ProbeName
    token_pool: TokenPool
    layer_mix: LayerMix
    layers: Annotated[list[Annotated[int, Field(ge=0, le=1024)]], Field(min_length=1)]
    hidden_size: Annotated[int, Field(ge=1, le=65536)]
    task: Task
    labels: Annotated[list[LabelName], Field(min_length=1, max_length=1024)]
    # Labels whose prediction makes the verdict "flag" (e.g. ["toxic"]).
    flag_labels: list[LabelName] = Field(default_factory=list)
    # Per-label decision thresholds (multi-label) or on the flag labels' score.
    thresholds: dict[LabelName, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(
        default_factory=dict
    )
    # Downcast multi-head attention (token_pool="mha").
    d_inner: Annotated[int, Field(ge=1, le=8192)] = 64
    num_heads: Annotated[int, Field(ge=1, le=64)] = 4
    layer_norm: bool = True
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> ProbeSpec:
        if sorted(set(self.layers)) != self.layers:
            raise ValueError("layers must be strictly increasing (sorted, no repeats)")
        if self.layer_mix == "single" and len(self.layers) != 1:
            raise ValueError("layer_mix 'single' reads exactly one layer")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels must not repeat")
        if self.task == "multiclass" and len(self.labels) < 2:
            raise ValueError("a multiclass probe needs at least two labels")
        unknown = (set(self.flag_labels) | set(self.thresholds)) - set(self.labels)
        if unknown:
            raise ValueError(f"flag_labels/thresholds name unknown labels: {sorted(unknown)}")
        if self.token_pool == "mha" and self.d_inner % self.num_heads:
            raise ValueError("d_inner must be divisible by num_heads")
        return self

    @property
    def deepest_layer(self) -> int:
        return self.layers[-1]


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

    @model_serializer(mode="wrap")
    def _omit_unset_quantization(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Unquantized fingerprints serialize exactly as before the field existed, so their
        # digests, signed manifests and caches stay valid, and older readers accept them.
        data: dict[str, object] = handler(self)
        if data.get("quantization") is None:
            data.pop("quantization", None)
        return data

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
