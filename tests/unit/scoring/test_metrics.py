"""Metrics against hand-computed values and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from probes.metrics import (
    average_precision,
    benign_rows,
    best_f1_threshold,
    best_threshold,
    choose_thresholds,
    evaluate,
    evaluate_policy,
    expected_calibration_error,
)
from schemas import HeadSpec, OperatingPoint, ProbeSpec
from tests.unit.synthetic import NUM_LAYERS, D, make_spec, toy_task


def test_average_precision_matches_scikit_learn_example() -> None:
    # The example of sklearn.metrics.average_precision_score's docstring: 0.8333...
    ap = average_precision(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    assert math.isclose(ap, 0.8333333, rel_tol=1e-6)


def test_average_precision_with_ties_and_without_positives() -> None:
    # All scores tied: one threshold, precision = base rate.
    assert math.isclose(average_precision(np.array([1, 0, 0, 0]), np.zeros(4)), 0.25)
    assert math.isnan(average_precision(np.zeros(3), np.array([0.1, 0.2, 0.3])))


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 1)), min_size=1, max_size=50))
def test_average_precision_is_bounded(pairs: list[tuple[bool, float]]) -> None:
    y = np.array([a for a, _ in pairs])
    s = np.array([b for _, b in pairs])
    ap = average_precision(y, s)
    if y.any():
        assert 0.0 < ap <= 1.0 + 1e-12
        assert math.isclose(average_precision(y, y.astype(float)), 1.0)  # perfect ranking


def test_best_threshold_separates_a_separable_split() -> None:
    y = np.array([0, 0, 0, 1, 1])
    s = np.array([0.1, 0.2, 0.3, 0.6, 0.9])
    t, f1 = best_f1_threshold(y, s)
    assert f1 == 1.0 and 0.3 < t < 0.6


def _binary_spec(**kw: object) -> ProbeSpec:
    return ProbeSpec(
        name="tox",
        token_pool="mean",
        layer_mix="single",
        layers=[1],
        hidden_size=4,
        task="multiclass",
        labels=["non-toxic", "toxic"],
        flag_labels=["toxic"],
        **kw,  # type: ignore[arg-type]
    )


def test_evaluate_binary_report() -> None:
    probs_toxic = torch.tensor([0.1, 0.2, 0.35, 0.4, 0.8, 0.9])
    probs = torch.stack([1 - probs_toxic, probs_toxic], dim=1)
    y = torch.tensor([0, 0, 1, 0, 1, 1])
    spec = _binary_spec()
    thresholds = choose_thresholds(spec, probs, y)
    assert 0.2 < thresholds["toxic"] < 0.35
    spec = _binary_spec(thresholds=thresholds)
    r = evaluate(spec, probs, y)
    # At the chosen threshold: tp 3, fp 1 (0.4), fn 0.
    assert math.isclose(r["f1"], 2 * 3 / (2 * 3 + 1))
    assert r["confusion"]["matrix"] == [[2, 1], [0, 3]]
    assert math.isclose(r["accuracy"], 5 / 6)
    assert r["per_class"]["toxic"]["recall"] == 1.0
    assert math.isclose(r["auprc"], average_precision(y.numpy(), probs_toxic.numpy()))


def test_evaluate_multilabel_report() -> None:
    spec = ProbeSpec(
        name="mod",
        token_pool="mean",
        layer_mix="single",
        layers=[1],
        hidden_size=4,
        task="multilabel",
        labels=["hate", "sexual"],
        flag_labels=["hate", "sexual"],
    )
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.1, 0.1], [0.7, 0.6]])
    y = torch.tensor([[1, 0], [0, 1], [0, 0], [1, 0]]).float()
    r = evaluate(spec, probs, y)
    assert r["confusion"]["per_label"]["sexual"] == [[2, 1], [0, 1]]
    assert math.isclose(r["accuracy"], 3 / 4)
    assert r["flagged"]["f1"] == 1.0
    assert 0 < r["micro_f1"] < 1


def test_operating_point_parses_and_refuses_nonsense() -> None:
    assert OperatingPoint.parse(" Precision >= 0.9 ") == OperatingPoint("precision", 0.9)
    assert str(OperatingPoint.parse("recall>=.8")) == "recall>=0.8"
    assert OperatingPoint.parse("F1") == OperatingPoint()
    for bad in ("precision>0.9", "precision>=1.5", "accuracy>=0.9", "precision>=0"):
        with pytest.raises(ValueError):
            OperatingPoint.parse(bad)


def test_precision_floor_takes_the_most_recall_that_keeps_it() -> None:
    # Scores high to low: + + - + + - - + -
    y = np.array([1, 1, 0, 1, 1, 0, 0, 1, 0])
    s = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    t, _ = best_threshold(y, s, OperatingPoint.parse("precision>=0.8"))
    assert 0.4 < t < 0.5  # 4 of 5 flagged are right; going lower drops precision to 4/6
    t, _ = best_threshold(y, s, OperatingPoint.parse("precision>=1.0"))
    assert 0.7 < t < 0.8
    t, _ = best_threshold(y, s, OperatingPoint.parse("recall>=1.0"))
    assert 0.1 < t < 0.2  # every positive, as few negatives as that allows
    t_f1, f1 = best_threshold(y, s)
    assert (t_f1, f1) == best_f1_threshold(y, s)


def test_choose_thresholds_at_an_operating_point() -> None:
    spec = _binary_spec()
    p = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    probs = torch.stack([1 - p, p], dim=1)
    y = torch.tensor([1, 1, 0, 1, 1, 0, 0, 1, 0])
    strict = choose_thresholds(spec, probs, y, point=OperatingPoint.parse("precision>=1.0"))
    loose = choose_thresholds(spec, probs, y, point=OperatingPoint.parse("recall>=1.0"))
    assert strict["toxic"] > choose_thresholds(spec, probs, y)["toxic"] > loose["toxic"]
    report = evaluate(spec.model_copy(update={"thresholds": strict}), probs, y)
    assert report["flagged"]["precision"] == 1.0


def test_ece_of_a_hand_computed_case() -> None:
    # 15 equal-width bins: 0.05 -> bin 0 (two rows, one positive: |1 - 0.1|), 0.5 -> bin 7
    # (|1 - 0.5|), 0.95 -> bin 14 (|1 - 0.95|); (0.9 + 0.5 + 0.05) / 4 rows.
    y, p = np.array([1, 0, 1, 1]), np.array([0.05, 0.05, 0.5, 0.95])
    assert expected_calibration_error(y, p) == pytest.approx(0.3625)
    # A score of exactly 1 falls in the last bin; frequencies that match scores give 0.
    assert expected_calibration_error(np.array([1, 1]), np.array([1.0, 1.0])) == 0.0
    assert expected_calibration_error(np.array([0, 1]), np.array([0.5, 0.5])) == 0.0
    assert math.isnan(expected_calibration_error(np.array([]), np.array([])))


def test_evaluate_reports_recall_at_1pct_fpr_and_ece_beside_f1_and_auprc() -> None:
    spec = ProbeSpec(
        name="tox",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=D,
        task="multilabel",
        labels=["toxic"],
        flag_labels=["toxic"],
    )
    probs = torch.tensor([[0.9], [0.8], [0.3], [0.1], [0.05]])
    targets = torch.tensor([[1.0], [0.0], [1.0], [0.0], [0.0]])
    rep = evaluate(spec, probs, targets)
    y, s = targets.numpy()[:, 0], probs.double().numpy()[:, 0]
    assert rep["ece"] == pytest.approx(expected_calibration_error(y, s))
    assert rep["recall_at_1pct_fpr"] == rep["flagged"]["recall_at_1pct_fpr"] == 0.5
    assert rep["per_class"]["toxic"]["ece"] == pytest.approx(rep["ece"])
    # Without flag labels: the macro over labels; several heads: the macro over heads.
    plain = evaluate(spec.model_copy(update={"flag_labels": []}), probs, targets)
    assert plain["ece"] == pytest.approx(rep["ece"]) and plain["recall_at_1pct_fpr"] == 0.5
    multi = make_spec("mean", "scalar_mix", "multihead")
    _, _, y3 = toy_task(NUM_LAYERS, "multihead", n=60, seed=3)
    p3 = torch.rand(60, 3, generator=torch.Generator().manual_seed(0))
    rep3 = evaluate(multi, p3, y3)
    for key in ("ece", "recall_at_1pct_fpr"):
        heads = [h[key] for h in rep3["heads"].values()]
        assert rep3[key] == pytest.approx(float(np.mean(heads)))


NAN = float("nan")
# A multi-head probe's verdict policy, hand-computed: heads toxicity (ok/toxic), hate (flag
# labels) and offensive (scores, never flags); NaN = the row does not annotate that head.
POLICY_SPEC = ProbeSpec(
    name="m",
    token_pool="mean",
    layer_mix="scalar_mix",
    layers=[1],
    hidden_size=8,
    task="multilabel",
    labels=["ok", "toxic", "hate", "offensive"],
    heads=[
        HeadSpec(name="toxicity", task="multiclass", labels=["ok", "toxic"]),
        HeadSpec(name="hate", task="multilabel", labels=["hate"]),
        HeadSpec(name="offensive", task="multilabel", labels=["offensive"]),
    ],
    flag_labels=["toxic", "hate"],
    thresholds={"toxic": 0.5, "hate": 0.5, "offensive": 0.5},
)
TARGETS = torch.tensor(
    [
        [0, 1, 0, NAN],  # r0 toxic: positive
        [1, 0, 1, NAN],  # r1 hate: positive
        [1, 0, 0, 0],  # r2 benign
        [1, 0, NAN, 1],  # r3 offensive only: a policy negative, not benign
        [NAN, NAN, NAN, 0],  # r4 benign, annotates no flagging head: not judged
        [1, 0, 0, NAN],  # r5 benign
    ]
)
PROBS = torch.tensor(  # P(toxic), P(hate), P(offensive) of r0..r5; P(ok) = 1 - P(toxic)
    [
        [0.9, 0.1, 0.2],
        [0.3, 0.4, 0.1],
        [0.2, 0.6, 0.1],
        [0.1, 0.2, 0.9],
        [0.7, 0.1, 0.1],
        [0.05, 0.3, 0.1],
    ]
)
PROBS = torch.cat([1 - PROBS[:, :1], PROBS], dim=1)


def test_benign_rows_are_negative_for_every_head_they_annotate() -> None:
    assert benign_rows(POLICY_SPEC, TARGETS).tolist() == [False, False, True, False, True, True]


def test_the_policy_is_measured_like_one_more_head() -> None:
    p = evaluate_policy(POLICY_SPEC, PROBS, TARGETS)
    # Judged: r0 r1 r2 r3 r5 (r4 annotates no flagging head); positives r0, r1.
    # Flagged: r0 (toxic .9), r2 (hate .6), r4 (toxic .7): TP r0, FP r2, FN r1.
    assert (p["n"], p["positives"], p["heads"]) == (5, 2, ["toxicity", "hate"])
    assert (p["precision"], p["recall"], p["f1"], p["flag_rate"]) == (0.5, 0.5, 0.5, 0.4)
    # Scores (highest flag label): r0 .9+, r2 .6-, r1 .4+, r5 .3-, r3 .2-: AP = .5*1 + .5*2/3.
    assert p["auprc"] == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert p["recall_at_1pct_fpr"] == 0.5  # above the first negative: r0 alone
    # Benign r2, r4, r5: r2 and r4 flagged.
    assert p["benign"] == {"n": 3, "flagged": 2, "rate": pytest.approx(2 / 3)}


def test_the_policy_follows_the_flag_heads() -> None:
    p = evaluate_policy(POLICY_SPEC, PROBS, TARGETS, frozenset({"hate"}))
    # Judged: the rows annotating hate, r0 r1 r2 r5; positive r1; flagged r2 (hate .6) only.
    assert (p["heads"], p["n"], p["positives"], p["f1"]) == (["hate"], 4, 1, 0.0)
    assert p["auprc"] == pytest.approx(0.5)  # r2 .6-, r1 .4+
    # Benign is the same rows (toxic is still a positive of toxicity): r2 flagged of 3.
    assert p["benign"] == {"n": 3, "flagged": 1, "rate": pytest.approx(1 / 3)}
    none = evaluate_policy(POLICY_SPEC, PROBS, TARGETS, frozenset({"offensive"}))
    assert none["heads"] == [] and none["n"] == 0 and none["benign"]["flagged"] == 0
