"""Which scored messages go to human review: a pure function of the numbers, no I/O.

    flag score in [low, high]                    -> "uncertain" (a human decides)
    else sticky_fraction(message id) < audit share -> "audit" (a steady random sample)
    else                                           -> no review

A message is sampled for audit or not whatever probe or version scored it (the fraction
hashes only the message id), so a reviewer sees whole messages, not a probe's share.
Requests then pass a budget shared by all scorers: at most ``max_per_window`` per
``window_s`` seconds, each charged once however often its message is redelivered (the
scorer counts the window in Redis: :meth:`worker.store.evidence.EvidenceStore.record_scored`).
While that counter is unreachable, each scorer admits up to ``local_max_per_window`` per
window on its own (:class:`LocalBudget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from worker.scoring.served import sticky_fraction

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = ["LocalBudget", "ReviewPolicy", "ReviewReason", "route"]

ReviewReason = Literal["uncertain", "audit"]  # ReviewRequest.reason


@dataclass(frozen=True)
class ReviewPolicy:
    low: float = 0.35  # flag scores in [low, high] are uncertain: a human decides
    high: float = 0.65
    audit_share: float = 0.01  # share of messages sampled for audit, sticky per message
    max_per_window: int = 120  # review requests admitted per window, all scorers together
    window_s: int = 60
    local_max_per_window: int = 12  # one scorer on its own, while the shared count is away
    salt: str = ""  # secret, so the sample cannot be steered by choosing ids (see Settings)

    @classmethod
    def from_settings(cls, settings: Settings) -> ReviewPolicy:
        return cls(
            low=settings.review_low,
            high=settings.review_high,
            audit_share=settings.review_audit_share,
            max_per_window=settings.review_max_per_window,
            window_s=settings.review_window_s,
            local_max_per_window=settings.review_local_max_per_window,
            salt=settings.routing_salt,
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
    if sticky_fraction(message_id, "audit" + policy.salt) < policy.audit_share:
        return "audit"
    return None


class LocalBudget:
    """One process's own review budget, for while the shared counter cannot be read.

    Dropping every candidate during an outage (one slow read trips the breaker for 5-60 s)
    meant those messages never reached a human; admitting all of them would flood the
    reviewers. A per-process fixed window in between bounds the flood to the number of
    scorers times ``local_max_per_window``.

    >>> b = LocalBudget(ReviewPolicy(local_max_per_window=3, window_s=60))
    >>> b.admit(2, now_s=0.0), b.admit(2, now_s=1.0), b.admit(2, now_s=61.0)
    (2, 1, 2)
    """

    def __init__(self, policy: ReviewPolicy) -> None:
        self.policy = policy
        self._window = -1
        self._used = 0

    def admit(self, wanted: int, now_s: float) -> int:
        window = self.policy.window(now_s)
        if window != self._window:
            self._window, self._used = window, 0
        n = max(0, min(wanted, self.policy.local_max_per_window - self._used))
        self._used += n
        return n
