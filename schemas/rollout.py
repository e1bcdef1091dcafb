"""What scorers remember about each decision, for evidence when the human label arrives.

A scorer writes one :class:`DecidedRecord` per message to Redis (``{prefix}:decided:{mid}``,
with the text cache's TTL); the updater reads it back when a label for that message
arrives and credits the label to the version(s) that judged the message. Field names
are short on purpose: one record per message is kept for days.

A multi-head probe's decision also names the heads that flagged (``h``; ``sh`` for the
shadowed canary): a head flags when it predicts one of its flag labels in the version's
spec, whatever the deployment's ``PROBEGUARD_FLAG_HEADS`` (evidence judges every head, so a
broken head is caught before it is allowed to flag). Only the heads that flagged are
listed, usually none; a single-head probe's record has neither field (absent: one head),
so its records read exactly as before.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.base import WireModel
from schemas.messages import ProbeName

__all__ = ["DecidedRecord", "ProbeDecision"]

Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Version = Annotated[int, Field(ge=1)]


class ProbeDecision(WireModel):
    """How one probe judged one message."""

    v: Annotated[int, Field(ge=0)]  # the version that decided (0 = a bootstrap file)
    f: bool  # its flag decision
    s: Probability | None = None  # its flag score (highest probability among flag labels)
    # The canary being trialed when the *live* version decided: this decision is the
    # canary's baseline (live's numbers over the same period).
    c: Version | None = None
    # Shadow mode: the canary's version, flag decision and flag score (it did not act).
    sv: Version | None = None
    sf: bool | None = None
    ss: Probability | None = None
    # A multi-head probe: the heads that flagged (decided; shadowed canary). None: one head.
    h: Annotated[list[ProbeName], Field(max_length=64)] | None = None
    sh: Annotated[list[ProbeName], Field(max_length=64)] | None = None


class DecidedRecord(WireModel):
    schema_version: Literal[1] = 1
    p: dict[ProbeName, ProbeDecision]  # probe name -> decision

    def encode(self) -> bytes:
        """Compact JSON; absent optional fields are left out."""
        return self.model_dump_json(exclude_none=True).encode()
