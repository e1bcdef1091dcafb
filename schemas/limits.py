"""Configurable bounds for wire payloads, and the field types that enforce them.

Every bound that depends on deployment (text length, label count, id format,
metadata size) lives in :class:`Limits`. Decoders pass a ``Limits`` through the
pydantic validation context::

    ChatMessage.model_validate_json(raw, context={"limits": Limits(max_text_chars=4000)})

Without a context the module defaults apply. Hard ceilings that no deployment
may exceed are ``Field`` constraints on the models themselves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated

from pydantic import AfterValidator, Field, JsonValue, ValidationInfo

__all__ = [
    "DEFAULT_LIMITS",
    "HARD_MAX_TEXT_CHARS",
    "Id",
    "LabelName",
    "Limits",
    "Metadata",
    "Text",
]

# Ceilings no configuration can raise: they keep a single payload from
# exhausting memory before the configurable checks even run.
HARD_MAX_TEXT_CHARS = 1_000_000
HARD_MAX_LABELS = 1024
HARD_MAX_ID_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """Deployment-tunable bounds on wire payloads."""

    max_text_chars: int = 32_000  # characters in one message text
    max_labels: int = 64  # labels on one HumanLabel / probe outputs
    max_metadata_bytes: int = 4096  # compact JSON size of ChatMessage.metadata
    # Ids are opaque but printable: no whitespace, no control characters, bounded.
    id_pattern: str = r"[A-Za-z0-9][A-Za-z0-9._:@/+=\-]{0,127}"
    label_pattern: str = r"[a-z0-9][a-z0-9_/\-]{0,63}"

    def __post_init__(self) -> None:
        if not 1 <= self.max_text_chars <= HARD_MAX_TEXT_CHARS:
            raise ValueError(f"max_text_chars must be in 1..{HARD_MAX_TEXT_CHARS}")
        if not 1 <= self.max_labels <= HARD_MAX_LABELS:
            raise ValueError(f"max_labels must be in 1..{HARD_MAX_LABELS}")
        if self.max_metadata_bytes < 2:
            raise ValueError("max_metadata_bytes must be >= 2 (the size of '{}')")
        re.compile(self.id_pattern)
        re.compile(self.label_pattern)

    @cached_property
    def id_re(self) -> re.Pattern[str]:
        return re.compile(self.id_pattern)

    @cached_property
    def label_re(self) -> re.Pattern[str]:
        return re.compile(self.label_pattern)


DEFAULT_LIMITS = Limits()


def limits_from(info: ValidationInfo) -> Limits:
    """The limits passed in the validation context, else the defaults."""
    ctx = info.context
    if isinstance(ctx, dict):
        limits = ctx.get("limits")
        if isinstance(limits, Limits):
            return limits
    return DEFAULT_LIMITS


def _check_id(value: str, info: ValidationInfo) -> str:
    if not limits_from(info).id_re.fullmatch(value):
        raise ValueError(f"id {value[:40]!r} does not match the id format")
    return value


def _check_label(value: str, info: ValidationInfo) -> str:
    if not limits_from(info).label_re.fullmatch(value):
        raise ValueError(f"label {value[:40]!r} does not match the label format")
    return value


def _check_text(value: str, info: ValidationInfo) -> str:
    limit = limits_from(info).max_text_chars
    if len(value) > limit:
        raise ValueError(f"text has {len(value)} characters, more than the limit of {limit}")
    if not value.strip():
        raise ValueError("text is empty or whitespace only")
    return value


def _check_metadata(value: dict[str, JsonValue], info: ValidationInfo) -> dict[str, JsonValue]:
    limit = limits_from(info).max_metadata_bytes
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > limit:
        raise ValueError(f"metadata is {size} bytes as JSON, more than the limit of {limit}")
    return value


Id = Annotated[str, Field(min_length=1, max_length=HARD_MAX_ID_CHARS), AfterValidator(_check_id)]
LabelName = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_check_label)]
Text = Annotated[str, Field(max_length=HARD_MAX_TEXT_CHARS), AfterValidator(_check_text)]
Metadata = Annotated[dict[str, JsonValue], AfterValidator(_check_metadata)]


def check_label_count(labels: list[str] | tuple[str, ...], info: ValidationInfo) -> None:
    """Raise if a label collection is larger than the configured limit."""
    limit = limits_from(info).max_labels
    if len(labels) > limit:
        raise ValueError(f"{len(labels)} labels, more than the limit of {limit}")
