"""Served quality (``worker.demo.quality``): per head and for the flag policy, one definition."""

from __future__ import annotations

import doctest

import pytest

import worker.demo.quality
from schemas import HeadResult, HeadSpec, ProbeResult, ProbeSpec, Verdict, utcnow
from worker.demo.quality import NONE, Cells, Judged, half_windows, head_cells, judge, policy_cells

SPEC = ProbeSpec(  # two heads: toxicity (multiclass) and violence (one multi-label label)
    name="moderation",
    token_pool="mean",
    layer_mix="scalar_mix",
    layers=[1],
    hidden_size=8,
    task="multilabel",
    labels=["non-toxic", "toxic", "violence"],
    flag_labels=["toxic", "violence"],
    heads=[
        HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
        HeadSpec(name="violence", task="multilabel", labels=["violence"]),
    ],
)


def _verdict(mid: str, toxicity: str, violence: bool, flagged: bool) -> Verdict:
    heads = {
        "toxicity": HeadResult(predicted=[toxicity], flagged=toxicity == "toxic"),
        "violence": HeadResult(predicted=["violence"] if violence else [], flagged=violence),
    }
    predicted = [toxicity, *(["violence"] if violence else [])]
    result = ProbeResult(
        probe="moderation",
        version=3,
        scores={"non-toxic": 0.5, "toxic": 0.5, "violence": 0.5},
        predicted=predicted,
        flagged=flagged,
        heads=heads,
    )
    return Verdict(
        verdict_id=Verdict.make_id(mid, [result]),
        message_id=mid,
        decision="flag" if flagged else "allow",
        results=[result],
        latency_ms=1.0,
        worker_id="w",
        scored_at=utcnow(),
    )


def test_doctests() -> None:
    assert doctest.testmod(worker.demo.quality).failed == 0


def test_a_head_is_judged_by_its_own_prediction_the_policy_by_the_verdict() -> None:
    # Labeled non-toxic; the toxicity head says non-toxic, violence flags the verdict.
    j = judge(_verdict("m", "non-toxic", True, True), "non-toxic", SPEC, None)
    assert (j.head, j.head_pred, j.head_flag) == ("toxicity", "non-toxic", False)
    assert (j.flagged, j.flag_true, j.version) == (True, False, 3)
    assert head_cells([j], "toxicity", ["toxic"]).as_dict() == {"tp": 0, "fp": 0, "fn": 0, "tn": 1}
    assert policy_cells([j]).as_dict() == {"tp": 0, "fp": 1, "fn": 0, "tn": 0}


def test_a_label_of_a_head_outside_the_policy_is_not_a_flag_for_the_policy() -> None:
    j = judge(_verdict("m", "toxic", False, False), "toxic", SPEC, frozenset({"violence"}))
    assert j.head_flag and not j.flagged and not j.flag_true
    assert policy_cells([j]).as_dict() == {"tp": 0, "fp": 0, "fn": 0, "tn": 1}


def test_a_label_the_probe_lacks_judges_no_head() -> None:
    j = judge(_verdict("m", "toxic", False, True), "spam", SPEC, None)
    assert (j.head, j.head_pred, j.head_flag, j.flag_true) == (None, NONE, False, False)


def test_a_multilabel_head_that_predicted_nothing() -> None:
    j = judge(_verdict("m", "toxic", False, True), "violence", SPEC, None)
    assert (j.head, j.head_pred, j.head_flag, j.flag_true) == ("violence", NONE, False, True)


def test_f1_is_undefined_without_positives() -> None:
    assert Cells(tn=5).f1 is None
    assert Cells(tp=1, fp=1, fn=0, tn=3).f1 == pytest.approx(2 / 3, abs=1e-4)
    total = Cells(tp=1)
    total += Cells(fp=2, tn=1)
    assert total.as_dict() == {"tp": 1, "fp": 2, "fn": 0, "tn": 1} and total.n == 4


@pytest.mark.parametrize("n", [0, 1, 2, 7, 9, 145])
def test_the_windows_of_each_half_add_up_to_that_half(n: int) -> None:
    rows = [
        Judged(f"m{i}", float(i), 0, "toxic", "toxicity", "toxic", True, i % 3 == 0, True)
        for i in range(n)
    ]
    windows = half_windows(rows, per_half=4)
    assert [r for _, w in windows for r in w] == rows  # in order, each row once
    for half, rows_of_half in ((1, rows[: n // 2]), (2, rows[n // 2 :])):
        cells = Cells()
        for h, w in windows:
            if h == half:
                cells += policy_cells(w)
        assert cells == policy_cells(rows_of_half)
    assert len(windows) == min(4, n // 2) + min(4, n - n // 2)
