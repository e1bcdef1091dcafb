"""The demo's figures from a hand-made :class:`Observed`: no broker, no roles, no LLM."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from schemas import ProbeResult, Verdict, utcnow
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


def test_final_figures_without_learner_or_registry() -> None:
    f = final_figures(_observed(), run_id="r1", started=T0, total=5, learner=None, registry=None)
    assert (f["run_id"], f["messages"], f["verdicts"]) == ("r1", 5, 4)
    assert (f["dead_letters"], f["reviews"], f["labels"]) == (1, 2, 3)
    # Served in scored order (m3 before m2), only the labeled ones.
    assert [s["t"] for s in f["served"]] == [1.0, 3.0, 2.0]
    assert [s["version"] for s in f["served"]] == [1, 2, 1]
    assert f["latency_ms"] == pytest.approx([100.0, 1500.0, 200.0, 300.0])
    assert f["arrivals_s"] == pytest.approx([1.1, 3.2, 3.5, 4.3])
    # Without a learner there is no spec: the labels come from the truth, none flags.
    assert not any(s["flag_true"] for s in f["served"])
    assert f["labels_order"] == ["ok", "toxic"]
    assert f["confusion"] == [[0, 1], [1, 1]]
    assert f["versions"] == [] and f["layer_weights"] == {} and f["class_layers"] == {}
    assert len(f["curve"]) == 3 and f["curve"][-1]["n"] == 3


def test_final_figures_reads_the_learner_spec_and_the_registry() -> None:
    learner: Any = SimpleNamespace(  # the three things the figures read
        probe=SimpleNamespace(spec=SimpleNamespace(flag_labels=["toxic"], labels=["ok", "toxic"])),
        snapshot=lambda: {"layers": [3, 5], "layer_weights": [0.25, 0.75]},
        replay=SimpleNamespace(buckets=[]),
    )
    f = final_figures(
        _observed(),
        run_id="r",
        started=T0,
        total=4,
        learner=learner,
        registry=cast(Any, _Registry()),
    )
    # m1 toxic->toxic (tp), m3 toxic->ok (fn), m2 ok->toxic (fp): F1 = 2/(2+1+1).
    assert f["served_f1_all"] == pytest.approx(0.5)
    assert [s["flag_true"] for s in f["served"]] == [True, True, False]
    assert f["versions"] == [
        {"version": 1, "labels_seen": 10, "f1": 0.5, "auprc": None, "entropy": 1.0},
        {"version": 2, "labels_seen": 20, "f1": 1.0, "auprc": None, "entropy": 1.0},
    ]
    assert f["layer_weights"] == {"layers": [3, 5], "weights": [0.25, 0.75]}
    assert f["class_layers"] == {}  # an empty replay buffer


def test_snapshot() -> None:
    snap = snapshot(
        _observed(),
        started=T0,
        total=8,
        learning={"labels_seen": 3, "prequential": {"prequential_f1": 0.4}},
        versions={"live": 2, "canary": None},
    )
    assert (snap["sent"], snap["scored"], snap["total"]) == (4, 4, 8)
    assert (snap["live"], snap["canary"], snap["prequential_f1"]) == (2, None, 0.4)
    assert (snap["labels_sent"], snap["labels_learned"]) == (3, 3)
    assert (snap["reviews"], snap["dead_letters"]) == (2, 1)
    assert snap["p50_ms"] == pytest.approx(300.0)
    assert snap["msg_per_s"] == 0.0  # every verdict arrived long ago
    empty = snapshot(Observed(), started=T0, total=0, learning={}, versions={})
    assert empty["scored"] == 0 and empty["live"] is None and empty["labels_learned"] == 0
