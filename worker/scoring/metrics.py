"""The scorer's Prometheus metrics (``probeguard_scorer_*``), on its own registry."""

from __future__ import annotations

from collections.abc import Iterable
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from schemas import DeadLetterKind

__all__ = ["ScorerMetrics"]


class ScorerMetrics:
    """The scorer's counters, gauges and histograms; ``collector`` is served on its
    metrics port."""

    def __init__(self) -> None:
        r = self.collector = CollectorRegistry()
        # Registered in this order (the order of the exposition): traffic, time, decisions,
        # dependencies, drift.
        self._traffic(r)
        self._time(r)
        self._decisions(r)
        self._dependencies(r)
        self._drift(r)

    def _traffic(self, r: CollectorRegistry) -> None:
        """Messages in, dead letters, micro-batch sizes."""
        self.messages = Counter("probeguard_scorer_messages", "Messages scored", registry=r)
        self.dead_letters = Counter(
            "probeguard_scorer_dead_letters", "Payloads dead-lettered", ["kind"], registry=r
        )
        for kind in get_args(DeadLetterKind):  # at 0: a burst's rate() is not lost (see serving)
            self.dead_letters.labels(kind)
        self.batch_size = Histogram(
            "probeguard_scorer_batch_size",
            "Messages per micro-batch (one LLM pass group; verdicts leave per micro-batch)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )

    def _time(self, r: CollectorRegistry) -> None:
        """Where a message's time goes: queued, to its verdict, the batch, the LLM, probes."""
        # Produce-to-verdict time, from each record's Kafka timestamp (the producer's clock):
        # how long it queued before its micro-batch was scored, and until its verdict was
        # handed to the producer (issue 26: verdicts leave per micro-batch).
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.queue_seconds = Histogram(
            "probeguard_scorer_queue_seconds",
            "From a message's Kafka timestamp to the start of its micro-batch",
            buckets=latency_buckets,
            registry=r,
        )
        self.verdict_seconds = Histogram(
            "probeguard_scorer_verdict_seconds",
            "From a message's Kafka timestamp to its verdict being sent",
            buckets=latency_buckets,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "probeguard_scorer_batch_seconds", "Wall time per batch", registry=r
        )
        self.message_seconds = Histogram(
            "probeguard_scorer_message_seconds",
            "Batch wall time per message",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.llm_cpu_seconds = Counter(
            "probeguard_scorer_llm_cpu_seconds",
            "CPU seconds of the process (all threads) while the LLM ran (tokenizing and its "
            "passes): the rest of the process's CPU is the cost around the model",
            registry=r,
        )
        self.probe_seconds = Histogram(
            "probeguard_scorer_probe_seconds",
            "Probe (not LLM) time per batch",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1),
            registry=r,
        )

    def _decisions(self, r: CollectorRegistry) -> None:
        """Review requests, flags, the versions served and the checkpoints refused."""
        self.reviews = Counter(
            "probeguard_scorer_reviews", "Review requests routed", ["reason"], registry=r
        )
        self.reviews_dropped = Counter(
            "probeguard_scorer_reviews_dropped",
            "Review candidates over the rate limit",
            registry=r,
        )
        self.flags = Counter("probeguard_scorer_flags", "Messages flagged", ["probe"], registry=r)
        self.version = Gauge(
            "probeguard_scorer_probe_version",
            "Probe version served",
            ["probe", "stage"],
            registry=r,
        )
        self.refused = Counter(
            "probeguard_scorer_checkpoints_refused", "Checkpoints refused", ["probe"], registry=r
        )
        self.untrusted = Counter(
            "probeguard_scorer_stage_pointers_refused",
            "Stage pointer records ignored: signature does not verify, or replayed",
            ["probe"],
            registry=r,
        )

    def _dependencies(self, r: CollectorRegistry) -> None:
        """The broker (consumer lag) and Redis (failed and skipped writes)."""
        self.lag = Gauge(
            "probeguard_scorer_consumer_lag", "Records behind the high watermark", registry=r
        )
        self.redis_errors = Counter(
            "probeguard_scorer_redis_errors",
            "Failed Redis writes (text cache, evidence, review budget)",
            registry=r,
        )
        self.redis_skipped = Counter(
            "probeguard_scorer_redis_skipped_batches",
            "Batches whose text cache/evidence writes were skipped while Redis was failing",
            registry=r,
        )

    def _drift(self, r: CollectorRegistry) -> None:
        """Drift (worker.scoring.drift): per served version with training statistics, once
        its window holds DRIFT_MIN_MESSAGES; the series go when the version stops serving."""
        self.drift_shift = Gauge(
            "probeguard_scorer_drift_mean_shift",
            "Standardized mean shift of the pooled hidden state's RMS, last DRIFT_WINDOW "
            "messages against the version's training statistics",
            ["probe", "version", "layer"],
            registry=r,
        )
        self.drift_psi = Gauge(
            "probeguard_scorer_drift_score_psi",
            "Population stability index of the score over the last DRIFT_WINDOW messages "
            "against the version's training scores",
            ["probe", "version"],
            registry=r,
        )
        self.drift_messages = Gauge(
            "probeguard_scorer_drift_window_messages",
            "Messages in the drift window",
            ["probe", "version"],
            registry=r,
        )

    def serving(self, probes: Iterable[str]) -> None:
        """Export the per-probe counters at 0 from the start: an alert on ``increase()``
        (deploy/alerts.yml) misses a series' first increment when it has no earlier sample,
        so a scorer's first refused checkpoint would otherwise never alert."""
        for name in probes:
            for counter in (self.refused, self.untrusted, self.flags):
                counter.labels(name)
