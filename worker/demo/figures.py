"""The demo's numbers: live figures for the terminal view, final ones for the report.

Everything here reads what the demo observed on the topics (:class:`Observed`: verdicts,
labels sent) and the plain values the run hands over (the updater's learner, the
registry, the live versions); nothing changes state, and nothing here imports the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from probes.metrics import percentile, precision_recall_f1
from schemas import Verdict

if TYPE_CHECKING:
    from worker.learning.online_learner import OnlineLearner
    from worker.store.checkpoints import CheckpointRegistry

__all__ = ["Observed", "final_figures", "snapshot"]


@dataclass
class Observed:
    """What came out of the system, with arrival times."""

    sent: dict[str, float] = field(default_factory=dict)  # message id -> produce time
    truth: dict[str, str] = field(default_factory=dict)  # message id -> label (labeled ones)
    verdicts: dict[str, tuple[float, Verdict]] = field(default_factory=dict)
    reviews: int = 0
    dead_letters: int = 0
    labels_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _f1(pairs: list[tuple[bool, bool]]) -> float:
    """F1 of ``(flagged, truly flag)`` pairs."""
    tp = sum(1 for p, t in pairs if p and t)
    fp = sum(1 for p, t in pairs if p and not t)
    fn = sum(1 for p, t in pairs if not p and t)
    return precision_recall_f1(tp, fp, fn)[2]


def snapshot(
    obs: Observed,
    *,
    started: float,
    total: int,
    learning: dict[str, Any],
    versions: dict[str, int | None],
) -> dict[str, Any]:
    """Live figures (cheap; called by the live view twice a second).

    ``started`` is the run's start (``time.time()``), ``total`` the messages it will
    send, ``learning`` the learner's ``snapshot()`` (empty before it exists) and
    ``versions`` the scorer's stage -> version for the demo probe.
    """
    with obs.lock:
        sent, scored = len(obs.sent), len(obs.verdicts)
        lat = [1000 * (t - obs.sent[m]) for m, (t, _) in obs.verdicts.items() if m in obs.sent]
        arrivals = sorted(t for t, _ in obs.verdicts.values())
        reviews, dead, labels = obs.reviews, obs.dead_letters, obs.labels_sent
    recent = [t for t in arrivals if t >= time.time() - 10]
    preq = learning.get("prequential", {})
    return {
        "elapsed_s": time.time() - started,
        "total": total,
        "sent": sent,
        "scored": scored,
        "msg_per_s": len(recent) / 10.0,
        "p50_ms": percentile(lat[-200:], 0.5),
        "p99_ms": percentile(lat[-200:], 0.99),
        "live": versions.get("live"),
        "canary": versions.get("canary"),
        "prequential_f1": preq.get("prequential_f1"),
        "labels_sent": labels,
        "labels_learned": learning.get("labels_seen", 0),
        "dead_letters": dead,
        "reviews": reviews,
    }


def final_figures(
    obs: Observed,
    *,
    run_id: str,
    started: float,
    total: int,
    learner: OnlineLearner | None,
    registry: CheckpointRegistry | None,
) -> dict[str, Any]:
    """Everything the report shows, from what was observed, the updater's ``learner``
    and the ``registry`` (either may be ``None``: their figures are then empty)."""
    with obs.lock:
        verdicts = dict(obs.verdicts)
        # Scored order (verdict arrival): a backlog is not scored in the order it was sent.
        order = sorted(verdicts, key=lambda m: verdicts[m][0])
        sent, truth = dict(obs.sent), dict(obs.truth)
    spec = learner.probe.spec if learner else None
    flags = set(spec.flag_labels) if spec else set()
    served: list[dict[str, Any]] = []
    for mid in order:
        if mid in truth and mid in verdicts:
            res = verdicts[mid][1].results[0]
            served.append(
                {
                    "t": sent[mid] - started,
                    "version": res.version,
                    "pred": res.predicted[0] if res.predicted else "",
                    "truth": truth[mid],
                    "flagged": res.flagged,
                    "flag_true": truth[mid] in flags,
                }
            )
    window = 40
    curve = [
        {
            "n": i + 1,
            "version": s["version"],
            "f1": _f1(
                [(x["flagged"], x["flag_true"]) for x in served[max(0, i - window + 1) : i + 1]]
            ),
        }
        for i, s in enumerate(served)
    ]
    labels = spec.labels if spec else sorted({s["truth"] for s in served})
    confusion = [
        [sum(1 for s in served if s["truth"] == a and s["pred"] == b) for b in labels]
        for a in labels
    ]
    lat = [1000 * (t - sent[m]) for m, (t, _) in verdicts.items() if m in sent]
    arrivals = sorted(t - started for t, _ in verdicts.values())
    half = served[len(served) // 2 :]
    return {
        "run_id": run_id,
        "messages": total,
        "verdicts": len(verdicts),
        "dead_letters": obs.dead_letters,
        "reviews": obs.reviews,
        "labels": obs.labels_sent,
        "elapsed_s": round(time.time() - started, 1),
        "latency_ms": lat,
        "arrivals_s": arrivals,
        "p50_ms": round(percentile(lat, 0.5), 1),
        "p99_ms": round(percentile(lat, 0.99), 1),
        "served": served,
        "curve": curve,
        "labels_order": labels,
        "confusion": confusion,
        "served_f1_all": round(_f1([(s["flagged"], s["flag_true"]) for s in served]), 4),
        "served_f1_second_half": round(_f1([(s["flagged"], s["flag_true"]) for s in half]), 4),
        "versions": _version_points(registry),
        "layer_weights": _layer_weights(learner),
        "class_layers": _class_layers(learner),
    }


def _version_points(registry: CheckpointRegistry | None) -> list[dict[str, Any]]:
    if registry is None:
        return []
    points = []
    for v in registry.versions():
        m = registry.manifest(v)
        points.append(
            {
                "version": v,
                "labels_seen": m.counters.labels_seen,
                "f1": m.metrics.get("prequential_f1"),
                "auprc": m.metrics.get("prequential_auprc"),
                "entropy": m.metrics.get("layer_entropy"),
            }
        )
    return points


def _layer_weights(learner: OnlineLearner | None) -> dict[str, Any]:
    if learner is None:
        return {}
    snap = learner.snapshot()
    return {"layers": snap["layers"], "weights": snap["layer_weights"]}


def _class_layers(learner: OnlineLearner | None) -> dict[str, Any]:
    """Per-class layer use of the final probe over the updater's replay buffer (recent
    labeled messages, class-balanced); empty without a learner or examples."""
    from probes.explain import class_layer_use_batches
    from worker.learning.replay import collate_chunks

    if learner is None:
        return {}
    examples = [e for bucket in learner.replay.buckets for e in bucket]
    if not examples:
        return {}
    use = class_layer_use_batches(learner.probe, collate_chunks(examples, chunk=64))
    return {
        "labels": list(use.labels),
        "layers": list(use.layers),
        "rows": use.rows.tolist(),
        "shares": [[round(float(v), 4) for v in row] for row in use.shares()],
    }
