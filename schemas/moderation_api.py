"""The HTTP moderation APIs ``probeguard serve`` speaks: OpenAI's ``POST /v1/moderations``
and Perspective's ``POST /v1alpha1/comments:analyze``, request and response shapes as
their clients send and read them (unknown request fields are ignored, as theirs are).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.limits import HARD_MAX_ID_CHARS, HARD_MAX_TEXT_CHARS

__all__ = [
    "HARD_MAX_INPUTS",
    "OPENAI_CATEGORIES",
    "AttributeScores",
    "ImageInput",
    "ModerationRequest",
    "ModerationResponse",
    "ModerationResult",
    "PerspectiveComment",
    "PerspectiveRequest",
    "PerspectiveResponse",
    "RequestedAttribute",
    "Score",
    "SpanScore",
    "TextInput",
]

# OpenAI omni-moderation's categories: every response names all of them.
OPENAI_CATEGORIES: tuple[str, ...] = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)


# Ceilings checked while the body is validated, so a hostile body costs at most this many
# items (and errors) whatever its size: a list of a million wrong items stops at the
# ceiling instead of yielding a million errors. The configured limits (inputs per call,
# characters per input) are tighter and are checked after, with errors naming the setting.
HARD_MAX_INPUTS = 1024  # PROBEGUARD_SERVE_MAX_INPUTS cannot exceed it
_Text = Annotated[str, Field(max_length=HARD_MAX_TEXT_CHARS)]
_Token = Annotated[str, Field(max_length=HARD_MAX_ID_CHARS)]  # ids, names, tokens
_Short = Annotated[str, Field(max_length=64)]  # attribute names, language codes


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# --- OpenAI ------------------------------------------------------------------


class TextInput(_Request):
    type: Literal["text"]
    text: _Text


class ImageInput(_Request):
    type: Literal["image_url"]
    image_url: Annotated[dict[_Short, object], Field(max_length=8)]


_Part = Annotated[TextInput | ImageInput, Field(discriminator="type")]


class ModerationRequest(_Request):
    """``POST /v1/moderations``: one text, a list of texts, or a list of typed parts."""

    input: (
        _Text
        | Annotated[list[_Text], Field(max_length=HARD_MAX_INPUTS)]
        | Annotated[list[_Part], Field(max_length=HARD_MAX_INPUTS)]
    )
    model: _Token | None = Field(
        None, description="A probe name; OpenAI's model names mean the default probe."
    )


class ModerationResult(BaseModel):
    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]
    category_applied_input_types: dict[str, list[Literal["text", "image"]]]


class ModerationResponse(BaseModel):
    id: str
    model: str
    results: list[ModerationResult]


# --- Perspective -------------------------------------------------------------


class PerspectiveComment(_Request):
    text: _Text
    type: Literal["PLAIN_TEXT"] = "PLAIN_TEXT"


class RequestedAttribute(_Request):
    scoreType: Literal["PROBABILITY"] | None = None
    scoreThreshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None


class PerspectiveRequest(_Request):
    """``POST /v1alpha1/comments:analyze``."""

    comment: PerspectiveComment
    requestedAttributes: Annotated[
        dict[_Short, RequestedAttribute], Field(min_length=1, max_length=64)
    ]
    languages: Annotated[list[_Short], Field(max_length=16)] | None = None
    doNotStore: bool = False
    spanAnnotations: bool = False
    clientToken: _Token | None = None
    sessionId: _Token | None = None
    communityId: _Token | None = None


class Score(BaseModel):
    value: float
    type: Literal["PROBABILITY"] = "PROBABILITY"


class SpanScore(BaseModel):
    begin: int
    end: int
    score: Score


class AttributeScores(BaseModel):
    summaryScore: Score
    spanScores: list[SpanScore] | None = None


class PerspectiveResponse(BaseModel):
    attributeScores: dict[str, AttributeScores]
    languages: list[str]
    clientToken: str | None = None
