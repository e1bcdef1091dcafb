"""The demo's figures from a hand-made :class:`Observed`: no broker, no roles, no LLM."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from schemas import ProbeResult, ProbeSpec, Verdict, utcnow
from worker.demo.figures import Observed, final_figures, snapshot

T0 = 1000.0


def _verdict(mid: str, pred: str, version: int) -> Verdict:
    flagged = pred == "toxic"
    result = ProbeResult(
        probe="demo",
        version=version,
        scores={pred: 0.9},
        predicted=[pred],
        flagged=flagged,
    )
    return Verdict(
        verdict_id=Verdict.make_id(mid, [result]),
        message_id=mid,
        decision="flag" if flagged else "allow",
        results=[result],
        latency_ms=5.0,
        worker_id="w",
        scored_at=utcnow(),
    )


def _observed() -> Observed:
    """Four messages sent a second apart; m3 is scored before m2; m4 has no label."""
    obs = Observed(reviews=2, dead_letters=1, labels_sent=3)
    truth = {"m1": "toxic", "m2": "ok", "m3": "toxic"}
    preds = {"m1": ("toxic", 1), "m2": ("toxic", 1), "m3": ("ok", 2), "m4": ("ok", 2)}
    arrive = {"m1": 1.1, "m3": 3.2, "m2": 3.5, "m4": 4.3}
    for i, mid in enumerate(("m1", "m2", "m3", "m4"), start=1):
        obs.sent[mid] = T0 + i
        pred, version = preds[mid]
        obs.verdicts[mid] = (T0 + arrive[mid], _verdict(mid, pred, version))
    obs.truth.update(truth)
    return obs


class _Registry:
    """The two registry calls the figures make."""

    def versions(self) -> list[int]:
        return [1, 2]

    def manifest(self, v: int) -> Any:
        return SimpleNamespace(
            counters=SimpleNamespace(labels_seen=10 * v),
            metrics={"prequential_f1": 0.5 * v, "layer_entropy": 1.0},
        )


def _learner(spec: Any = None) -> Any:
    """The three things the figures read of the updater's learner."""
    spec = spec or ProbeSpec(
        name="demo",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1],
        hidden_size=8,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )
    return SimpleNamespace(
        probe=SimpleNamespace(spec=spec),
        snapshot=lambda: {"layers": [3, 5], "layer_weights": [0.25, 0.75]},
        replay=SimpleNamespace(buckets=[]),
    )


def test_final_figures_without_learner_or_registry() -> None:
    f = final_figures(_observed(), run_id="r1", started=T0, total=5, learner=None, registry=None)
    assert (f["run_id"], f["messages"], f["verdicts"]) == ("r1", 5, 4)
    assert (f["dead_letters"], f["reviews"], f["labels"]) == (1, 2, 3)
    assert f["latency_ms"] == pytest.approx([100.0, 1500.0, 200.0, 300.0])
    assert f["arrivals_s"] == pytest.approx([1.1, 3.2, 3.5, 4.3])
    # Without a learner there is no spec to judge by: no served quality, nothing made up.
    assert f["served"] == [] and f["served_f1"] is None and f["quality"]["windows"] == []
    assert f["versions"] == [] and f["layer_weights"] == {} and f["class_layers"] == {}
    assert f["origin"]["labels_seen"] == 0


def test_final_figures_judge_served_verdicts_in_scored_order() -> None:
    f = final_figures(
        _observed(),
        run_id="r",
        started=T0,
        total=4,
        learner=_learner(),
        registry=cast(Any, _Registry()),
        origin={"version": 0, "source": "the packaged default probe (x)", "labels_seen": 5},
    )
    # Served in scored order (m3 before m2), only the labeled ones.
    assert [s["t"] for s in f["served"]] == [1.0, 3.0, 2.0]
    assert [s["version"] for s in f["served"]] == [1, 2, 1]
    assert [s["flag_true"] for s in f["served"]] == [True, True, False]
    # m1 toxic->toxic (tp), m3 toxic->ok (fn), m2 ok->toxic (fp): F1 = 2/(2+1+1).
    assert f["served_f1"] == pytest.approx(0.5)
    assert f["quality"]["policy"]["all"] == {"tp": 1, "fp": 1, "fn": 1, "tn": 0}
    # Halves: [m1] and [m3, m2]; windows add up to them.
    assert f["served_f1_first_half"] == 1.0 and f["served_f1_second_half"] == 0.0
    assert [w["half"] for w in f["quality"]["windows"]] == [1, 2, 2]
    (head,) = f["quality"]["heads"]  # a single-head probe: its head is named after it
    assert head["name"] == "demo" and head["all"] == {"tp": 1, "fp": 1, "fn": 1, "tn": 0}
    assert head["confusion"] == {
        "rows": ["ok", "toxic"],
        "cols": ["ok", "toxic"],
        "counts": [[0, 1], [1, 1]],
    }
    assert f["head_flags"] == {"demo": 2}  # m1 and m2 of the four verdicts
    # The learning plot's x-axis: this run's labels, less what v0 had learned before it.
    assert [(p["version"], p["labels"]) for p in f["versions"]] == [(1, 5), (2, 15)]
    assert f["layer_weights"] == {"layers": [3, 5], "weights": [0.25, 0.75]}
    assert f["class_layers"] == {}  # an empty replay buffer


def test_snapshot() -> None:
    snap = snapshot(
        _observed(),
        started=T0,
        total=8,
        learning={"labels_seen": 13, "prequential": {"prequential_f1": 0.4}},
        versions={"live": 2, "canary": None},
        spec=_learner().probe.spec,
        base_labels=10,
    )
    assert (snap["sent"], snap["scored"], snap["total"]) == (4, 4, 8)
    assert (snap["live"], snap["canary"]) == (2, None)
    # Served quality, as the report defines it; the labels learned are this run's only.
    assert snap["served_f1"] == pytest.approx(0.5) and snap["served_f1_heads"] == {"demo": 0.5}
    assert (snap["labels_sent"], snap["labels_learned"], snap["judged"]) == (3, 3, 3)
    assert (snap["reviews"], snap["dead_letters"]) == (2, 1)
    assert snap["p50_ms"] == pytest.approx(300.0)
    assert snap["msg_per_s"] == 0.0  # every verdict arrived long ago
    empty = snapshot(Observed(), started=T0, total=0, learning={}, versions={})
    assert empty["scored"] == 0 and empty["live"] is None and empty["labels_learned"] == 0
    assert empty["served_f1"] is None and empty["window"] == 0
