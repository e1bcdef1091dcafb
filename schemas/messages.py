"""Messages on every Kafka topic.

| topic (default name)      | model           | key        |
|---------------------------|-----------------|------------|
| ``chat.messages``         | ChatMessage     | message id |
| ``moderation.labels``     | HumanLabel      | message id |
| ``moderation.verdicts``   | Verdict         | message id |
| ``moderation.review``     | ReviewRequest   | message id |
| ``moderation.dead-letter``| DeadLetter      | source key |
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import (
    AwareDatetime,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from schemas.base import WireModel
from schemas.limits import HARD_MAX_ID_CHARS, Id, LabelName, Metadata, Text, check_label_count

__all__ = [
    "DEAD_LETTER_KEY_BYTES",
    "DEAD_LETTER_PAYLOAD_BYTES",
    "PROBE_NAME",
    "ChatMessage",
    "DeadLetter",
    "DeadLetterKind",
    "HeadResult",
    "HumanLabel",
    "ProbeResult",
    "ReviewRequest",
    "ShadowResult",
    "Verdict",
    "utcnow",
]

Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Scores = dict[LabelName, Probability]
PROBE_NAME = re.compile(r"[a-z0-9][a-z0-9_\-]{0,63}")  # settings check names with it too
ProbeName = Annotated[str, Field(pattern=f"^{PROBE_NAME.pattern}$")]


def utcnow() -> datetime:
    return datetime.now(UTC)


def _omit_none(
    self: WireModel, handler: SerializerFunctionWrapHandler, fields: tuple[str, ...]
) -> dict[str, object]:
    """Serialize with ``fields`` left out while unset, so messages that do not use a newer
    optional field read exactly as before it existed (older strict readers accept them)."""
    data: dict[str, object] = handler(self)
    for name in fields:
        if data.get(name) is None:
            data.pop(name, None)
    return data


def _check_scores(scores: dict[str, float], info: ValidationInfo) -> dict[str, float]:
    check_label_count(list(scores), info)
    if not scores:
        raise ValueError("scores must name at least one label")
    return scores


class ChatMessage(WireModel):
    """One chat message to be moderated."""

    schema_version: Literal[1] = 1
    message_id: Id
    conversation_id: Id
    user_id: Id | None = None
    text: Text
    created_at: AwareDatetime
    metadata: Metadata = Field(default_factory=dict)
    # A model's reply: the id of the message it answers (the inline guard moderates replies
    # as they are generated, see worker.guard). None: a message someone sent.
    reply_to: Id | None = None

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return _omit_none(self, handler, ("reply_to",))


class HumanLabel(WireModel):
    """A human's judgement of one message.

    Exactly one of ``label`` (multi-class: the one true class) and ``labels``
    (multi-label: every positive category; empty means none) is given. ``text``
    lets a label stand alone when the scorers' text cache no longer holds it.

    ``probe`` addresses the label to one probe (a review request names the probe that
    asked): only that probe's updater learns it, and dead-letters it if the label is not
    one of the probe's. Without it, every probe that knows the label learns it.

    ``head`` addresses one head of a multi-head probe: the label says nothing of the other
    heads (unknown, never negative), and ``labels: []`` is a negative for that head.
    Without it, a label annotates the heads it names a label of, unless it is
    ``exhaustive``: the labeler judged every head (a reviewer who saw them all), so a head
    none of whose labels is given is a negative (``labels: []``: nothing applies).
    """

    schema_version: Literal[1] = 1
    message_id: Id
    probe: ProbeName | None = None
    head: ProbeName | None = None
    label: LabelName | None = None
    labels: list[LabelName] | None = None
    labeler_id: Id
    created_at: AwareDatetime
    text: Text | None = None
    exhaustive: bool | None = None  # every head judged; None/False: only those named

    @field_validator("labels")
    @classmethod
    def _labels_bounded(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is not None:
            check_label_count(v, info)
            if len(set(v)) != len(v):
                raise ValueError("labels must not repeat")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> HumanLabel:
        if (self.label is None) == (self.labels is None):
            raise ValueError("give exactly one of 'label' (multi-class) or 'labels' (multi-label)")
        if self.exhaustive and self.head is not None:
            raise ValueError("a label for one 'head' cannot also be 'exhaustive'")
        return self

    @property
    def all_labels(self) -> tuple[str, ...]:
        """The positive labels, whichever field carried them."""
        return (self.label,) if self.label is not None else tuple(self.labels or ())

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return _omit_none(self, handler, ("head", "exhaustive"))


class ShadowResult(WireModel):
    """What the canary said about a message it did not decide (shadow mode)."""

    version: Annotated[int, Field(ge=1)]
    scores: Scores
    predicted: list[LabelName]


class HeadResult(WireModel):
    """One head's outcome within a multi-head probe's result."""

    predicted: list[LabelName]
    flagged: bool


class ProbeResult(WireModel):
    """One probe's scores for one message.

    ``scores`` holds every label of every head (labels are unique across heads); a
    multi-head probe also says, per head, what it predicted and whether it flags.
    """

    probe: ProbeName
    version: Annotated[int, Field(ge=0)]  # 0 = a bootstrap checkpoint file, not from the registry
    scores: Scores
    predicted: list[LabelName]
    flagged: bool
    canary: bool = False  # True when the canary version decided this message
    shadow: ShadowResult | None = None
    heads: Annotated[dict[ProbeName, HeadResult], Field(max_length=64)] | None = None
    # The hidden-state index whose exit head decided this message (the cascade: an easy
    # message leaves the forward pass there); None: the full probe decided.
    depth: Annotated[int, Field(ge=0, le=1024)] | None = None

    _scores = field_validator("scores")(_check_scores)

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return _omit_none(self, handler, ("heads", "depth"))


# ``message_id|probe@version,...`` for the most results a verdict holds (32), the longest
# probe names (64) and versions up to 20 digits: 512 was passed by six long probe names,
# and every message was then dead-lettered.
MAX_VERDICT_ID_CHARS = HARD_MAX_ID_CHARS + 1 + 32 * (64 + 1 + 20 + 1)


class Verdict(WireModel):
    """The moderation outcome for one message, from every configured probe.

    ``verdict_id`` is derived from the message id and the probe versions, so
    a replay after a crash produces the same id as long as the probes were not swapped
    meanwhile. Consumers deduplicate on ``message_id`` (the Kafka key): a redelivery after
    a hot swap carries a new ``verdict_id`` for the same message.
    """

    schema_version: Literal[1] = 1
    verdict_id: Annotated[str, Field(min_length=1, max_length=MAX_VERDICT_ID_CHARS)]
    message_id: Id
    conversation_id: Id | None = None
    decision: Literal["allow", "flag"]
    results: Annotated[list[ProbeResult], Field(min_length=1, max_length=32)]
    latency_ms: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    worker_id: Id
    scored_at: AwareDatetime
    reply_to: Id | None = None  # the judged message is a model's reply to this message

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return _omit_none(self, handler, ("reply_to",))

    @staticmethod
    def make_id(message_id: str, results: list[ProbeResult]) -> str:
        versions = ",".join(
            f"{r.probe}@{r.version}" for r in sorted(results, key=lambda r: r.probe)
        )
        return f"{message_id}|{versions}"

    @model_validator(mode="after")
    def _consistent(self) -> Verdict:
        if self.verdict_id != self.make_id(self.message_id, self.results):
            raise ValueError("verdict_id does not match message_id and probe versions")
        expected = "flag" if any(r.flagged for r in self.results) else "allow"
        if self.decision != expected:
            raise ValueError(f"decision {self.decision!r} contradicts the probe results")
        return self


class ReviewRequest(WireModel):
    """An item for the human labeling queue."""

    schema_version: Literal[1] = 1
    message_id: Id
    conversation_id: Id | None = None
    text: Text
    probe: ProbeName
    version: Annotated[int, Field(ge=0)]
    scores: Scores
    reason: Literal["uncertain", "audit"]
    created_at: AwareDatetime
    reply_to: Id | None = None  # the text is a model's reply to this message

    _scores = field_validator("scores")(_check_scores)

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return _omit_none(self, handler, ("reply_to",))


DeadLetterKind = Literal[
    "invalid_json",  # not JSON, or not UTF-8
    "schema",  # JSON that violates the topic's schema
    "unjoinable",  # a label whose text cannot be found
    "unknown_label",  # a label the probe does not know
    "unscorable",  # valid JSON, but the model cannot read the text (e.g. control characters only)
    "processing",  # valid input the worker failed on (after retries)
    "refused",  # the broker refused a record produced for this input (e.g. too large)
    "quarantined",  # a label past its labeler's limit (PROBEGUARD_LABELER_MAX_LABELS)
]

# A dead letter keeps a prefix of the payload (and of the key), never all of it: whatever
# the input, the letter stays far below the broker's 1 MiB default record limit.
DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024
DEAD_LETTER_KEY_BYTES = 1024


def _b64_len(n: int) -> int:
    return 4 * ((n + 2) // 3)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class DeadLetter(WireModel):
    """A payload that could not be processed, with where it came from and why.

    ``payload_b64`` holds at most the first :data:`DEAD_LETTER_PAYLOAD_BYTES` bytes of
    the payload; ``payload_size`` and ``payload_sha256`` describe all of it (build one
    with :meth:`bounded`).
    """

    schema_version: Literal[1] = 1
    source_topic: Annotated[str, Field(min_length=1, max_length=249)]
    source_partition: Annotated[int, Field(ge=0)]
    source_offset: Annotated[int, Field(ge=0)]
    key_b64: Annotated[str, Field(max_length=_b64_len(DEAD_LETTER_KEY_BYTES))] | None = None
    # The raw bytes (a prefix), base64: they may not even be UTF-8.
    payload_b64: Annotated[str, Field(max_length=_b64_len(DEAD_LETTER_PAYLOAD_BYTES))]
    payload_size: Annotated[int, Field(ge=0)] | None = None  # of the whole payload
    payload_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    error_kind: DeadLetterKind
    error_message: Annotated[str, Field(max_length=4000)]
    worker_id: Id
    created_at: AwareDatetime

    @classmethod
    def bounded(
        cls,
        *,
        payload: bytes,
        key: bytes | None,
        error_message: str,
        **fields: object,
    ) -> DeadLetter:
        """A letter for ``payload`` of any size: a prefix, its size and its sha256."""
        return cls(
            key_b64=None if key is None else base64.b64encode(key[:DEAD_LETTER_KEY_BYTES]).decode(),
            payload_b64=base64.b64encode(payload[:DEAD_LETTER_PAYLOAD_BYTES]).decode(),
            payload_size=len(payload),
            payload_sha256=_sha256(payload),
            error_message=error_message[:4000],
            **fields,  # type: ignore[arg-type]
        )

    @property
    def truncated(self) -> bool:
        """True when ``payload_b64`` holds only a prefix of the payload."""
        return self.payload_size is not None and self.payload_size > DEAD_LETTER_PAYLOAD_BYTES

    @field_validator("payload_b64", "key_b64")
    @classmethod
    def _is_base64(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError("not valid base64") from exc
        return v
