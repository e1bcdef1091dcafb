"""What a judged batch leaves behind in Redis, best-effort behind breakers: each
decision in its version's evidence counters, review requests charged to the budget shared
by every scorer and server, the drift windows due, and each message's text and how each
probe decided it (the text cache, for label joins), as each message's :class:`Retain`
allows. :class:`~worker.scoring.engine.ScoringEngine` writes through one :class:`Ledger`.

A Redis outage costs what it holds, never a batch: evidence is lost and reviews pass a
local quota while the registry's Redis is away; label joins need labels that carry their
text while the text cache is.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from schemas import ChatMessage, DecidedRecord, ProbeDecision, ReviewRequest, utcnow
from worker.scoring import review_routing
from worker.scoring.batch import BatchScores
from worker.scoring.drift import DriftMonitor
from worker.scoring.metrics import ScorerMetrics
from worker.settings import Settings
from worker.store.evidence import EvidenceStore, Judgement, ReviewBudget, ReviewCandidate
from worker.store.redis import Breaker, Keys

__all__ = ["DRIFT_SNAPSHOT_TTL_S", "Ledger", "Retain"]

log = logging.getLogger(__name__)
# A scorer's drift window in Redis outlives it by this much (the console reads recent ones).
DRIFT_SNAPSHOT_TTL_S = 3600


class Retain(enum.IntEnum):
    """What of a judged message is kept (each level keeps what the ones below keep)."""

    NOTHING = 0
    COUNT = 1  # its decision in the version's evidence counters
    ALL = 2  # and its text and decision for label joins; it may be queued for review


@dataclass
class Ledger:
    """The Redis writes of one engine (``redis``: the registry's; ``text_redis``: the text
    cache's, the same one unless configured apart)."""

    settings: Settings
    redis: Any
    text_redis: Any
    keys: Keys
    worker_id: str
    metrics: ScorerMetrics
    drift: DriftMonitor
    review_policy: review_routing.ReviewPolicy

    def __post_init__(self) -> None:
        self.local_review_budget = review_routing.LocalBudget(self.review_policy)
        self.evidence = EvidenceStore.from_settings(
            self.redis, self.settings, cache=self.text_redis
        )
        # One breaker for every best-effort Redis call: after a failure, batches skip Redis
        # for a few seconds rather than each waiting on a socket timeout.
        self.redis_breaker = Breaker()
        self.text_breaker = Breaker()  # the text cache fails on its own (e.g. full)

    def record(
        self,
        scores: BatchScores,
        latency_ms: float,
        keep: list[Retain],
        sources: Sequence[tuple[str, int, int]] | None,
        candidates: list[tuple[int, ReviewRequest]],
    ) -> list[tuple[int, ReviewRequest]]:
        """Evidence per version, the review budget and the drift windows due, in one script
        (one round trip): each
        message counts, and each review request is charged, once per Kafka record however
        often it is delivered. Returns the review requests the budget admits: a fixed window
        of ``review_window_s`` seconds shared by every scorer, so a flood cannot swamp the
        reviewers however many scorers run.

        Best-effort behind the breaker: while Redis fails, evidence is lost and reviews pass
        this scorer's own window of ``review_local_max_per_window`` instead (held back, they
        would never reach a human: the batch's offsets are committed; all admitted, they
        could flood the reviewers).
        """
        decisions: dict[int, dict[str, ProbeDecision]] = defaultdict(dict)
        for (pos, probe), d in scores.decisions.items():
            if keep[pos] >= Retain.COUNT:
                decisions[pos][probe] = d
        if not decisions and not candidates:
            return []
        if not self.redis_breaker.ready():
            self.metrics.redis_skipped.inc()
            return self._admit_locally(candidates)
        positions = sorted(decisions.keys() | {pos for pos, _ in candidates})
        index = {pos: i for i, pos in enumerate(positions)}
        judged = [
            Judgement(sources[pos] if sources is not None else None, decisions.get(pos, {}))
            for pos in index
        ]
        policy = self.review_policy
        budget = ReviewBudget(
            self.keys.review_budget(policy.window(time.time())),
            policy.max_per_window,
            2 * policy.window_s,
        )
        wanted = [ReviewCandidate(index[pos], r.probe, r.message_id) for pos, r in candidates]
        try:
            ok = self.evidence.record_scored(
                judged,
                latency_ms,
                heads=scores.heads,
                reviews=wanted,
                budget=budget,
                hashes=[
                    (self.keys.drift(probe, version), self.worker_id, snap.encode().decode(), ttl)
                    for (probe, version), snap in self.drift.snapshots(utcnow())
                    for ttl in (DRIFT_SNAPSHOT_TTL_S,)
                ],
            )
        except (redis.RedisError, OSError) as exc:
            self.metrics.redis_errors.inc()
            self.redis_breaker.trip(exc)
            log.warning(
                "evidence and review budget unavailable (%s); admitting up to %d reviews per "
                "window locally",
                exc,
                policy.local_max_per_window,
            )
            return self._admit_locally(candidates)
        return [c for c, admit in zip(candidates, ok, strict=True) if admit]

    def _admit_locally(
        self, candidates: list[tuple[int, ReviewRequest]]
    ) -> list[tuple[int, ReviewRequest]]:
        """The candidates this scorer's own budget admits while the shared one is away."""
        return candidates[: self.local_review_budget.admit(len(candidates), time.time())]

    def remember(
        self, messages: Sequence[ChatMessage], scores: BatchScores, keep: list[Retain]
    ) -> None:
        """Text and decisions per message, for label joins: best-effort, one round trip to
        the text cache behind its own breaker (a full cache costs label joins, never the
        batch, nor the evidence)."""
        by_pos: dict[int, dict[str, ProbeDecision]] = defaultdict(dict)
        for (pos, probe), d in scores.decisions.items():
            if keep[pos] >= Retain.ALL:
                by_pos[pos][probe] = d
        if any(keep[pos] >= Retain.ALL for pos in scores.results):
            self._cache_texts(messages, scores, by_pos, keep)

    def _cache_texts(
        self,
        messages: Sequence[ChatMessage],
        scores: BatchScores,
        by_pos: dict[int, dict[str, ProbeDecision]],
        keep: list[Retain],
    ) -> None:
        # On the registry's own Redis, the text cache also waits out that Redis's breaker:
        # tripped by the probe watcher or another write, it means the server is away, and
        # a write now would only cost the batch one more socket timeout.
        shared = self.text_redis is self.redis
        if not self.text_breaker.ready() or (shared and not self.redis_breaker.ready()):
            self.metrics.redis_skipped.inc()
            return
        ttl, cap = self.settings.text_cache_ttl_s, self.settings.text_cache_max_bytes
        try:
            pipe = self.text_redis.pipeline(transaction=False)
            for pos in scores.results:
                if keep[pos] < Retain.ALL:
                    continue
                msg = messages[pos]
                text = msg.text.encode()
                # Both are written once (NX): the first text and the first judgement of a
                # message id stay together. A redelivery scored after a hot swap must not
                # move a label's credit to a version whose evidence never counted the
                # message (the first delivery's script counted it), and a reused id must
                # not put another text beside the first one's decision: a label joined to
                # it would train on a text that was never judged so.
                if len(text) <= cap:
                    pipe.set(self.keys.text(msg.message_id), text, ex=ttl, nx=True)
                if by_pos.get(pos):
                    record = DecidedRecord(p=by_pos[pos]).encode()
                    pipe.set(self.keys.decided(msg.message_id), record, ex=ttl, nx=True)
            pipe.execute()
            self.text_breaker.reset()
        except (redis.RedisError, OSError) as exc:
            self.metrics.redis_errors.inc()
            self.text_breaker.trip(exc)
            log.warning("text cache write failed (%s); labels may need to carry text", exc)

    def refused(self, name: str, version: int, why: str) -> None:
        self.metrics.refused.labels(name).inc()
        try:
            self.evidence.record_refusal(name, version, f"{self.worker_id}: {why}")
        except (redis.RedisError, OSError) as exc:
            self.metrics.redis_errors.inc()
            log.warning("could not record the refusal of %s v%d (%s)", name, version, exc)

    def loaded(self, name: str, version: int) -> None:
        try:
            self.evidence.record_load(name, version)
        except (redis.RedisError, OSError) as exc:
            self.metrics.redis_errors.inc()
            log.warning("could not record the load of %s v%d (%s)", name, version, exc)

    def degraded(self) -> str:
        """What a Redis outage costs while scoring goes on (for ``/readyz``: still ready,
        since every message is scored; the note says what is missing)."""
        notes = []
        registry = self.redis_breaker.outage()
        if registry is not None:
            notes.append(
                f"Redis {registry}: serving the last good probes; no evidence, and review "
                "requests within this scorer's local quota, until it answers"
            )
        cache = self.text_breaker.outage()
        if cache is not None:
            notes.append(f"the text cache {cache}: labels must carry their text")
        return "".join(f"; degraded: {n}" for n in notes)
