"""The depth search's record and its choice: which deepest layer a probe should stop at.

:func:`probes.offline.select.select_depth` cross-validates one probe per candidate depth;
this module holds what it tried (:class:`DepthSearch`, one :class:`DepthRow` per depth) and
the rule that picks among them (:func:`choose_depth`: the shallowest within ``epsilon`` of
the best), apart from the fitting so the rule is testable without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probes.errors import ProbeError
from probes.offline.cv import CVResult

__all__ = ["DepthRow", "DepthSearch", "choose_depth", "depth_candidates"]


@dataclass
class DepthRow:
    """One candidate depth: the probe reads every given layer up to ``depth``."""

    depth: int
    layers: list[int]
    cv: CVResult
    seconds: float

    @property
    def auprc(self) -> tuple[float, float]:
        """Cross-validated AUPRC: ``(mean, spread)`` over the folds."""
        s = self.cv.summary()
        return s["auprc_mean"], s["auprc_std"]


@dataclass
class DepthSearch:
    """What :func:`select_depth` tried and chose."""

    rows: list[DepthRow]  # by depth, shallowest first
    chosen: int  # the depth the final probe stops at
    best: int  # the depth with the best mean AUPRC
    epsilon: float

    def row(self, depth: int) -> DepthRow:
        return next(r for r in self.rows if r.depth == depth)

    def table(self) -> list[dict[str, Any]]:
        """One plain dict per candidate (for reports and JSON)."""
        out = []
        for r in self.rows:
            s = r.cv.summary()
            out.append(
                {
                    "depth": r.depth,
                    "layers": r.layers,
                    "auprc_mean": s["auprc_mean"],
                    "auprc_std": s["auprc_std"],
                    "f1_mean": s["f1_mean"],
                    "f1_std": s["f1_std"],
                    "epochs": r.cv.epochs,
                    "seconds": round(r.seconds, 1),
                    "chosen": r.depth == self.chosen,
                }
            )
        return out


def choose_depth(auprc: dict[int, float], epsilon: float) -> tuple[int, int]:
    """``(chosen, best)``: the shallowest depth whose mean AUPRC is within ``epsilon`` of
    the best one's, and the best one (the shallower of ties).

    >>> choose_depth({8: 0.70, 15: 0.795, 30: 0.80}, 0.01)
    (15, 30)
    >>> choose_depth({8: 0.70, 15: 0.795, 30: 0.80}, 0.0)
    (30, 30)
    """
    if not auprc:
        raise ProbeError("no candidate depth to choose from")
    if not epsilon >= 0.0:
        raise ProbeError(f"epsilon must be >= 0, got {epsilon}")
    top = max(auprc.values())
    best = min(d for d, a in auprc.items() if a == top)
    return min(d for d, a in auprc.items() if a >= top - epsilon), best


def depth_candidates(layers: list[int], depths: list[int] | None = None) -> list[int]:
    """Candidate deepest layers: every one of ``layers`` (sorted), or ``depths``, each of
    which must be one of them (a probe stopping at depth ``d`` reads ``layers <= d``)."""
    if depths is None:
        return sorted(layers)
    unknown = sorted(set(depths) - set(layers))
    if unknown or not depths:
        raise ProbeError(f"candidate depths {unknown or depths} are not among the layers {layers}")
    return sorted(set(depths))
