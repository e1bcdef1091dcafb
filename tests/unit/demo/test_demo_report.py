"""The demo report agrees with itself: its headline served F1 is what its plots draw."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from schemas import HeadResult, HeadSpec, ProbeResult, ProbeSpec, Verdict, utcnow
from tests.report_checks import check_report_agrees, headline
from worker.commands.demo import summary
from worker.demo.figures import Observed, final_figures
from worker.demo.report import write_report

T0 = 1000.0
SPEC = ProbeSpec(
    name="demo",
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


def _verdict(mid: str, version: int, toxic: bool, violent: bool) -> Verdict:
    tox = "toxic" if toxic else "non-toxic"
    result = ProbeResult(
        probe="demo",
        version=version,
        scores={"non-toxic": 0.5, "toxic": 0.5, "violence": 0.5},
        predicted=[tox, *(["violence"] if violent else [])],
        flagged=toxic or violent,
        heads={
            "toxicity": HeadResult(predicted=[tox], flagged=toxic),
            "violence": HeadResult(predicted=["violence"] if violent else [], flagged=violent),
        },
    )
    return Verdict(
        verdict_id=Verdict.make_id(mid, [result]),
        message_id=mid,
        decision="flag" if result.flagged else "allow",
        results=[result],
        latency_ms=5.0,
        worker_id="w",
        scored_at=utcnow(),
    )


def _observed(n: int = 90, seed: int = 0) -> Observed:
    """``n`` messages, 2 of 3 labeled (toxic, non-toxic, now and then violence); the served
    versions get it right more often as they rise."""
    rng = random.Random(seed)
    obs = Observed(labels_sent=0)
    for i in range(n):
        mid = f"m{i}"
        version = i // 10
        truth = rng.choice(["toxic", "non-toxic", "non-toxic", "violence"])
        right = rng.random() < 0.5 + 0.05 * version
        toxic = (truth == "toxic") == right
        violent = truth == "violence" and right
        obs.sent[mid] = T0 + i
        obs.verdicts[mid] = (T0 + i + 0.5, _verdict(mid, version, toxic, violent))
        if i % 3:
            obs.truth[mid] = truth
            obs.labels_sent += 1
    return obs


def _learner() -> Any:
    return SimpleNamespace(
        probe=SimpleNamespace(spec=SPEC),
        snapshot=lambda: {"layers": [1], "layer_weights": [1.0]},
        replay=SimpleNamespace(buckets=[]),
    )


def _report(tmp_path: Path, **kw: Any) -> tuple[dict[str, Any], Path]:
    figures = final_figures(
        _observed(**kw),
        run_id="r<1>",
        started=T0,
        total=90,
        learner=_learner(),
        registry=None,
        origin={"version": 0, "source": "the packaged default probe (<x>)", "labels_seen": 7},
    )
    return figures, write_report(figures, tmp_path)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_headline_served_f1_is_what_the_plots_draw(tmp_path: Path, seed: int) -> None:
    figures, page = _report(tmp_path, seed=seed)
    check_report_agrees(tmp_path)
    rows = headline(page)
    assert [r[0].split(" (")[0] for r in rows[1:]] == [
        "flag policy",
        "head toxicity",
        "head violence",
    ]
    for name in ("learning.png", "confusion.png", "latency.png", "throughput.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    # The command's closing lines say the same numbers.
    said = summary(figures)
    for row in rows[1:]:
        assert (
            f"{row[0].split(' (')[0]} {row[2]} (first half {row[3]}, second half {row[4]})" in said
        )


def test_the_check_fails_when_a_plot_disagrees(tmp_path: Path) -> None:
    _report(tmp_path)
    path = tmp_path / "figures.json"
    figures = json.loads(path.read_text())
    window = figures["quality"]["windows"][-1]["policy"]  # the learning plot's last point
    window["fp"], window["tn"] = window["fp"] + 3, window["tn"] - 3
    path.write_text(json.dumps(figures))
    with pytest.raises(AssertionError):
        check_report_agrees(tmp_path)


def test_the_page_escapes_what_it_shows_and_says_where_v0_came_from(tmp_path: Path) -> None:
    _, page = _report(tmp_path)
    text = page.read_text()
    assert "r&lt;1&gt;" in text and "<1>" not in text
    assert "the packaged default probe (&lt;x&gt;)" in text and "(<x>)" not in text
    assert "learned from 7 labels before this run" in text


def test_layer_plots_get_a_whole_row_and_only_latency_and_throughput_share_one(
    tmp_path: Path,
) -> None:
    """The packaged default mixes all 31 layers: its layer-weight plot, squeezed into half
    a row at 1280 px, drew its tick labels and title below reading size."""
    _, page = _report(tmp_path)
    text = page.read_text()
    grid = text[text.index('<div class="grid">') :]
    grid = grid[: grid.index("</div>")]
    assert "latency.png" in grid and "throughput.png" in grid
    assert "layer_weights.png" in text and "layer_weights.png" not in grid
