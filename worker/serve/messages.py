"""What both APIs of ``probeguard serve`` make of a request's texts and give back: each
text as a :class:`~schemas.ChatMessage` in its conversation (checked against the
configured limits), and each scored message's :class:`~schemas.ProbeResult`."""

from __future__ import annotations

import re

from pydantic import ValidationError

from schemas import ChatMessage, Limits, ProbeResult, describe_error, utcnow
from worker.serve.batcher import Scored
from worker.serve.errors import ApiError
from worker.serve.service import unreadable

__all__ = [
    "CONVERSATION_HEADER",
    "as_message",
    "conversation_key",
    "label_score",
    "probe_result",
    "unreadable_input",
]

CONVERSATION_HEADER = "x-probeguard-conversation"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=\-]{0,127}")


def conversation_key(value: str | None, fallback: str) -> str:
    """The canary assignment key: the caller's conversation or user id when it is a valid
    id, else the request's own id."""
    return value if value and _ID.fullmatch(value) else fallback


def as_message(
    message_id: str, conversation: str, text: str, param: str, limits: Limits
) -> ChatMessage:
    """The input as a chat message, checked once, by the schema, against the configured
    ``limits`` (a text over the default limit but within ``PROBEGUARD_MAX_TEXT_CHARS`` is
    scored); a text over its limit is a 413, any other refusal a 400."""
    try:
        return ChatMessage.build(
            limits,
            message_id=message_id,
            conversation_id=conversation,
            text=text,
            created_at=utcnow(),
        )
    except ValidationError as exc:
        max_chars = limits.max_text_chars
        if len(text) > max_chars:  # what the schema refused (its other checks are moot)
            raise ApiError(
                413,
                f"{param} has {len(text)} characters; at most {max_chars} "
                "(PROBEGUARD_MAX_TEXT_CHARS)",
                param=param,
                code="text_too_long",
            ) from None
        raise ApiError(400, describe_error(exc)[1], param=param) from None


def unreadable_input(param: str, text: str) -> ApiError:
    """The refusal of a text with no token the model can read."""
    return ApiError(
        400,
        f"{param} has nothing the model can read: {unreadable(text)}",
        param=param,
        code="unreadable_input",
    )


def probe_result(scored: Scored, pos: int, probe: str) -> ProbeResult:
    """``probe``'s result for the message at ``pos`` of a scored batch; a 500 when that
    message could not be scored."""
    verdict = scored.verdicts.get(pos)
    if verdict is None:
        why = scored.errors.get(pos, "not scored")
        raise ApiError(500, f"an input could not be scored: {why}", code="unscorable")
    return next(r for r in verdict.results if r.probe == probe)


def label_score(result: ProbeResult, label: str) -> float:
    """A label's score as the APIs answer it (6 decimals; 0 for a label not scored)."""
    return round(result.scores.get(label, 0.0), 6)
