"""Offline data: labeled JSONL rows and the manifest of a hidden-state cache."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from schemas.base import WireModel
from schemas.checkpoint import LLMFingerprint
from schemas.limits import LabelName

__all__ = [
    "CacheEncryption",
    "CacheManifest",
    "CacheSource",
    "LabeledText",
    "StateDtype",
    "SummaryKind",
]

SummaryKind = Literal["mean", "max", "first", "last"]
Layer = Annotated[int, Field(ge=0, le=1024)]


# How hidden states are stored (caches, the updater's replay). fp16 holds |x| <= 65504;
# bf16 keeps fp32's range at fp16's size (Gemma 3's residual stream reaches 1e5).
StateDtype = Literal["float16", "bfloat16", "float32"]


class LabeledText(WireModel):
    """One line of a labeled JSONL file: ``{"id", "text", "label"[, "labels"]}``.

    ``label`` is the single class (multiclass); ``labels`` the positive
    categories (multilabel, empty when none). At least one must be present.
    """

    id: Annotated[str, Field(min_length=1, max_length=256)]
    text: Annotated[str, Field(min_length=1, max_length=1_000_000)]
    label: LabelName | None = None
    labels: list[LabelName] | None = None

    @model_validator(mode="after")
    def _some_label(self) -> LabeledText:
        if self.label is None and self.labels is None:
            raise ValueError("a row needs 'label' or 'labels'")
        if not self.text.strip():
            raise ValueError("text is empty or whitespace only")
        return self


class CacheSource(WireModel):
    """The labeled file a cache was built from."""

    path: str
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    rows: Annotated[int, Field(ge=0)]


class CacheEncryption(WireModel):
    """How a cache's shards are encrypted, and with which key: its fingerprint (an HKDF
    output of the key, 64 bits), never the key. ``probes.offline.sealed`` has the format."""

    algorithm: Literal["AES-256-GCM"] = "AES-256-GCM"
    kdf: Literal["HKDF-SHA256"] = "HKDF-SHA256"
    key_fingerprint: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]


class CacheManifest(WireModel):
    """``manifest.json`` of a hidden-state cache directory.

    Shard ``k`` (``shard-00000.safetensors``, …) holds source rows
    ``[k * shard_rows, (k + 1) * shard_rows)``. ``token_layers`` are stored
    token by token (ragged, real tokens only); ``summary_layers`` as one
    vector per row for each kind in ``summaries``. Hidden states are stored as ``dtype``:
    fp16 by default; bf16 (or fp32) for LLMs whose activations exceed fp16's 65504.
    With ``encryption``, every shard is AES-256-GCM encrypted and authenticated (the
    manifest itself stays readable, and is authenticated through the shards); without it
    the field is left out, so a plaintext manifest reads exactly as before it existed.
    """

    schema_version: Literal[1] = 1
    format: Literal["probeguard-hidden-cache"] = "probeguard-hidden-cache"
    llm: LLMFingerprint
    source: CacheSource
    max_tokens: Annotated[int, Field(ge=1)]
    truncation: str
    dtype: StateDtype = "float16"
    # The LLM ran under torch.autocast in this dtype (PROBEGUARD_AUTOCAST); None: as loaded.
    autocast: Literal["bfloat16", "float16"] | None = None
    token_layers: list[Layer]
    summary_layers: list[Layer]
    summaries: list[SummaryKind]
    shard_rows: Annotated[int, Field(ge=1, le=1_000_000)]
    label_vocab: list[LabelName]  # every value of "label", sorted
    labels_vocab: list[LabelName]  # every category seen in "labels", sorted
    has_labels_field: bool  # False: the file has no "labels" (multilabel targets unavailable)
    created_at: AwareDatetime
    encryption: CacheEncryption | None = None  # None: shards are plain safetensors

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data: dict[str, object] = handler(self)
        if data.get("encryption") is None:
            data.pop("encryption", None)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> CacheManifest:
        for name in ("token_layers", "summary_layers"):
            layers = getattr(self, name)
            if sorted(set(layers)) != layers:
                raise ValueError(f"{name} must be strictly increasing, got {layers}")
            if layers and layers[-1] > self.llm.num_layers:
                raise ValueError(f"{name} reads layer {layers[-1]} beyond {self.llm.num_layers}")
        if len(set(self.summaries)) != len(self.summaries):
            raise ValueError(f"summaries repeat: {self.summaries}")
        if bool(self.summaries) != bool(self.summary_layers):
            raise ValueError("summaries and summary_layers must be both empty or both set")
        if not self.token_layers and not self.summary_layers:
            raise ValueError("a cache must store token_layers or summary_layers")
        return self

    @property
    def num_shards(self) -> int:
        return -(-self.source.rows // self.shard_rows)

    def same_content(self, other: CacheManifest) -> bool:
        """True when both describe the same cache: creation time aside, and the source's
        path (the same rows reached by another path, ``../data`` or ``/abs/data``, are
        the same source: its sha256 and row count say so)."""
        aside: dict[str, Any] = {"created_at": True, "source": {"path"}}
        return self.model_dump(exclude=aside) == other.model_dump(exclude=aside)
