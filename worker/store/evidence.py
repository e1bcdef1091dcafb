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

Keys: ``evidence``, ``pairs``, ``labeled``, ``counted``, ``review_sent`` and ``decided``
in :class:`worker.store.redis.Keys`. ``pairs`` is a list of "flag_score truth" (newest
first, at most ``pairs_max``). Hash fields of ``evidence``:

==============  ==============================================================
``n``           messages the version decided
``flags``       of those, flagged
``lat_ms``      sum of the verdict latency (ms) of those messages
``sh_n``        messages it scored in shadow mode (live decided)
``sh_flags``    of those, the ones it would have flagged
``sh_agree``    of those, the ones where its flag decision matched live's
``bl_n``        messages the *live* version decided while this one was the canary
``bl_flags``    of those, flagged (the canary's baseline flag rate)
``tp fp fn tn`` labeled confusion of its own flag decisions (decided or shadowed)
``bl_tp`` …     labeled confusion of live's decisions while this one was the canary
``errors``      scorers that refused to load it (hash, fingerprint, signature, …)
``error``       the last refusal reason
``error_at``    when the first refusal was recorded (epoch seconds)
``loads``       scorers that loaded and verified it
``h.<head>.*``  a multi-head version's numbers per head, with the names above:
                ``n flags sh_n sh_flags bl_n bl_flags``, the confusion cells and
                ``bl_`` ones (a head flags when it predicts one of its flag labels)
==============  ==============================================================

Beside the hash, ``labelers:{v}`` counts the credited labels per labeler
(:meth:`EvidenceStore.record_labelers`); :attr:`Evidence.labelers` is how many there are.

Every head of a multi-head version that has a flag label judges every message the
version decides (or shadows), so its ``n`` is the version's; a head appears only in the
versions that have it. A label is credited per head for the heads it annotates (see
:func:`worker.learning.labels.label_truths`), once per message and head.
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

from pydantic import ValidationError

from probes.metrics import precision_recall_f1
from schemas import DecidedRecord, ProbeDecision
from worker.settings import DEFAULTS, Settings
from worker.store import scripts
from worker.store.redis import Keys, keys_for

__all__ = [
    "Confusion",
    "Counts",
    "Evidence",
    "EvidenceStore",
    "Judgement",
    "ReviewBudget",
    "ReviewCandidate",
    "Truth",
]


@dataclass(frozen=True)
class Confusion:
    """Counts of a flag decision against human truth."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0

    @property
    def labeled(self) -> int:
        return self.tp + self.fp + self.fn + self.tn

    @property
    def precision(self) -> float:
        return precision_recall_f1(self.tp, self.fp, self.fn)[0]

    @property
    def recall(self) -> float:
        return precision_recall_f1(self.tp, self.fp, self.fn)[1]

    @property
    def f1(self) -> float:
        """F1 of the flag decision; NaN without labels.

        With labels but nothing to flag and nothing flagged (``tp + fp + fn == 0``) the
        decisions were all correct, so F1 is 1.0 rather than undefined.
        """
        if not self.labeled:
            return math.nan
        if self.tp + self.fp + self.fn == 0:
            return 1.0
        return precision_recall_f1(self.tp, self.fp, self.fn)[2]


@dataclass(frozen=True, kw_only=True)
class Counts:
    """Messages, flags and labeled confusion: of a whole version, or of one of its heads."""

    messages: int = 0
    flags: int = 0
    shadow_messages: int = 0
    shadow_flags: int = 0
    baseline_messages: int = 0
    baseline_flags: int = 0
    labels: Confusion = field(default_factory=Confusion)
    baseline_labels: Confusion = field(default_factory=Confusion)

    @staticmethod
    def counters(h: Mapping[str, str], prefix: str = "") -> dict[str, Any]:
        """The counters under ``prefix`` of a decoded hash, as keyword arguments."""

        def i(name: str) -> int:
            return int(float(h.get(prefix + name, 0)))

        return {
            "messages": i("n"),
            "flags": i("flags"),
            "shadow_messages": i("sh_n"),
            "shadow_flags": i("sh_flags"),
            "baseline_messages": i("bl_n"),
            "baseline_flags": i("bl_flags"),
            "labels": Confusion(i("tp"), i("fp"), i("fn"), i("tn")),
            "baseline_labels": Confusion(i("bl_tp"), i("bl_fp"), i("bl_fn"), i("bl_tn")),
        }

    @property
    def scored(self) -> int:
        """Messages it judged, deciding or in shadow."""
        return self.messages + self.shadow_messages

    @property
    def scored_flags(self) -> int:
        return self.flags + self.shadow_flags

    @property
    def flag_rate(self) -> float:
        return self.scored_flags / self.scored if self.scored else math.nan


@dataclass(frozen=True)
class Evidence(Counts):
    """The numbers of one version (see the module docstring for each field's meaning);
    ``heads``: per head of a multi-head version (empty for a single-head one)."""

    version: int
    latency_ms_sum: float = 0.0
    shadow_agree: int = 0
    errors: int = 0
    last_error: str = ""
    error_since: float | None = None
    loads: int = 0
    heads: Mapping[str, Counts] = field(default_factory=dict)
    labelers: int = 0  # distinct labelers of the labels credited to it (``labelers:{v}``)

    @classmethod
    def from_hash(cls, version: int, raw: dict[bytes, bytes] | dict[str, str]) -> Evidence:
        h = {_text(k): _text(v) for k, v in raw.items()}
        names = sorted({k.split(".")[1] for k in h if k.startswith("h.") and k.count(".") == 2})
        return cls(
            version=version,
            **Counts.counters(h),
            latency_ms_sum=float(h.get("lat_ms", 0.0)),
            shadow_agree=int(float(h.get("sh_agree", 0))),
            errors=int(float(h.get("errors", 0))),
            last_error=h.get("error", ""),
            error_since=float(h["error_at"]) if "error_at" in h else None,
            loads=int(float(h.get("loads", 0))),
            heads={name: Counts(**Counts.counters(h, f"h.{name}.")) for name in names},
        )

    @property
    def latency_ms(self) -> float:
        """Mean verdict latency of the messages it decided."""
        return self.latency_ms_sum / self.messages if self.messages else math.nan

    @property
    def agreement(self) -> float:
        """Share of shadowed messages where it agreed with live's flag decision."""
        return self.shadow_agree / self.shadow_messages if self.shadow_messages else math.nan


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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _cell(flagged: bool, truth: bool) -> str:
    return ("tp" if truth else "fp") if flagged else ("fn" if truth else "tn")


def _count_heads(
    into: dict[str, float], judged: Iterable[str], flagged: Sequence[str] | None, kind: str
) -> None:
    """Per-head message and flag counts (``kind``: "", "bl_" or "sh_") of one decision."""
    if flagged is None:
        return  # a single-head decision
    for head in judged:
        into[f"h.{head}.{kind}n"] += 1
        into[f"h.{head}.{kind}flags"] += head in flagged


def _scored_fields(
    probe: str,
    d: ProbeDecision,
    latency_ms: float,
    heads: Mapping[tuple[str, int], Sequence[str]],
) -> dict[int, dict[str, float]]:
    """What one decision adds to the counters, per version (see the module docstring)."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    if d.v > 0:  # version 0 is a bootstrap file, not a registry version
        own = out[d.v]
        own["n"] += 1
        own["flags"] += d.f
        own["lat_ms"] += latency_ms
        _count_heads(own, heads.get((probe, d.v), ()), d.h, "")
    if d.c is not None:
        base = out[d.c]
        base["bl_n"] += 1
        base["bl_flags"] += d.f
        _count_heads(base, heads.get((probe, d.v), ()), d.h, "bl_")
    if d.sv is not None and d.sf is not None:
        shadow = out[d.sv]
        shadow["sh_n"] += 1
        shadow["sh_flags"] += d.sf
        shadow["sh_agree"] += d.sf == d.f
        _count_heads(shadow, heads.get((probe, d.sv), ()), d.sh, "sh_")
    return out


def _decision(blob: bytes | None, probe: str) -> ProbeDecision | None:
    if blob is None:
        return None
    try:
        return DecidedRecord.decode(blob).p.get(probe)
    except ValidationError:
        return None


def _credit_flag(
    counts: dict[int, dict[str, int]], pairs: dict[int, list[str]], d: ProbeDecision, truth: bool
) -> None:
    if d.v > 0:
        counts[d.v][_cell(d.f, truth)] += 1
        if d.s is not None:
            pairs[d.v].append(f"{d.s:.4f} {int(truth)}")
    if d.c is not None:
        counts[d.c]["bl_" + _cell(d.f, truth)] += 1
    if d.sv is not None and d.sf is not None:
        counts[d.sv][_cell(d.sf, truth)] += 1
        if d.ss is not None:
            pairs[d.sv].append(f"{d.ss:.4f} {int(truth)}")


def _credit_head(
    counts: dict[int, dict[str, int]], d: ProbeDecision, head: str, truth: bool
) -> None:
    """One head's cell for each version that judged the message. A version without that
    head counts as not flagging it; the policy and the status compare a head only where
    the version judged messages with it."""
    if d.h is None:
        return
    if d.v > 0:
        counts[d.v][f"h.{head}.{_cell(head in d.h, truth)}"] += 1
    if d.c is not None:
        counts[d.c][f"h.{head}.bl_{_cell(head in d.h, truth)}"] += 1
    if d.sv is not None and d.sh is not None:
        counts[d.sv][f"h.{head}.{_cell(head in d.sh, truth)}"] += 1


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
        judged_heads = heads or {}
        parts: dict[tuple[str, int], int] = {}  # (topic, partition) -> 1-based index
        ev_keys: dict[str, int] = {}  # evidence key -> 1-based index
        contribs: dict[tuple[tuple[int, str, float, int], ...], int] = {}
        recs: list[list[int]] = []
        for j in judged:
            ops: list[tuple[int, str, float, int]] = []
            for probe, d in sorted(j.decisions.items()):
                for version, fields in _scored_fields(probe, d, latency_ms, judged_heads).items():
                    k = ev_keys.setdefault(self.keys.evidence(probe, version), len(ev_keys) + 1)
                    ops += [
                        (k, name, round(amount, 3), int(name == "lat_ms"))
                        for name, amount in sorted(fields.items())
                        if amount
                    ]
            c = contribs.setdefault(tuple(ops), len(contribs) + 1) if ops else 0
            if j.source is None:
                recs.append([0, 0, c])
            else:
                topic, partition, offset = j.source
                recs.append([parts.setdefault((topic, partition), len(parts) + 1), offset, c])
        markers = [self.keys.review_sent(r.probe, r.message_id) for r in reviews]
        if reviews and budget is None:
            raise ValueError("review candidates need a budget")
        if not contribs and not markers and not hashes:
            return []
        hash_keys: dict[str, int] = {}
        sets = [
            [hash_keys.setdefault(key, len(hash_keys) + 1), name, value, ttl]
            for key, name, value, ttl in hashes
        ]
        args = {
            "np": len(parts),
            "nm": len(markers),
            "hw_ttl": self.marker_ttl_s,
            "mark_ttl": self.marker_ttl_s,
            "once_ttl": scripts.ONCE_TTL_S,
            "budget": budget.limit if budget is not None else 0,
            "window_ttl": budget.ttl_s if budget is not None else 1,
            "recs": recs,
            "contribs": [[list(op) for op in ops] for ops in contribs] or [[]],
            "reviews": [[r.index + 1, i + 1] for i, r in enumerate(reviews)],
            "ne": len(ev_keys),
            "sets": sets,
        }
        reply = self._script(scripts.SCORED)(
            keys=[
                self.keys.once(uuid.uuid4().hex),
                budget.key if budget is not None else self.keys.once("no-budget"),
                *(self.keys.counted(self.group, t, p) for t, p in parts),
                *markers,
                *ev_keys,
                *hash_keys,
            ],
            args=[json.dumps(args)],
        )
        flags = _text(reply).split("|", 1)[1]
        return [f == "1" for f in flags]

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
            d = _decision(blob, probe)
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
                _credit_flag(counts, pairs, d, bool(t.flag))
            else:
                _credit_head(counts, d, head, t.heads[head])
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
        fresh = [m for m, flag in zip(marks, _text(reply), strict=True) if flag == "1"]
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
            d = _decision(blob, probe)
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
        rows = np.array([[float(x) for x in _text(r).split()] for r in raw])  # [N, 2]
        return average_precision(rows[:, 1] > 0.5, rows[:, 0])
