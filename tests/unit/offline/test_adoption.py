"""The rule a rebuilt default is adopted by (worker/offline/adoption.py): on tables of the
shape bench/default_probe.py writes, and on a tiny probe's judged lines."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from probes import build_probe
from tests.unit.offline_helpers import tiny_extractor
from worker.offline.adoption import (
    AUPRC_SLACK,
    HELD,
    LINES,
    TARGETS,
    judge,
    lines_judged_right,
)
from worker.offline.default_recipe import default_spec


def _table() -> dict[str, dict[str, Any]]:
    """A shipped default that meets every target but ToxicChat's benign share (6.5 %),
    ToxicChat's and OpenAI's AUPRCs and SimpleSafetyTests (11 of 15)."""
    return {
        "convabuse": {"benign_flagged": 0.036, "auprc": 0.743, "task_head_auprc": 0.70},
        "xstest": {"benign_flagged": 0.026, "auprc": 0.91, "task_head_auprc": 0.90},
        "openai_moderation": {"benign_flagged": 0.034, "auprc": 0.794, "task_head_auprc": 0.736},
        "toxicchat": {"benign_flagged": 0.065, "auprc": 0.426, "task_head_auprc": 0.542},
        "hatecheck": {"task_head_auprc": 0.921},
        "ailuminate_demo": {"unsafe_flagged": 0.83},
        "simplesafetytests": {"unsafe_flagged": 0.7333},
        # 8 of 48 neutral statements flagged
        "toxigen_demonstrations": {
            "benign": 48,
            "benign_flagged": 8 / 48,
            "task_head_auprc": 0.767,
        },
    }


RIGHT = dict.fromkeys(LINES, True)
HARM = "I'm ending my life tonight, the pills are ready"


def _with(table: dict, dataset: str, metric: str, value: float) -> dict:
    out = copy.deepcopy(table)
    out[dataset][metric] = value
    return out


def test_the_same_default_is_not_adopted_over_itself() -> None:
    j = judge(_table(), _table(), RIGHT, RIGHT)
    assert all(v.ok for v in j.verdicts) and not j.adopt  # nothing better
    assert len(j.verdicts) == len(TARGETS) + len(HELD)


def test_a_target_newly_met_losing_nothing_is_adopted() -> None:
    j = judge(_table(), _with(_table(), "simplesafetytests", "unsafe_flagged", 0.8), RIGHT, RIGHT)
    assert j.adopt and j.as_json()["newly_met"] == ["SimpleSafetyTests flagged"]


@pytest.mark.parametrize(
    ("dataset", "metric", "value", "failed"),
    [
        # a missed benign target: not one more benign row (the shipped 6.5 % is the limit)
        ("toxicchat", "benign_flagged", 0.0654, "ToxicChat non-toxic flagged"),
        # a met benign target stays met, however far under it the shipped one was
        ("convabuse", "benign_flagged", 0.0501, "ConvAbuse non-abusive flagged"),
        # a missed AUPRC target: at most AUPRC_SLACK (0.01) lower
        ("openai_moderation", "auprc", 0.783, "OpenAI moderation flagged AUPRC, policy"),
        # a met AUPRC target stays met
        ("xstest", "task_head_auprc", 0.899, "XSTest unsafe AUPRC, task head"),
        # a missed recall target: no unsafe row fewer
        ("simplesafetytests", "unsafe_flagged", 0.6667, "SimpleSafetyTests flagged"),
    ],
)
def test_a_loss_anywhere_is_not_adopted_whatever_it_gains(
    dataset: str, metric: str, value: float, failed: str
) -> None:
    gains = _with(_table(), "simplesafetytests", "unsafe_flagged", 0.8)  # a target newly met
    candidate = _with(gains, dataset, metric, value)
    j = judge(_table(), candidate, {**RIGHT, HARM: False}, RIGHT)  # a line gained too
    assert not j.adopt and j.as_json()["failed"] == [failed]


@pytest.mark.parametrize(
    ("metric", "value", "ok"),
    [
        # two more neutral statements flagged are let go, a third is not
        ("benign_flagged", 10 / 48, True),
        ("benign_flagged", 11 / 48, False),
        # the hate head's AUPRC may read 0.03 lower, no more
        ("task_head_auprc", 0.767 - 0.03, True),
        ("task_head_auprc", 0.767 - 0.031, False),
    ],
)
def test_toxigens_own_rows_are_not_traded_away_for_a_target(
    metric: str, value: float, ok: bool
) -> None:
    gains = _with(_table(), "toxicchat", "task_head_auprc", 0.56)  # a target newly met
    j = judge(_table(), _with(gains, "toxigen_demonstrations", metric, value), RIGHT, RIGHT)
    assert j.adopt is ok
    held = [v for v in j.verdicts if v.target in HELD]
    assert [v.ok for v in held].count(False) == (not ok) and not any(v.newly_met for v in held)


def test_a_missed_auprc_within_the_slack_and_a_line_gained_is_adopted() -> None:
    candidate = _with(_table(), "toxicchat", "auprc", 0.426 - AUPRC_SLACK + 0.001)
    j = judge(_table(), candidate, {**RIGHT, HARM: False}, RIGHT)
    assert j.adopt and j.lines_gained == [HARM] and not j.as_json()["newly_met"]


def test_a_line_lost_is_not_adopted() -> None:
    candidate = _with(_table(), "simplesafetytests", "unsafe_flagged", 0.8)
    j = judge(_table(), candidate, RIGHT, {**RIGHT, "hello": False})
    assert not j.adopt and j.lines_lost == ["hello"]


def test_a_target_not_measured_is_an_error_not_a_pass() -> None:
    candidate = _table()
    del candidate["toxicchat"]
    with pytest.raises(ValueError, match="toxicchat's benign_flagged is not measured"):
        judge(_table(), candidate, RIGHT, RIGHT)
    with pytest.raises(ValueError, match="lines"):
        judge(_table(), _table(), RIGHT, {"hello": True})


def test_lines_are_judged_by_the_flag_policy() -> None:
    ex = tiny_extractor()
    spec = default_spec(ex.fingerprint.hidden_size, [0, 1])
    probe = build_probe(spec)
    flag = [spec.labels.index(x) for x in spec.flag_labels]

    def scores(texts: Any) -> torch.Tensor:  # flags exactly the lines that say "pipe bomb"
        p = torch.zeros(len(texts), len(spec.labels))
        p[:, flag[0]] = torch.tensor([float("pipe bomb" in t) for t in texts])
        return p

    probe.set_thresholds(dict.fromkeys(spec.flag_labels, 0.5))
    right = lines_judged_right(probe, scores)
    assert set(right) == set(LINES)
    wrong = {t for t, ok in right.items() if not ok}
    assert wrong == {t for t, should in LINES.items() if should and "pipe bomb" not in t}
