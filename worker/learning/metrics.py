"""The updater's Prometheus metrics (``probeguard_updater_*``), on its own registry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas import DeadLetterKind
from worker.rollout.policy import Action

__all__ = ["MAX_LABELER_SERIES", "UpdaterMetrics"]

MAX_LABELER_SERIES = 200  # per-labeler series of labels_dropped, then "other"


class UpdaterMetrics:
    """The updater's counters and gauges; ``collector`` is served on its metrics port."""

    def __init__(self) -> None:
        r = self.collector = CollectorRegistry()
        self.labels = Counter("probeguard_updater_labels", "Labels learned from", registry=r)
        self.steps = Counter("probeguard_updater_steps", "Lion steps", registry=r)
        self.labels_unsigned = Counter(
            "probeguard_updater_labels_unsigned",
            "Labels counted as the one labeler 'anonymous': PROBEGUARD_LABELER_KEYS is set and "
            "their record carries no valid signature",
            registry=r,
        )
        self.loss = Gauge("probeguard_updater_loss", "Loss of the last step", registry=r)
        self.dead_letters = Counter(
            "probeguard_updater_dead_letters", "Labels dead-lettered", ["kind"], registry=r
        )
        for kind in get_args(DeadLetterKind):  # at 0, as stage_changes below
            self.dead_letters.labels(kind)
        self.prequential = Gauge(
            "probeguard_updater_prequential",
            "Windowed test-then-train metric",
            ["metric"],
            registry=r,
        )
        self.entropy = Gauge(
            "probeguard_updater_layer_entropy", "Entropy of the layer weights (nats)", registry=r
        )
        self.collapse = Gauge(
            "probeguard_updater_layer_collapse_alarm",
            "1 when the layer-weight entropy is below PROBEGUARD_ENTROPY_ALARM",
            registry=r,
        )
        self.publish_seconds = Histogram(
            "probeguard_updater_publish_seconds", "Time to publish a version", registry=r
        )
        self.version = Gauge("probeguard_updater_version", "Last published version", registry=r)
        self.lease = Gauge(
            "probeguard_updater_lease_held", "1 while this process holds the lease", registry=r
        )
        self.stage_changes = Counter(
            "probeguard_updater_stage_changes",
            "Automatic stage changes by the rollout policy",
            ["action"],
            registry=r,
        )
        # At 0 from the start: deploy/alerts.yml alerts on increase(...{action="rollback"}),
        # which misses the first rollback of a series that has no earlier sample.
        for action in get_args(Action):
            if action != "none":
                self.stage_changes.labels(action)
        self.skipped = Counter(
            "probeguard_updater_labels_skipped",
            "Labels left to other probes (addressed to another, or labels this probe lacks)",
            ["reason"],
            registry=r,
        )
        self.resume_skipped = Counter(
            "probeguard_updater_resume_skipped",
            "Published versions skipped at resume because they do not verify",
            registry=r,
        )
        self.labels_dropped = Counter(
            "probeguard_updater_labels_dropped",
            "Labels not learned, per labeler: `duplicate` (that labeler labeled that message "
            "before) or `quarantined` (past the labeler's limit; dead-lettered)",
            ["labeler", "reason"],
            registry=r,
        )
        self._labelers: set[str] = set()
        self.labels_credited = Counter(
            "probeguard_updater_labels_credited",
            "Labels credited to the version(s) that judged the message (evidence)",
            registry=r,
        )

    def dropped(self, labeler: str, reason: str, amount: int = 1) -> None:
        """Count labels of ``labeler`` not learned. Labeler ids come from the topic: past
        :data:`MAX_LABELER_SERIES` of them, the rest share the series ``labeler="other"``."""
        if labeler not in self._labelers:
            if len(self._labelers) >= MAX_LABELER_SERIES:
                labeler = "other"
            else:
                self._labelers.add(labeler)
        self.labels_dropped.labels(labeler, reason).inc(amount)

    def published(
        self, version: int, seconds: float, metrics: Mapping[str, float], entropy_alarm: float
    ) -> None:
        """Export a published version: its number, the time it took, its windowed
        prequential metrics and the layer-weight entropy (with the collapse alarm)."""
        self.version.set(version)
        self.publish_seconds.observe(seconds)
        for k, v in metrics.items():
            if k.startswith("prequential_") and "/" not in k:
                self.prequential.labels(k.removeprefix("prequential_")).set(v)
        entropy = metrics["layer_entropy"]
        self.entropy.set(entropy)
        self.collapse.set(1 if entropy < entropy_alarm else 0)
