"""Which scored messages go to human review: a pure function of the numbers, no I/O.

    flag score in [low, high]                    -> "uncertain" (a human decides)
    else sticky_fraction(message id) < audit share -> "audit" (a steady random sample)
    else                                           -> no review

A message is sampled for audit or not whatever probe or version scored it (the fraction
hashes only the message id), so a reviewer sees whole messages, not a probe's share.
Requests then pass a budget shared by all scorers: at most ``max_per_window`` per
``window_s`` seconds, each charged once however often its message is redelivered (the
scorer counts the window in Redis: :meth:`worker.store.evidence.EvidenceStore.record_scored`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from worker.scoring.batch import sticky_fraction

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = ["ReviewPolicy", "ReviewReason", "route"]

ReviewReason = Literal["uncertain", "audit"]  # ReviewRequest.reason


@dataclass(frozen=True)
class ReviewPolicy:
    low: float = 0.35  # flag scores in [low, high] are uncertain: a human decides
    high: float = 0.65
    audit_share: float = 0.01  # share of messages sampled for audit, sticky per message
    max_per_window: int = 120  # review requests admitted per window, all scorers together
    window_s: int = 60

    @classmethod
    def from_settings(cls, settings: Settings) -> ReviewPolicy:
        return cls(
            low=settings.review_low,
            high=settings.review_high,
            audit_share=settings.review_audit_share,
            max_per_window=settings.review_max_per_window,
            window_s=settings.review_window_s,
        )

    def window(self, now_s: float) -> int:
        """The budget window that ``now_s`` (Unix seconds) falls in."""
        return int(now_s // self.window_s)


def route(policy: ReviewPolicy, message_id: str, flag_score: float | None) -> ReviewReason | None:
    """Why one probe's result for ``message_id`` goes to review, or None when it does not.

    ``flag_score`` is the probe's score for its flag labels (None: the probe flags
    nothing, so it is never uncertain; audit sampling still applies).

    >>> p = ReviewPolicy(low=0.4, high=0.6, audit_share=0.0)
    >>> route(p, "m-1", 0.5), route(p, "m-1", 0.9), route(p, "m-1", None)
    ('uncertain', None, None)
    >>> route(ReviewPolicy(audit_share=1.0), "m-1", 0.9)
    'audit'
    """
    if flag_score is not None and policy.low <= flag_score <= policy.high:
        return "uncertain"
    if sticky_fraction(message_id, "audit") < policy.audit_share:
        return "audit"
    return None
