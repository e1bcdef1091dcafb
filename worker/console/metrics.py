"""The console's Prometheus metrics (``probeguard_console_*``), read at scrape time.

The review backlog lives only here: what the console has fetched and nobody answered,
plus what is still on the review topic for its consumer group. Summed over the consoles
of one group it is the whole backlog (each counts the partitions it holds).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from worker.review.queue import ReviewQueue

__all__ = ["console_metrics"]


def console_metrics(queue: ReviewQueue | None) -> CollectorRegistry:
    """A registry for ``/metrics``; empty when the console runs without a review queue."""
    registry = CollectorRegistry()
    if queue is not None:
        depth = Gauge(
            "probeguard_console_review_depth",
            "Review requests waiting for a human: fetched and unanswered, plus not yet fetched",
            registry=registry,
        )
        depth.set_function(lambda: queue.stats().depth)
    return registry
