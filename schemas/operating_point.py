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
    """Where a flag threshold goes: the F1 maximum, or a floor on precision or recall.

    >>> OperatingPoint.parse("precision>=0.9")
    OperatingPoint(metric='precision', floor=0.9)
    >>> str(OperatingPoint.parse("f1"))
    'f1'
    """

    metric: Literal["f1", "precision", "recall"] = "f1"
    floor: float = 0.0  # the least precision (or recall) to reach; unused for "f1"

    _PATTERN: ClassVar[re.Pattern[str]] = re.compile(
        r"^\s*(precision|recall)\s*>=\s*([0-9]*\.?[0-9]+)\s*$"
    )

    def __post_init__(self) -> None:
        if self.metric != "f1" and not 0.0 < self.floor <= 1.0:
            raise ValueError(f"{self.metric} floor must be in (0, 1], got {self.floor}")

    @classmethod
    def parse(cls, text: str) -> OperatingPoint:
        """``"f1"``, ``"precision>=X"`` or ``"recall>=X"`` (``0 < X <= 1``)."""
        if text.strip().lower() == "f1":
            return cls()
        m = cls._PATTERN.match(text.lower())
        if m is None:
            raise ValueError(
                f"operating point {text!r} is not 'f1', 'precision>=X' or 'recall>=X' (0 < X <= 1)"
            )
        return cls(metric=m.group(1), floor=float(m.group(2)))  # type: ignore[arg-type]

    def __str__(self) -> str:
        return "f1" if self.metric == "f1" else f"{self.metric}>={self.floor:g}"
