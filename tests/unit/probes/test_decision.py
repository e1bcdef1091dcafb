"""Thresholds -> predicted labels and the flag."""

from __future__ import annotations

import torch

from probes import decide
from tests.unit.synthetic import make_spec


def test_multiclass_argmax_without_thresholds() -> None:
    spec = make_spec("mean", "single")  # labels ok, toxic, spam; flag toxic
    d = decide(spec, torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]))
    assert d.predicted.tolist() == [0, 1]
    assert d.flagged.tolist() == [False, True]
    assert d.label_names(spec) == [["ok"], ["toxic"]]


def test_multiclass_flag_threshold_overrides_argmax() -> None:
    spec = make_spec("mean", "single", thresholds={"toxic": 0.25})
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.05, 0.9, 0.05]])
    d = decide(spec, probs)
    # Row 0 passes the toxic threshold; row 1 does not (spam wins); row 2 is clear.
    assert d.predicted.tolist() == [1, 2, 1]
    assert d.flagged.tolist() == [True, False, True]
    high = make_spec("mean", "single", thresholds={"toxic": 0.95})
    assert decide(high, probs).predicted.tolist() == [0, 2, 0]  # toxic never passes 0.95


def test_multilabel_thresholds() -> None:
    spec = make_spec("mean", "single", task="multilabel", thresholds={"toxic": 0.2})
    d = decide(spec, torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.9]]))
    assert d.predicted.tolist() == [[True, True, False], [False, False, True]]
    assert d.flagged.tolist() == [True, False]
    assert d.label_names(spec) == [["ok", "toxic"], ["spam"]]
