"""Served quality: the one definition the demo's live view, its report and the README use.

A verdict is judged by the human label that arrives after it (a label never changes the
verdict it judges), so this is the quality users got, version by version, not the
updater's own test-then-train score:

- **per head** ``H``: over the labeled messages whose label is one of ``H``'s, a
  positive is a verdict in which ``H`` predicted one of its flag labels; a true positive
  one whose human label is one of them.
- **flag policy**: over every labeled message, a positive is a verdict that flagged
  (``flagged``: a head of the deployment's flag policy, ``PROBEGUARD_FLAG_HEADS``,
  flagged it); a true positive one whose human label is a flag label of a head in that
  policy.

Served F1 is ``2·TP / (2·TP + FP + FN)`` of either; it is undefined (``None``) while a
set holds no positive at all, predicted or true.

    >>> c = Cells()
    >>> for pred, true in [(True, True), (True, False), (False, True), (False, False)]:
    ...     c.add(pred, true)
    >>> c.as_dict(), c.f1
    ({'tp': 1, 'fp': 1, 'fn': 1, 'tn': 1}, 0.5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from probes.decision import flagging_heads
from schemas import ProbeSpec, Verdict

__all__ = ["Cells", "Judged", "half_windows", "head_cells", "judge", "policy_cells"]

NONE = "(none)"  # what a multi-label head predicted when it predicted no label


@dataclass
class Cells:
    """A binary confusion matrix: flagged or not, against truly a flag or not."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0

    def add(self, pred: bool, true: bool) -> None:
        if pred and true:
            self.tp += 1
        elif pred:
            self.fp += 1
        elif true:
            self.fn += 1
        else:
            self.tn += 1

    def __iadd__(self, other: Cells) -> Cells:
        self.tp, self.fp = self.tp + other.tp, self.fp + other.fp
        self.fn, self.tn = self.fn + other.fn, self.tn + other.tn
        return self

    @property
    def n(self) -> int:
        return self.tp + self.fp + self.fn + self.tn

    @property
    def f1(self) -> float | None:
        """F1, or ``None`` while there is no positive, predicted or true."""
        positives = 2 * self.tp + self.fp + self.fn
        return round(2 * self.tp / positives, 4) if positives else None

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "fp": self.fp, "fn": self.fn, "tn": self.tn}

    @classmethod
    def of(cls, d: dict[str, int]) -> Cells:
        return cls(d["tp"], d["fp"], d["fn"], d["tn"])


@dataclass(frozen=True)
class Judged:
    """One labeled message: its served verdict beside its human label."""

    message_id: str
    t: float  # when it was sent, seconds since the run started
    version: int  # the probe version that decided it
    truth: str  # the human label
    head: str | None  # the head whose labels hold ``truth`` (None: the probe has no such label)
    head_pred: str  # what that head predicted (its first predicted label, or NONE)
    head_flag: bool  # that head predicted one of its flag labels
    flagged: bool  # the verdict flagged (the flag policy)
    flag_true: bool  # ``truth`` is a flag label of a head in the flag policy


def judge(
    verdict: Verdict, truth: str, spec: ProbeSpec, policy: frozenset[str] | None, t: float = 0.0
) -> Judged:
    """``verdict``'s result for ``spec``'s probe judged by the human label ``truth``.

    ``spec`` is the probe's own (every head's flag labels); ``policy`` the heads that may
    flag a verdict (``Settings.flag_head_names``; ``None``: every head with flag labels)."""
    res = next((r for r in verdict.results if r.probe == spec.name), verdict.results[0])
    try:
        head = spec.head_of(truth)
    except ValueError:
        head = None
    predicted: list[str] = []
    if head is not None:
        hr = res.heads.get(head.name) if res.heads else None
        source = hr.predicted if hr is not None else res.predicted
        predicted = [x for x in source if x in head.labels]
    return Judged(
        message_id=verdict.message_id,
        t=t,
        version=res.version,
        truth=truth,
        head=head.name if head is not None else None,
        head_pred=predicted[0] if predicted else NONE,
        head_flag=any(x in spec.flag_labels for x in predicted),
        flagged=res.flagged,
        flag_true=truth in flagging_heads(spec, policy).flag_labels,
    )


def policy_cells(rows: Sequence[Judged]) -> Cells:
    """The flag policy's confusion over ``rows``."""
    cells = Cells()
    for r in rows:
        cells.add(r.flagged, r.flag_true)
    return cells


def head_cells(rows: Sequence[Judged], head: str, flag_labels: Sequence[str]) -> Cells:
    """Head ``head``'s confusion over the ``rows`` labeled for it."""
    cells = Cells()
    for r in rows:
        if r.head == head:
            cells.add(r.head_flag, r.truth in flag_labels)
    return cells


def half_windows(rows: Sequence[Judged], per_half: int = 4) -> list[tuple[int, list[Judged]]]:
    """``rows`` in consecutive windows, each with its half (1 or 2): each half (the first
    ``len // 2`` rows, then the rest) cut into ``per_half`` windows of near-equal size, so
    that the windows of a half add up to exactly that half. Empty windows are left out."""
    mid = len(rows) // 2
    out: list[tuple[int, list[Judged]]] = []
    for number, half in ((1, rows[:mid]), (2, rows[mid:])):
        n = len(half)
        for i in range(per_half):
            window = list(half[i * n // per_half : (i + 1) * n // per_half])
            if window:
                out.append((number, window))
    return out
