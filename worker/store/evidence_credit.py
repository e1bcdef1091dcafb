"""What one decision or one label adds to a version's evidence counters.

Pure arithmetic over :class:`schemas.ProbeDecision`, no Redis: :mod:`worker.store.evidence`
turns these increments into the one Lua script per batch that counts them exactly once.
The field names are those of the evidence hash
(:mod:`worker.store.evidence_counts` lists them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from pydantic import ValidationError

from schemas import DecidedRecord, ProbeDecision

__all__ = ["credit_flag", "credit_head", "decision_of", "scored_fields"]


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


def scored_fields(
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


def decision_of(blob: bytes | None, probe: str) -> ProbeDecision | None:
    """``probe``'s decision in a stored :class:`DecidedRecord` (None: none, or unreadable)."""
    if blob is None:
        return None
    try:
        return DecidedRecord.decode(blob).p.get(probe)
    except ValidationError:
        return None


def credit_flag(
    counts: dict[int, dict[str, int]], pairs: dict[int, list[str]], d: ProbeDecision, truth: bool
) -> None:
    """A label's confusion cell for each version that judged the message, and its
    "score truth" pair for the versions' AUPRC."""
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


def credit_head(
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
