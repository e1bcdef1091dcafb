"""The evidence of a probe version as read from Redis: its counters, decoded.

The rollout policy (:mod:`worker.rollout.policy`) and ``probeguard probe status`` decide
and report on these numbers; :mod:`worker.store.evidence` writes them (and reads them back
through :meth:`~worker.store.evidence.EvidenceStore.read_many`). The read model is apart
from the store so that the policy, which only reads numbers, needs no Redis client.

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from probes.metrics import precision_recall_f1

__all__ = ["Confusion", "Counts", "Evidence", "as_text"]


def as_text(value: bytes | str) -> str:
    """A Redis reply as text, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else value


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
        h = {as_text(k): as_text(v) for k, v in raw.items()}
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
