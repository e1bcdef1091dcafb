"""The demo's numbers: live figures for the terminal view, final ones for the report.

Everything here reads what the demo observed on the topics (:class:`Observed`: verdicts,
labels sent) and the plain values the run hands over (the updater's learner, the
registry, the live versions); nothing changes state, and nothing here imports the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from probes.decision import flagging_heads
from probes.metrics import percentile
from schemas import HeadSpec, ProbeSpec, Verdict
from worker.demo.quality import NONE, Cells, Judged, half_windows, head_cells, judge, policy_cells

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


def _judged(
    obs: Observed, spec: ProbeSpec | None, policy: frozenset[str] | None, started: float
) -> list[Judged]:
    """The labeled messages with a verdict, judged (:mod:`worker.demo.quality`), in the
    order they were scored (a backlog is not scored in the order it was sent)."""
    if spec is None:
        return []
    with obs.lock:
        verdicts, truth, sent = dict(obs.verdicts), dict(obs.truth), dict(obs.sent)
    order = sorted((m for m in verdicts if m in truth), key=lambda m: verdicts[m][0])
    return [judge(verdicts[m][1], truth[m], spec, policy, sent[m] - started) for m in order]


def _heads_judged(rows: list[Judged], spec: ProbeSpec) -> list[HeadSpec]:
    """The heads of ``spec`` that some labeled message judged, in spec order."""
    named = {r.head for r in rows}
    return [h for h in spec.head_specs if h.name in named]


def snapshot(
    obs: Observed,
    *,
    started: float,
    total: int,
    learning: dict[str, Any],
    versions: dict[str, int | None],
    spec: ProbeSpec | None = None,
    policy: frozenset[str] | None = None,
    base_labels: int = 0,
    window: int = 40,
) -> dict[str, Any]:
    """Live figures (cheap; called by the live view twice a second).

    ``started`` is the run's start (``time.time()``), ``total`` the messages it will
    send, ``learning`` the learner's ``snapshot()`` (empty before it exists),
    ``versions`` the scorer's stage -> version for the demo probe, ``spec`` the probe's
    spec and ``policy`` the flag policy's heads (served quality, over the last ``window``
    labeled messages scored), ``base_labels`` the labels the starting version had already
    learned (the packaged default's: not this run's).
    """
    with obs.lock:
        sent, scored = len(obs.sent), len(obs.verdicts)
        lat = [1000 * (t - obs.sent[m]) for m, (t, _) in obs.verdicts.items() if m in obs.sent]
        arrivals = sorted(t for t, _ in obs.verdicts.values())
        reviews, dead, labels = obs.reviews, obs.dead_letters, obs.labels_sent
    recent = [t for t in arrivals if t >= time.time() - 10]
    rows = _judged(obs, spec, policy, started)
    last = rows[-window:]
    heads = {}
    if spec is not None:
        for h in _heads_judged(rows, spec):
            flags = [x for x in h.labels if x in spec.flag_labels]
            heads[h.name] = head_cells(last, h.name, flags).f1
    learned = learning.get("labels_seen")
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
        "judged": len(rows),
        "window": len(last),
        "served_f1": policy_cells(last).f1,
        "served_f1_heads": heads,
        "labels_sent": labels,
        "labels_learned": max(0, learned - base_labels) if learned is not None else 0,
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
    policy: frozenset[str] | None = None,
    origin: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the report shows, from what was observed, the updater's ``learner``
    and the ``registry`` (either may be ``None``: their figures are then empty).

    ``policy``: the flag policy's heads (None: every head with flag labels); ``origin``:
    where the first served version came from (``labels_seen``: what it had learned before
    this run, left out of the learning plot's axis)."""
    with obs.lock:
        verdicts = dict(obs.verdicts)
        sent = dict(obs.sent)
    spec = learner.probe.spec if learner else None
    origin = origin or {"version": 1, "source": "trained from zero", "labels_seen": 0}
    rows = _judged(obs, spec, policy, started)
    lat = [1000 * (t - sent[m]) for m, (t, _) in verdicts.items() if m in sent]
    arrivals = sorted(t - started for t, _ in verdicts.values())
    quality = _quality(rows, spec, policy) if spec is not None else _no_quality()
    halves = quality["policy"]
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
        "served": [asdict(r) for r in rows],
        "judged": len(rows),
        "quality": quality,
        "served_f1": Cells.of(halves["all"]).f1,
        "served_f1_first_half": Cells.of(halves["first_half"]).f1,
        "served_f1_second_half": Cells.of(halves["second_half"]).f1,
        "head_flags": _head_flags(verdicts, spec),
        "origin": origin,
        "versions": _version_points(registry, origin.get("labels_seen", 0)),
        "layer_weights": _layer_weights(learner),
        "class_layers": _class_layers(learner),
    }


def _no_quality() -> dict[str, Any]:
    empty = Cells().as_dict()
    policy = {"heads": [], "flag_labels": [], "all": empty, "first_half": empty}
    return {"policy": {**policy, "second_half": empty}, "heads": [], "windows": []}


def _quality(rows: list[Judged], spec: ProbeSpec, policy: frozenset[str] | None) -> dict[str, Any]:
    """Served quality (:mod:`worker.demo.quality`) over ``rows``: all, per half, per
    window, for the flag policy and for each head the labels judged."""
    mid = len(rows) // 2
    halves = {"all": rows, "first_half": rows[:mid], "second_half": rows[mid:]}
    policed = flagging_heads(spec, policy)
    flaggers = [h.name for h in spec.head_specs if any(x in policed.flag_labels for x in h.labels)]
    heads: list[dict[str, Any]] = []
    flag_labels: dict[str, list[str]] = {}  # head -> its flag labels
    for h in _heads_judged(rows, spec):
        flags = flag_labels[h.name] = [x for x in h.labels if x in spec.flag_labels]
        mine = [r for r in rows if r.head == h.name]
        truths = [x for x in h.labels if any(r.truth == x for r in mine)]
        cols = [
            x for x in h.labels if h.task == "multiclass" or any(r.head_pred == x for r in mine)
        ]
        if any(r.head_pred == NONE for r in mine):
            cols.append(NONE)
        counts = [
            [sum(1 for r in mine if r.truth == a and r.head_pred == b) for b in cols]
            for a in truths
        ]
        heads.append(
            {
                "name": h.name,
                "flag_labels": flags,
                **{k: head_cells(v, h.name, flags).as_dict() for k, v in halves.items()},
                "confusion": {"rows": truths, "cols": cols, "counts": counts},
            }
        )
    windows = []
    first = 1
    for half, w in half_windows(rows):
        windows.append(
            {
                "half": half,
                "first": first,
                "last": first + len(w) - 1,
                "versions": [min(r.version for r in w), max(r.version for r in w)],
                "policy": policy_cells(w).as_dict(),
                "heads": {
                    name: head_cells(w, name, f).as_dict() for name, f in flag_labels.items()
                },
            }
        )
        first += len(w)
    return {
        "policy": {
            "heads": flaggers,
            "flag_labels": list(policed.flag_labels),
            **{k: policy_cells(v).as_dict() for k, v in halves.items()},
        },
        "heads": heads,
        "windows": windows,
    }


def _head_flags(
    verdicts: dict[str, tuple[float, Verdict]], spec: ProbeSpec | None
) -> dict[str, int]:
    """Per head of ``spec`` that has flag labels: how many verdicts it flagged in (labeled
    or not, whether or not the flag policy counts it)."""
    if spec is None:
        return {}
    out: dict[str, int] = {}
    for h in spec.head_specs:
        flags = [x for x in h.labels if x in spec.flag_labels]
        if not flags:
            continue
        n = 0
        for _, v in verdicts.values():
            res = next((r for r in v.results if r.probe == spec.name), v.results[0])
            hr = res.heads.get(h.name) if res.heads else None
            predicted = hr.predicted if hr is not None else res.predicted
            n += any(x in flags for x in predicted)
        out[h.name] = n
    return out


def _version_points(registry: CheckpointRegistry | None, base: int) -> list[dict[str, Any]]:
    """Each published version with what it had learned: ``labels`` counts this run's
    labels only (``labels_seen`` less ``base``, what the first version had learned)."""
    if registry is None:
        return []
    points = []
    for v in registry.versions():
        m = registry.manifest(v)
        points.append(
            {
                "version": v,
                "labels": m.counters.labels_seen - base,
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
