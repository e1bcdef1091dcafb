"""Model selection by cross-validation: folds, the held-out rule, choices made out of fold."""

from __future__ import annotations

import statistics

import pytest
import torch

from probes import ProbeError
from probes.fit import FitConfig, predict_dataset
from probes.select import cross_validate, fit_cv, held_out, stratified_folds
from tests.unit.test_train import spec_for, token_dataset


def test_folds_are_stratified_and_cover_every_row() -> None:
    data = token_dataset(n=90, seed=1)
    fold = stratified_folds(data, 5, seed=0)
    assert sorted(torch.unique(fold).tolist()) == [0, 1, 2, 3, 4]
    for c in range(3):
        per_fold = torch.bincount(fold[data.targets == c], minlength=5)
        assert int(per_fold.max() - per_fold.min()) <= 1
    assert torch.equal(fold, stratified_folds(data, 5, seed=0))
    with pytest.raises(ProbeError, match="at least 2 folds"):
        stratified_folds(data, 1)


def test_held_out_rows_depend_only_on_their_id() -> None:
    ids = [f"toxicchat-train-{i}" for i in range(2000)]
    mask = held_out(ids, 0.3)
    assert 0.27 < float(mask.float().mean()) < 0.33
    shuffled = ids[::-1]
    assert held_out(shuffled, 0.3).tolist() == mask.tolist()[::-1]
    assert held_out(ids[:10], 0.3).tolist() == mask[:10].tolist()
    with pytest.raises(ProbeError):
        held_out(ids, 1.5)


def test_each_fold_is_reported_at_choices_made_on_the_other_folds() -> None:
    data = token_dataset(n=120, seed=1)
    config = FitConfig(max_epochs=8, patience=3, lr=3e-3)
    cv = cross_validate(spec_for(data, "mean"), data, config, folds=4)
    assert len(cv.folds) == 4 and sum(f.rows for f in cv.folds) == 120
    span = len(cv.curve)
    assert {len(c) for c in cv.fold_curves} == {span}  # early-stopped folds padded
    for i, f in enumerate(cv.folds):
        others = [c for j, c in enumerate(cv.fold_curves) if j != i]
        mean = [statistics.fmean(c[e] for c in others) for e in range(span)]
        assert f.epoch == 1 + max(range(span), key=lambda e: mean[e])
    assert cv.epochs == 1 + max(range(span), key=lambda e: cv.curve[e])
    summary = cv.summary()
    assert summary["f1_mean"] > 0.8 and summary["f1_std"] >= 0 and summary["folds"] == 4
    assert cv.oof_probs.shape == (120, 3)


def test_fit_cv_refits_on_every_row_with_the_chosen_epochs_and_thresholds() -> None:
    data = token_dataset(n=120, seed=1)
    config = FitConfig(max_epochs=5, patience=2, lr=3e-3)
    result, cv = fit_cv(spec_for(data, "gate"), data, config, folds=3)
    assert result.epochs == cv.epochs and result.train_rows == 120
    assert result.probe.spec.thresholds == cv.thresholds and "toxic" in cv.thresholds
    test = token_dataset(n=60, seed=2)
    accuracy = (predict_dataset(result.probe, test).argmax(1) == test.targets).float().mean()
    assert accuracy > 0.8
