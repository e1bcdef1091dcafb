"""Per-version evidence in Redis: what every scorer saw, and what the human labels said.

Every scorer adds to the counters of the versions it served; the updater (which
consumes the labels) credits each label to the version(s) that judged the message.
The rollout policy (:mod:`worker.rollout.policy`) decides on these numbers, and
``probeguard probe status`` shows them. Writing is best-effort: callers catch
Redis errors, so a Redis hiccup costs evidence, never a batch.

Keys: ``evidence``, ``pairs``, ``labeled`` and ``decided`` in
:class:`worker.store.redis.Keys`. ``pairs`` is a list of "flag_score truth" (newest
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

import contextlib
import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from probes.metrics import precision_recall_f1
from schemas import DecidedRecord, ProbeDecision
from worker.settings import DEFAULTS, Settings
from worker.store.redis import Keys

__all__ = ["Confusion", "Counts", "Evidence", "EvidenceStore", "Truth"]


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
    ) -> None:
        self.client: Any = client
        # ``decided`` and ``labeled`` (per message, TTL) live in the text cache's Redis.
        self.cache: Any = cache if cache is not None else client
        self.keys = keys
        self.pairs_max = pairs_max
        self.marker_ttl_s = marker_ttl_s

    @classmethod
    def from_settings(cls, client: Any, settings: Settings, *, cache: Any = None) -> EvidenceStore:
        """Under ``settings.redis_prefix``; label markers live as long as cached texts (and
        with them in ``cache``, the text cache's client, when given)."""
        return cls(
            client,
            Keys(settings.redis_prefix),
            pairs_max=settings.evidence_pairs,
            marker_ttl_s=settings.text_cache_ttl_s,
            cache=cache,
        )

    # --- scorers -------------------------------------------------------------

    def add_scored(
        self,
        pipe: Any,
        probe: str,
        decisions: Iterable[tuple[ProbeDecision, float]],
        *,
        heads: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        """Queue on ``pipe`` the counters for a batch of ``(decision, latency_ms)``;
        ``heads``: version -> the heads a multi-head version judged (its per-head counters).

        Aggregated per version first: a batch costs a few HINCRBYs, not one per message.
        """
        judged = heads or {}
        sums: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for d, latency_ms in decisions:
            if d.v > 0:  # version 0 is a bootstrap file, not a registry version
                own = sums[d.v]
                own["n"] += 1
                own["flags"] += d.f
                own["lat_ms"] += latency_ms
                _count_heads(own, judged.get(d.v, ()), d.h, "")
            if d.c is not None:
                base = sums[d.c]
                base["bl_n"] += 1
                base["bl_flags"] += d.f
                _count_heads(base, judged.get(d.v, ()), d.h, "bl_")
            if d.sv is not None and d.sf is not None:
                shadow = sums[d.sv]
                shadow["sh_n"] += 1
                shadow["sh_flags"] += d.sf
                shadow["sh_agree"] += d.sf == d.f
                _count_heads(shadow, judged.get(d.sv, ()), d.sh, "sh_")
        for version, fields in sums.items():
            key = self.keys.evidence(probe, version)
            for name, amount in fields.items():
                if name == "lat_ms":
                    pipe.hincrbyfloat(key, name, round(amount, 3))
                elif amount:
                    pipe.hincrby(key, name, int(amount))

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

        Each counts once, however often a label is redelivered (a marker per message, and
        per message and head); messages no scorer recorded a decision for are skipped.
        Returns how many labels were credited.
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
        pipe = self.cache.pipeline(transaction=False)
        for key, _, _, _ in marks:
            pipe.set(key, 1, nx=True, ex=self.marker_ttl_s)
        fresh = [m for m, new in zip(marks, pipe.execute(), strict=True) if new]
        counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        pairs: dict[int, list[str]] = defaultdict(list)
        for _, k, d, head in fresh:
            t = truths[k]
            if head is None:
                _credit_flag(counts, pairs, d, bool(t.flag))
            else:
                _credit_head(counts, d, head, t.heads[head])
        try:
            self._write_credits(probe, counts, pairs)
        except Exception:
            # The markers say "credited" but the counts did not land: take them back, so a
            # redelivery credits these labels instead of skipping them for good.
            with contextlib.suppress(Exception):
                self.cache.delete(*(key for key, _, _, _ in fresh))
            raise
        return len({k for _, k, _, _ in fresh})

    def _write_credits(
        self, probe: str, counts: dict[int, dict[str, int]], pairs: dict[int, list[str]]
    ) -> None:
        pipe = self.client.pipeline(transaction=False)
        for version, fields in counts.items():
            for name, amount in fields.items():
                pipe.hincrby(self.keys.evidence(probe, version), name, amount)
        if self.pairs_max:
            for version, items in pairs.items():
                pipe.lpush(self.keys.pairs(probe, version), *items)
                pipe.ltrim(self.keys.pairs(probe, version), 0, self.pairs_max - 1)
        pipe.execute()

    # --- who labeled (kept apart from the credit above) -------------------------

    def record_labelers(self, probe: str, labeled: Sequence[tuple[str, str]]) -> None:
        """Count ``(message_id, labeler_id)`` per version whose own decision the label is
        credited against (decided or shadowed; ``labelers:{v}``, labeler -> labels), so the
        policy can require several distinct labelers before it promotes.

        Like :meth:`record_truths` only the first label of a message counts (a marker per
        message holding its labeler): a later label of another labeler was not credited,
        and must not count as a second opinion; a redelivered label counts once."""
        if not labeled:
            return
        raw = self.cache.mget([self.keys.decided(m) for m, _ in labeled])
        judged: list[tuple[str, set[int]]] = []
        pipe = self.cache.pipeline(transaction=False)
        for (message_id, labeler), blob in zip(labeled, raw, strict=True):
            d = _decision(blob, probe)
            versions = {v for v in (d.v, d.sv) if v} if d is not None else set()
            if versions:
                judged.append((labeler, versions))
                key = self.keys.credited_by(probe, message_id)
                pipe.set(key, labeler, nx=True, ex=self.marker_ttl_s)
        if not judged:
            return
        pipe_w = self.client.pipeline(transaction=False)
        for (labeler, versions), fresh in zip(judged, pipe.execute(), strict=True):
            for v in versions if fresh else ():
                pipe_w.hincrby(self.keys.labelers(probe, v), labeler, 1)
        pipe_w.execute()

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
