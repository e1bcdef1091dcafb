"""Drift monitoring's records: a checkpoint's training statistics, and the window sums a
scorer shares through Redis (see :mod:`probes.drift` and :mod:`worker.scoring.drift`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AwareDatetime, Field, model_validator

from schemas.base import WireModel

__all__ = ["DRIFT_BINS", "DriftReference", "DriftSnapshot"]

# Fixed score bins of a drift reference: equal width over [0, 1].
DRIFT_BINS = 10
Finite = Annotated[float, Field(allow_inf_nan=False)]


class DriftReference(WireModel):
    """What live traffic is compared with (see :mod:`probes.drift`): the probe's training
    statistics, recorded when the checkpoint was written.

    Per layer of the spec (in its order), the mean and standard deviation over training
    examples of the RMS of the probe's normalized pooled state (``probe.summarize``); and the
    share of training examples per score bin (``DRIFT_BINS`` equal bins over [0, 1]) of the
    drift score (the highest probability among the flag labels, else among all labels).
    """

    schema_version: Literal[1] = 1
    examples: Annotated[int, Field(ge=1)]
    layer_mean: Annotated[list[Finite], Field(min_length=1, max_length=256)]
    layer_std: Annotated[
        list[Annotated[float, Field(ge=0, allow_inf_nan=False)]],
        Field(min_length=1, max_length=256),
    ]
    score_bins: Annotated[
        list[Annotated[float, Field(ge=0, le=1)]],
        Field(min_length=DRIFT_BINS, max_length=DRIFT_BINS),
    ]

    @model_validator(mode="after")
    def _consistent(self) -> DriftReference:
        if len(self.layer_mean) != len(self.layer_std):
            raise ValueError("layer_mean and layer_std differ in length")
        if abs(sum(self.score_bins) - 1.0) > 1e-3:
            raise ValueError("score_bins must sum to 1")
        return self


class DriftSnapshot(WireModel):
    """One scorer's drift window for one probe version, as it stores it in Redis for the
    console: sums, so several scorers' windows add up exactly."""

    schema_version: Literal[1] = 1
    at: AwareDatetime
    messages: Annotated[int, Field(ge=0)]
    layer_sum: Annotated[list[Finite], Field(min_length=1, max_length=256)]  # of the RMS
    score_counts: Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=DRIFT_BINS, max_length=DRIFT_BINS)
    ]
