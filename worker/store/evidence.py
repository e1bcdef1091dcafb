"""Per-version evidence in Redis: what every scorer saw, and what the human labels said.

Every scorer adds to the counters of the versions it served; the updater (which
consumes the labels) credits each label to the version(s) that judged the message.
The rollout policy (:mod:`worker.rollout.policy`) decides on these numbers, and
``probeguard probe status`` shows them. Writing is best-effort: callers catch
Redis errors, so a Redis hiccup costs evidence, never a batch.

Counts are exact under redelivery: each write is one Lua script (see
:mod:`worker.store.scripts`) that counts only what no earlier delivery counted. A
scored message counts once per Kafka record (a high-water offset per topic partition:
a batch redelivered after a crash between produce and commit, or handled by two members
around a rebalance, counts once, for whichever delivery ran its script first), a label
once per message and head (a marker, set in the same script as its counts), a review
request is charged to the budget once. A script re-run by redis-py after a lost reply
returns its first answer and writes nothing.

The numbers as read (the hash's fields) are :mod:`worker.store.evidence_counts`; what one
decision or label adds to them is :mod:`worker.store.evidence_credit`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import ProbeDecision
from worker.settings import DEFAULTS, Settings
from worker.store import scripts
from worker.store.evidence_counts import Evidence, as_text
from worker.store.evidence_credit import credit_flag, credit_head, decision_of, scored_fields
from worker.store.redis import Keys, keys_for

__all__ = [
    "EvidenceStore",
    "Judgement",
    "ReviewBudget",
    "ReviewCandidate",
    "Truth",
]


@dataclass(frozen=True)
class Truth:
    """What one human label says of its message: whether it deserves a flag (None: the
    label does not say, e.g. it annotates one head of several) and, for each head of a
    multi-head probe it annotates, whether that head should flag."""

    message_id: str
    flag: bool | None = None
    heads: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Judgement:
    """One judged message for the evidence counters: its Kafka record (topic, partition,
    offset; None for an HTTP request, which is never redelivered) and how each probe
    decided it."""

    source: tuple[str, int, int] | None
    decisions: Mapping[str, ProbeDecision]


@dataclass(frozen=True)
class ReviewCandidate:
    """A review request a scored message asks for: ``index`` into the batch's judgements."""

    index: int
    probe: str
    message_id: str


@dataclass(frozen=True)
class ReviewBudget:
    """The review budget's current window: its counter, how many it admits, its TTL."""

    key: str
    limit: int
    ttl_s: int


@dataclass
class _ScoredOps:
    """A batch's evidence increments, as the SCORED script takes them (1-based indexes)."""

    parts: dict[tuple[str, int], int] = field(default_factory=dict)  # (topic, partition)
    ev_keys: dict[str, int] = field(default_factory=dict)  # evidence hash key
    # a message's increments (key index, field, amount, float?) -> its index
    contribs: dict[tuple[tuple[int, str, float, int], ...], int] = field(default_factory=dict)
    recs: list[list[int]] = field(default_factory=list)  # [part, offset, contrib] per message


class EvidenceStore:
    """Reads and writes evidence for every probe under one key prefix."""

    def __init__(
        self,
        client: Any,
        keys: Keys,
        *,
        pairs_max: int = DEFAULTS.evidence_pairs,
        marker_ttl_s: int = DEFAULTS.text_cache_ttl_s,
        cache: Any = None,
        group: str = DEFAULTS.group_scorer,
    ) -> None:
        self.client: Any = client
        self.group = group  # the consumer group whose records count exactly once
        # ``decided`` (per message, TTL) lives in the text cache's Redis; the markers that
        # make counts exact live with the counts, so that one script sets both.
        self.cache: Any = cache if cache is not None else client
        self.keys = keys
        self.pairs_max = pairs_max
        self.marker_ttl_s = marker_ttl_s
        self._scripts: dict[str, Any] = {}

    @classmethod
    def from_settings(cls, client: Any, settings: Settings, *, cache: Any = None) -> EvidenceStore:
        """Under ``settings.redis_prefix``; markers live as long as cached texts; decided
        records are read from ``cache``, the text cache's client, when given."""
        return cls(
            client,
            keys_for(settings),
            pairs_max=settings.evidence_pairs,
            marker_ttl_s=settings.text_cache_ttl_s,
            cache=cache,
            group=settings.group_scorer,
        )

    def _script(self, text: str) -> Any:
        """The registered script (registered on first use: EVALSHA, loaded on NOSCRIPT)."""
        if text not in self._scripts:
            self._scripts[text] = self.client.register_script(text)
        return self._scripts[text]

    # --- scorers -------------------------------------------------------------

    def record_scored(
        self,
        judged: Sequence[Judgement],
        latency_ms: float,
        *,
        heads: Mapping[tuple[str, int], Sequence[str]] | None = None,
        reviews: Sequence[ReviewCandidate] = (),
        budget: ReviewBudget | None = None,
        hashes: Sequence[tuple[str, str, str, int]] = (),
    ) -> list[bool]:
        """Count a batch's decisions and charge its review requests: one script, one round
        trip, exactly once per Kafka record however often it is delivered.

        ``heads``: (probe, version) -> the heads a multi-head version judged (its per-head
        counters). A message whose record (``Judgement.source``) is at or below its
        partition's high-water mark was counted by an earlier delivery (a crash between
        produce and commit, a rebalance mid-batch) and counts no more; nor are its review
        requests charged again: they are re-sent only if that delivery admitted them.
        Returns, per review candidate, whether it is admitted (``budget``: the window's key
        and limit; without one nothing is admitted). ``hashes``: ``(key, field, value,
        ttl_s)`` set in the same round trip (a scorer's drift windows; idempotent). Raises
        Redis errors (the caller's breaker): then nothing was counted, and a redelivery
        counts it.
        """
        ops = self._scored_ops(judged, latency_ms, heads or {})
        markers = [self.keys.review_sent(r.probe, r.message_id) for r in reviews]
        if reviews and budget is None:
            raise ValueError("review candidates need a budget")
        if not ops.contribs and not markers and not hashes:
            return []
        hash_keys: dict[str, int] = {}
        sets = [
            [hash_keys.setdefault(key, len(hash_keys) + 1), name, value, ttl]
            for key, name, value, ttl in hashes
        ]
        args = {
            "np": len(ops.parts),
            "nm": len(markers),
            "hw_ttl": self.marker_ttl_s,
            "mark_ttl": self.marker_ttl_s,
            "once_ttl": scripts.ONCE_TTL_S,
            "budget": budget.limit if budget is not None else 0,
            "window_ttl": budget.ttl_s if budget is not None else 1,
            "recs": ops.recs,
            "contribs": [[list(op) for op in contrib] for contrib in ops.contribs] or [[]],
            "reviews": [[r.index + 1, i + 1] for i, r in enumerate(reviews)],
            "ne": len(ops.ev_keys),
            "sets": sets,
        }
        reply = self._script(scripts.SCORED)(
            keys=[
                self.keys.once(uuid.uuid4().hex),
                budget.key if budget is not None else self.keys.once("no-budget"),
                *(self.keys.counted(self.group, t, p) for t, p in ops.parts),
                *markers,
                *ops.ev_keys,
                *hash_keys,
            ],
            args=[json.dumps(args)],
        )
        flags = as_text(reply).split("|", 1)[1]
        return [f == "1" for f in flags]

    def _scored_ops(
        self,
        judged: Sequence[Judgement],
        latency_ms: float,
        heads: Mapping[tuple[str, int], Sequence[str]],
    ) -> _ScoredOps:
        """The SCORED script's operations for a batch: each message's increments, the same
        ones shared (a batch of like decisions sends one list), keys by 1-based index."""
        ops = _ScoredOps()
        for j in judged:
            increments: list[tuple[int, str, float, int]] = []
            for probe, d in sorted(j.decisions.items()):
                for version, fields in scored_fields(probe, d, latency_ms, heads).items():
                    key = self.keys.evidence(probe, version)
                    k = ops.ev_keys.setdefault(key, len(ops.ev_keys) + 1)
                    increments += [
                        (k, name, round(amount, 3), int(name == "lat_ms"))
                        for name, amount in sorted(fields.items())
                        if amount
                    ]
            contribs = ops.contribs
            c = contribs.setdefault(tuple(increments), len(contribs) + 1) if increments else 0
            if j.source is None:
                ops.recs.append([0, 0, c])
            else:
                topic, partition, offset = j.source
                part = ops.parts.setdefault((topic, partition), len(ops.parts) + 1)
                ops.recs.append([part, offset, c])
        return ops

    def record_refusal(self, probe: str, version: int, reason: str) -> None:
        key = self.keys.evidence(probe, version)
        pipe = self.client.pipeline(transaction=False)
        pipe.hincrby(key, "errors", 1)
        pipe.hset(key, "error", reason[:500])
        pipe.hsetnx(key, "error_at", f"{time.time():.3f}")
        pipe.execute()

    def record_load(self, probe: str, version: int) -> None:
        """A scorer loaded and verified ``version`` (against a refusal elsewhere, this says
        the refusing scorer is misconfigured, not the version bad)."""
        self.client.hincrby(self.keys.evidence(probe, version), "loads", 1)

    # --- the updater ---------------------------------------------------------

    def record_labels(self, probe: str, labeled: Sequence[tuple[str, bool]]) -> int:
        """Credit ``(message_id, truth)`` pairs (truth: the message deserves a flag); see
        :meth:`record_truths`."""
        return self.record_truths(probe, [Truth(mid, truth) for mid, truth in labeled])

    def record_truths(self, probe: str, truths: Sequence[Truth]) -> int:
        """Credit what each label says to the version(s) that judged its message: the
        flag decision, and each head it annotates (multi-head decisions only).

        Each counts exactly once, however often a label is redelivered and wherever the
        updater dies: a marker per message (and per message and head) is set in the same
        script as the counts it guards. Messages no scorer recorded a decision for are
        skipped. Returns how many labels were credited.
        """
        if not truths:
            return 0
        raw = self.cache.mget([self.keys.decided(t.message_id) for t in truths])
        # (marker key, label index, decision, head or None for the flag decision)
        marks: list[tuple[str, int, ProbeDecision, str | None]] = []
        for k, (t, blob) in enumerate(zip(truths, raw, strict=True)):
            d = decision_of(blob, probe)
            if d is None:
                continue
            if t.flag is not None:
                marks.append((self.keys.labeled(probe, t.message_id), k, d, None))
            if d.h is not None:
                marks += [
                    (self.keys.labeled_head(probe, head, t.message_id), k, d, head)
                    for head in t.heads
                ]
        if not marks:
            return 0
        targets: dict[str, int] = {}  # evidence hash or pairs list -> 1-based index
        payload: list[list[list[list[Any]]]] = []
        for _, k, d, head in marks:
            counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            pairs: dict[int, list[str]] = defaultdict(list)
            t = truths[k]
            if head is None:
                credit_flag(counts, pairs, d, bool(t.flag))
            else:
                credit_head(counts, d, head, t.heads[head])
            ops = [
                [targets.setdefault(self.keys.evidence(probe, v), len(targets) + 1), f, n, 0]
                for v, fields in counts.items()
                for f, n in fields.items()
            ]
            pushes = [
                [targets.setdefault(self.keys.pairs(probe, v), len(targets) + 1), item]
                for v, items in pairs.items()
                for item in items
            ]
            payload.append([ops, pushes])
        args = {
            "nm": len(marks),
            "ttl": self.marker_ttl_s,
            "once_ttl": scripts.ONCE_TTL_S,
            "pairs_max": self.pairs_max,
            "marks": payload,
        }
        reply = self._script(scripts.CREDIT)(
            keys=[self.keys.once(uuid.uuid4().hex), *(m[0] for m in marks), *targets],
            args=[json.dumps(args)],
        )
        fresh = [m for m, flag in zip(marks, as_text(reply), strict=True) if flag == "1"]
        return len({k for _, k, _, _ in fresh})

    # --- who labeled (kept apart from the credit above) -------------------------

    def record_labelers(self, probe: str, labeled: Sequence[tuple[str, str]]) -> None:
        """Count ``(message_id, labeler_id)`` per version whose own decision the label is
        credited against (decided or shadowed; ``labelers:{v}``, labeler -> labels), so the
        policy can require several distinct labelers before it promotes.

        Like :meth:`record_truths` only the first label of a message counts (a marker per
        message, set in the same script as the count): a later label of another labeler
        was not credited, and must not count as a second opinion; a redelivered label
        counts once, and a crash or a lost reply neither loses nor doubles it."""
        if not labeled:
            return
        raw = self.cache.mget([self.keys.decided(m) for m, _ in labeled])
        markers: list[str] = []
        targets: dict[str, int] = {}  # labelers hash -> 1-based index
        payload: list[list[list[list[Any]]]] = []
        for (message_id, labeler), blob in zip(labeled, raw, strict=True):
            d = decision_of(blob, probe)
            versions = sorted({v for v in (d.v, d.sv) if v}) if d is not None else []
            if not versions:
                continue
            markers.append(self.keys.credited_by(probe, message_id))
            ops = [
                [targets.setdefault(self.keys.labelers(probe, v), len(targets) + 1), labeler, 1, 0]
                for v in versions
            ]
            payload.append([ops, []])
        if not markers:
            return
        # One CREDIT script: each marker and its counts together, as in record_truths.
        args = {
            "nm": len(markers),
            "ttl": self.marker_ttl_s,
            "once_ttl": scripts.ONCE_TTL_S,
            "pairs_max": 0,
            "marks": payload,
        }
        self._script(scripts.CREDIT)(
            keys=[self.keys.once(uuid.uuid4().hex), *markers, *targets], args=[json.dumps(args)]
        )

    # --- reading -------------------------------------------------------------

    def read(self, probe: str, version: int) -> Evidence:
        return self.read_many(probe, [version])[version]

    def read_many(self, probe: str, versions: Iterable[int]) -> dict[int, Evidence]:
        versions = list(versions)
        pipe = self.client.pipeline(transaction=False)
        for v in versions:
            pipe.hgetall(self.keys.evidence(probe, v))
            pipe.hlen(self.keys.labelers(probe, v))
        got = pipe.execute()
        return {
            v: dataclasses.replace(Evidence.from_hash(v, got[2 * k]), labelers=int(got[2 * k + 1]))
            for k, v in enumerate(versions)
        }

    def auprc(self, probe: str, version: int) -> float:
        """AUPRC of the version's flag score on its labeled messages (NaN without positives)."""
        import numpy as np

        from probes.metrics import average_precision  # torch: only when asked (CLI start-up)

        raw = self.client.lrange(self.keys.pairs(probe, version), 0, -1)
        if not raw:
            return math.nan
        rows = np.array([[float(x) for x in as_text(r).split()] for r in raw])  # [N, 2]
        return average_precision(rows[:, 1] > 0.5, rows[:, 0])
