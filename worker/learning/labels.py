"""What a human label says to one probe: whether it is the probe's to learn, and what it
says about the probe's flag decision and about each head's (the evidence the rollout
policy weighs). Pure."""

from __future__ import annotations

from collections.abc import Iterable

from probes.errors import ProbeError
from probes.targets import annotated, encode_target
from schemas import HumanLabel, ProbeSpec
from worker.store.evidence import Truth

__all__ = ["flag_truths", "head_truths", "label_truths", "skip_reason"]


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
    truths = []
    for lb in labels:
        truth = _flag_truth(spec, lb)
        if truth is not None:
            truths.append((lb.message_id, truth))
    return truths


def head_truths(spec: ProbeSpec, label: HumanLabel) -> dict[str, bool]:
    """For each head of a multi-head ``spec`` that has a flag label and that ``label``
    annotates (as training reads it, :func:`probes.targets.annotated`): whether the head
    should flag, i.e. the label names one of its flag labels. Empty for a single-head
    probe and for a label the probe cannot learn."""
    if not spec.heads:
        return {}
    try:
        target, _ = encode_target(
            spec, label.all_labels, label.head, exhaustive=bool(label.exhaustive)
        )
    except ProbeError:
        return {}
    marked = annotated(spec, target[None])  # per head, [1] bool
    named = set(label.all_labels)
    return {
        h.name: any(x in named for x in h.labels if x in spec.flag_labels)
        for h in spec.heads
        if bool(marked[h.name][0]) and any(x in spec.flag_labels for x in h.labels)
    }


def label_truths(spec: ProbeSpec, labels: Iterable[HumanLabel]) -> list[Truth]:
    """What each label says to the evidence: the flag decision (as :func:`flag_truths`)
    and each head it annotates (:func:`head_truths`); labels that say neither are left
    out."""
    truths = []
    for lb in labels:
        t = Truth(lb.message_id, _flag_truth(spec, lb), head_truths(spec, lb))
        if t.flag is not None or t.heads:
            truths.append(t)
    return truths


def _flag_truth(spec: ProbeSpec, label: HumanLabel) -> bool | None:
    positive = any(n in spec.flag_labels for n in label.all_labels)
    return positive if positive or _says_no_flag_head_flags(spec, label) else None


def _says_no_flag_head_flags(spec: ProbeSpec, label: HumanLabel) -> bool:
    """Whether a label without a flag label is a negative for the whole flag decision: it
    annotates every head that can flag (a multi-head label for one other head says nothing
    of whether the message should be flagged)."""
    if not spec.heads or label.exhaustive:
        return True
    flagging = {spec.head_of(x).name for x in spec.flag_labels}
    named = {label.head} if label.head else {spec.head_of(n).name for n in label.all_labels}
    return flagging <= named
