"""Model selection by cross-validation: folds, the held-out rule, choices made out of fold."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch

from probes import ProbeError
from probes.calibration import calibrated_probabilities, raw_logits
from probes.offline.dataset import ProbeDataset
from probes.offline.depth import choose_depth, depth_candidates
from probes.offline.fit import FitConfig, predict_dataset
from probes.offline.select import (
    cross_validate,
    fit_cv,
    held_out,
    select_depth,
    stratified_folds,
)
from tests.unit.probes.test_fit import spec_for, token_dataset


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
    config = FitConfig(max_epochs=5, patience=2, lr=3e-3, final="refit")
    result, cv = fit_cv(spec_for(data, "gate"), data, config, folds=3)
    assert result.epochs == cv.epochs and result.train_rows == 120 and result.steps > 0
    assert not cv.fold_states  # nothing kept that the refit does not use
    assert result.probe.spec.thresholds == cv.thresholds and "toxic" in cv.thresholds
    test = token_dataset(n=60, seed=2)
    accuracy = (predict_dataset(result.probe, test).argmax(1) == test.targets).float().mean()
    assert accuracy > 0.8


def _signal_only_in(data: ProbeDataset, layer: int, seed: int = 0) -> ProbeDataset:
    """``data`` with every layer but ``layer`` replaced by noise: only it can be learned."""
    g = torch.Generator().manual_seed(seed)
    tokens = data.tokens.clone()  # type: ignore[union-attr]  # [N_tok, L, D]
    for slot, i in enumerate(data.layers):
        if i != layer:
            tokens[:, slot] = torch.randn(tokens[:, slot].shape, generator=g).half()
    return replace(data, tokens=tokens)


def test_choose_depth_takes_the_shallowest_within_epsilon_of_the_best() -> None:
    assert choose_depth({1: 0.5, 2: 0.895, 4: 0.9}, 0.01) == (2, 4)
    assert choose_depth({1: 0.5, 2: 0.895, 4: 0.9}, 0.0) == (4, 4)
    assert choose_depth({1: 0.9, 2: 0.9, 4: 0.9}, 0.0) == (1, 1)  # ties: the shallower
    assert choose_depth({1: 0.5, 2: 0.895, 4: 0.9}, 1.0) == (1, 4)
    with pytest.raises(ProbeError, match="epsilon"):
        choose_depth({1: 0.5}, -0.1)
    assert depth_candidates([1, 2, 4]) == [1, 2, 4]
    assert depth_candidates([1, 2, 4], [4, 2]) == [2, 4]
    with pytest.raises(ProbeError, match=r"\[3\] are not among the layers"):
        depth_candidates([1, 2, 4], [3, 4])


def test_select_layers_keeps_rows_and_picks_the_layer_axis() -> None:
    data = token_dataset(n=30, seed=1)
    sub = data.select_layers([1, 4])
    assert sub.layers == [1, 4] and len(sub) == 30 and data.select_layers(data.layers) is data
    h, m, _ = data.batch(torch.arange(5))
    hs, ms, _ = sub.batch(torch.arange(5))
    assert torch.equal(hs, h[[0, 2]]) and torch.equal(ms, m)  # type: ignore[arg-type]
    with pytest.raises(ProbeError, match="subset"):
        data.select_layers([3])


@pytest.mark.parametrize(("signal", "chosen"), [(4, 4), (1, 1)])
def test_select_depth_stops_where_the_signal_is(signal: int, chosen: int) -> None:
    """Signal only in the deepest layer: the search keeps every layer. Only in the
    shallowest: deeper candidates add nothing, so it stops there, and the refit probe reads
    only the chosen layers (a scorer serving it runs fewer blocks)."""
    data = _signal_only_in(token_dataset(n=120, seed=1), signal)
    config = FitConfig(max_epochs=6, patience=3, lr=3e-3)
    result, cv, search = select_depth(spec_for(data, "mean"), data, config, folds=3, epsilon=0.02)
    assert [r.depth for r in search.rows] == [1, 2, 4]
    assert search.chosen == chosen and result.probe.layers == tuple(
        i for i in data.layers if i <= chosen
    )
    assert cv is search.row(chosen).cv and result.epochs == cv.epochs
    assert result.probe.spec.thresholds == cv.thresholds
    table = search.table()
    assert [r["chosen"] for r in table] == [d == chosen for d in (1, 2, 4)]
    auprc = {r["depth"]: r["auprc_mean"] for r in table}
    assert auprc[chosen] >= max(auprc.values()) - 0.02
    if signal == 4:
        assert auprc[1] < auprc[4] - 0.1  # noise layers alone do not learn the task


@pytest.mark.parametrize("pool", ["mean", "gate"])
def test_fit_cv_serves_the_soup_of_the_fold_models_at_the_chosen_epoch(pool: str) -> None:
    """The default final probe averages the k fold models' weights after E* epochs (no
    refit): every fold standardizes by the same statistics of all rows, and each fold
    contributes the weights its curve counts at E* (its last ones if it stopped early)."""
    data = token_dataset(n=120, seed=1)
    config = FitConfig(max_epochs=6, patience=2, lr=3e-3)
    assert config.final == "soup"
    result, cv = fit_cv(spec_for(data, pool), data, config, folds=3)
    assert len(cv.fold_states) == 3 and result.steps == 0 and result.epochs == cv.epochs
    state = result.probe.state_dict()
    for key, value in state.items():
        folds = torch.stack([s[key].double() for s in cv.fold_states])
        torch.testing.assert_close(value.double(), folds.mean(0), rtol=1e-5, atol=1e-6)
    shift = [s[k] for s in cv.fold_states for k in s if k.endswith("shift")]
    assert shift and all(torch.equal(shift[0], t) for t in shift)  # one standardization
    assert not torch.equal(cv.fold_states[0][key], cv.fold_states[1][key])  # trained apart
    assert result.probe.spec.thresholds == cv.thresholds and result.drift is not None
    test = token_dataset(n=60, seed=2)
    accuracy = (predict_dataset(result.probe, test).argmax(1) == test.targets).float().mean()
    assert accuracy > 0.8


def test_a_soup_worse_in_sample_than_its_folds_out_of_fold_falls_back_to_a_refit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MHA fold models at a high learning rate on 80 rows leave the shared basin: their
    mean scores the rows they trained on worse than they scored unseen ones, so fit_cv
    refits on every row rather than serve it."""
    data = token_dataset(n=120, seed=1)
    config = FitConfig(max_epochs=6, patience=2, lr=3e-3)
    with caplog.at_level("WARNING", logger="probes.offline.select"):
        result, cv = fit_cv(spec_for(data, "mha"), data, config, folds=3)
    assert "refitting on every row instead" in caplog.text
    assert len(cv.fold_states) == 3 and result.steps > 0 and result.epochs == cv.epochs
    test = token_dataset(n=60, seed=2)
    accuracy = (predict_dataset(result.probe, test).argmax(1) == test.targets).float().mean()
    assert accuracy > 0.7


def test_copies_of_a_row_share_a_fold() -> None:
    # A recipe that repeats hard examples must not score a copy with a model that trained
    # on another copy of it.
    n = 40
    ids = [f"r{i % 13}" for i in range(n)]  # 13 rows, each repeated 3-4 times
    data = ProbeDataset(
        [1], ["a", "b"], "multiclass", torch.tensor([i % 2 for i in range(n)]), ids,
        summaries=torch.zeros(1, n, 2),
    )  # fmt: skip
    fold = stratified_folds(data, 4)
    for row in set(ids):
        assert len({int(fold[i]) for i in range(n) if ids[i] == row}) == 1


def test_seeds_repeat_the_folds_and_the_soup_averages_every_seeds_models() -> None:
    """``FitConfig.seeds``: the cross-validation of each seed as it would run alone (its
    folds, models and fold reports), the soup the mean of all their models, and a row's
    out-of-fold probabilities those of its mean logit over the seeds."""
    data = token_dataset(n=240, seed=1)
    spec = spec_for(data, "mean")
    config = FitConfig(max_epochs=1, patience=1, lr=1e-2)  # one epoch: every seed's E*
    alone = [cross_validate(spec, data, replace(config, seed=s), folds=3) for s in (4, 5, 6)]
    result, cv = fit_cv(spec, data, replace(config, seed=4, seeds=3), folds=3)
    assert len(cv.folds) == len(cv.fold_states) == 9
    for report, other in zip(cv.folds, [f for a in alone for f in a.folds], strict=True):
        assert (report.fold, report.auprc, report.thresholds) == (
            other.fold, other.auprc, other.thresholds,
        )  # fmt: skip
    states = [s for a in alone for s in a.fold_states]
    for mine, theirs in zip(cv.fold_states, states, strict=True):
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    logits = torch.stack([raw_logits(spec, a.oof_probs).double() for a in alone]).mean(0)
    torch.testing.assert_close(cv.oof_probs, calibrated_probabilities(spec, logits.float()))
    assert result.soup_of == 9
    state = result.probe.state_dict()
    for key in state:
        members = torch.stack([s[key].double() for s in cv.fold_states])
        torch.testing.assert_close(state[key].double(), members.mean(0), rtol=1e-5, atol=1e-6)


def test_a_soup_of_seeds_depends_less_on_its_seeds_than_one_seed_does() -> None:
    """Two soups of disjoint seeds score unseen rows closer to each other than two single
    seeds do: the soup is the recipe's mean, not one draw of it."""
    data, test = token_dataset(n=120, seed=1), token_dataset(n=60, seed=2)
    spec = spec_for(data, "mean")
    config = FitConfig(max_epochs=3, patience=1, lr=3e-3)

    def scores(seed: int, seeds: int) -> torch.Tensor:
        result, _ = fit_cv(spec, data, replace(config, seed=seed, seeds=seeds), folds=3)
        return predict_dataset(result.probe, test)

    one = (scores(0, 1) - scores(4, 1)).abs().mean()
    soup = (scores(0, 4) - scores(4, 4)).abs().mean()
    assert soup < 0.5 * one


def test_seeds_must_be_positive() -> None:
    with pytest.raises(ProbeError, match="seeds must be >= 1"):
        FitConfig(seeds=0)
