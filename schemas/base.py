"""The base of every wire model: strict, frozen, versioned, decoded from bytes."""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from schemas.limits import DEFAULT_LIMITS, Limits

__all__ = ["WireModel", "describe_error"]


class WireModel(BaseModel):
    """Strict wire model: unknown fields are errors, instances are immutable.

    Subclasses declare ``schema_version: Literal[N] = N``; a payload from a
    newer or older writer fails validation on that field instead of being
    half-understood.
    """

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        str_strip_whitespace=False,
        validate_default=True,
    )

    @classmethod
    def decode(cls, raw: bytes | str, limits: Limits = DEFAULT_LIMITS) -> Self:
        """Decode JSON bytes, enforcing ``limits``. Raises ``pydantic.ValidationError``."""
        return cls.model_validate_json(raw, context={"limits": limits})

    @classmethod
    def build(cls, limits: Limits, /, **fields: Any) -> Self:
        """Construct a model to send, checked against ``limits``.

        A plain ``Model(...)`` applies the default limits, so a deployment that raised them
        (``PROBEGUARD_MAX_TEXT_CHARS``, ``_MAX_LABELS``) would decode a message and then
        fail to build the verdict or review request for it. Services build what they send
        with their configured limits::

            >>> from schemas import ReviewRequest, utcnow
            >>> long = Limits(max_text_chars=100_000)
            >>> req = ReviewRequest.build(long, message_id="m-1", text="x" * 40_000,
            ...     probe="toxicity", version=1, scores={"toxic": 0.5}, reason="audit",
            ...     created_at=utcnow())
            >>> len(req.text)
            40000
        """
        return cls.model_validate(fields, context={"limits": limits})

    def encode(self) -> bytes:
        """Compact JSON bytes, the inverse of :meth:`decode`."""
        return self.model_dump_json(exclude_none=False).encode()


def describe_error(exc: ValidationError) -> tuple[str, str]:
    """A short ``(kind, message)`` pair for a dead letter or a log line.

    ``kind`` is ``invalid_json`` when the bytes were not JSON at all, else
    ``schema``; ``message`` names every offending field with pydantic's reason.
    """
    errors: list[Any] = exc.errors(include_url=False, include_input=False)
    if errors and errors[0]["type"] in {"json_invalid", "json_type"}:
        return "invalid_json", str(errors[0]["msg"])
    parts = []
    for err in errors[:10]:
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    more = len(errors) - 10
    if more > 0:
        parts.append(f"(+{more} more)")
    return "schema", "; ".join(parts)
