"""Operating point of a flag decision: where a probe's threshold goes on its score.

A plain value type (no pydantic model: it travels as its string form, e.g. in settings
and on the command line), parsed once and validated there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

__all__ = ["OperatingPoint"]


@dataclass(frozen=True)
class OperatingPoint:
    """Where a flag threshold goes: the F1 maximum, a floor on precision or recall, or a
    ceiling on the false-positive rate (the share of negatives flagged).

    >>> OperatingPoint.parse("precision>=0.9")
    OperatingPoint(metric='precision', bound=0.9)
    >>> str(OperatingPoint.parse("FPR <= 0.03")), str(OperatingPoint.parse("f1"))
    ('fpr<=0.03', 'f1')
    """

    metric: Literal["f1", "precision", "recall", "fpr"] = "f1"
    # The least precision (or recall) to reach, or the most false-positive rate to allow;
    # unused for "f1".
    bound: float = 0.0

    _PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        r"^\s*(?:(precision|recall)\s*>=|(fpr)\s*<=)\s*([0-9]*\.?[0-9]+)\s*$"
    )
    _SHAPES: ClassVar[str] = (
        "'f1', 'precision>=X', 'recall>=X' (0 < X <= 1) or 'fpr<=X' (0 <= X <= 1)"
    )

    def __post_init__(self) -> None:
        low_ok = self.bound >= 0.0 if self.metric == "fpr" else self.bound > 0.0
        if self.metric != "f1" and not (low_ok and self.bound <= 1.0):
            raise ValueError(f"{self} is none of {self._SHAPES}")

    @classmethod
    def parse(cls, text: str) -> OperatingPoint:
        """``"f1"``, ``"precision>=X"``, ``"recall>=X"`` or ``"fpr<=X"``."""
        if text.strip().lower() == "f1":
            return cls()
        m = cls._PATTERN.match(text.lower())
        if m is None:
            raise ValueError(f"operating point {text!r} is none of {cls._SHAPES}")
        metric = m.group(1) or m.group(2)
        return cls(metric=metric, bound=float(m.group(3)))  # type: ignore[arg-type]

    def __str__(self) -> str:
        if self.metric == "f1":
            return "f1"
        return f"{self.metric}{'<=' if self.metric == 'fpr' else '>='}{self.bound:g}"
