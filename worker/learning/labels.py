"""What a human label says to one probe: whether it is the probe's to learn, and what it
says about the probe's flag decision (the evidence the rollout policy weighs). Pure."""

from __future__ import annotations

from collections.abc import Iterable

from schemas import HumanLabel, ProbeSpec

__all__ = ["flag_truths", "skip_reason"]


def skip_reason(
    label: HumanLabel, spec: ProbeSpec, name: str, probe_names: Iterable[str]
) -> str | None:
    """None when probe ``name`` should learn (or dead-letter) ``label``; else why it is
    left to the other probes.

    Every probe's updaters read every label (one consumer group per probe). A label
    addressed to another probe is not ours; an unaddressed one is, if we know its
    labels, or if no other probe is configured (then it is our unknown label).
    """
    if label.probe is not None:
        return None if label.probe == name else "other_probe"
    known = all(n in spec.labels for n in label.all_labels)
    ours = known or not [p for p in probe_names if p != name]
    return None if ours else "unknown_unaddressed"


def flag_truths(spec: ProbeSpec, labels: Iterable[HumanLabel]) -> list[tuple[str, bool]]:
    """``(message_id, flag)`` for each label that says whether its message should be
    flagged: every label with a flag label, and those without one that annotate every
    head that can flag."""
    flag = set(spec.flag_labels)
    truths = []
    for lb in labels:
        positive = any(n in flag for n in lb.all_labels)
        if positive or _says_no_flag_head_flags(spec, lb):
            truths.append((lb.message_id, positive))
    return truths


def _says_no_flag_head_flags(spec: ProbeSpec, label: HumanLabel) -> bool:
    """Whether a label without a flag label is a negative for the whole flag decision: it
    annotates every head that can flag (a multi-head label for one other head says nothing
    of whether the message should be flagged)."""
    if not spec.heads or label.exhaustive:
        return True
    flagging = {spec.head_of(x).name for x in spec.flag_labels}
    named = {label.head} if label.head else {spec.head_of(n).name for n in label.all_labels}
    return flagging <= named
