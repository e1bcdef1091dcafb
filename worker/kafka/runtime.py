"""What every long-running role shares: health, the metrics server, stop, its batch loop.

The scorer and the updater compose one :class:`RoleRuntime` rather than each building
the same scaffolding: a :class:`~worker.health.Health` whose liveness goes stale after a
Kafka poll interval, a ``/metrics`` + ``/healthz`` + ``/readyz`` server on
``metrics_port`` (0 disables it), a stop event that is safe to set from a signal
handler, and the factory of the role's :class:`~worker.kafka.batch_loop.BatchLoop`, whose
retries, refused records and commit failures it exports as
``probeguard_<role>_loop_retries_total{reason}``,
``probeguard_<role>_records_refused_total`` and
``probeguard_<role>_commit_failures_total``, and whose stall (a batch that cannot be
completed) it reports by :meth:`RoleRuntime.stall` (roles put it on ``/readyz``). A
sticky device fault on ``device_faults_to_restart`` attempts in a row of the batch in hand
fails ``/healthz`` (:meth:`RoleRuntime.fatal`): the fault lasts until the process restarts,
so only the orchestrator's restart (which also moves the partitions) ends the stall.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from schemas.base import WireModel
from worker.health import Health, HealthServer
from worker.kafka.batch_loop import BatchLoop, Item, Outgoing, Reject

__all__ = ["RoleRuntime"]

T = TypeVar("T", bound=WireModel)


class RoleRuntime:
    def __init__(
        self,
        settings: Any,
        collector: CollectorRegistry,
        *,
        role: str,
        worker_id: str,
        metrics_port: int | None = None,
    ) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.retries = Counter(
            f"probeguard_{role}_loop_retries",
            "Batch attempts that failed and were retried (produce, handler, dependency)",
            ["reason"],
            registry=collector,
        )
        self.refused = Counter(
            f"probeguard_{role}_records_refused",
            "Records the broker refused (too large, invalid); their inputs were dead-lettered",
            registry=collector,
        )
        self.commit_failures = Counter(
            f"probeguard_{role}_commit_failures",
            "Offset commits that failed (the records will be redelivered)",
            registry=collector,
        )
        self.stalled = Gauge(
            f"probeguard_{role}_stalled_seconds",
            "How long the batch in hand has failed to complete (0 while progressing)",
            registry=collector,
        )
        self.stalled.set_function(lambda: self.loop.stalled_s() if self.loop is not None else 0.0)
        # A loop that has not come back from a poll for longer than Kafka allows is dead.
        self.health = Health(stale_after_s=max(60.0, settings.kafka_max_poll_interval_ms / 1000))
        self.health.fatal = self.fatal
        port = settings.metrics_port if metrics_port is None else metrics_port
        self.server = HealthServer(collector, self.health, port) if port else None
        self.stop_event = threading.Event()
        self.loop: BatchLoop[Any] | None = None

    @property
    def port(self) -> int | None:
        """The metrics server's port (None when disabled)."""
        return self.server.port if self.server is not None else None

    @contextmanager
    def serving(self) -> Iterator[None]:
        """The metrics server runs for the duration of the block."""
        if self.server is not None:
            self.server.start()
        try:
            yield
        finally:
            if self.server is not None:
                self.server.stop()

    def loop_for(
        self,
        *,
        group_id: str,
        topic: str,
        model: type[T],
        handler: Callable[[list[Item[T]]], Sequence[Outgoing | Reject]],
        dead_letters: Counter,
        **options: Any,
    ) -> BatchLoop[T]:
        """The role's batch loop on ``topic``; dead letters count into ``dead_letters``
        (labelled by kind). A stop requested before the loop existed stops it at once."""
        loop = BatchLoop.for_topic(
            self.settings,
            group_id=group_id,
            topic=topic,
            model=model,
            handler=handler,
            worker_id=self.worker_id,
            on_dead_letter=lambda kind: dead_letters.labels(kind).inc(),
            on_event=self._count,
            **options,
        )
        self.loop = loop
        if self.stop_event.is_set():
            loop.stop()
        return loop

    def _count(self, event: str) -> None:
        if event.startswith("retry_"):
            self.retries.labels(event.removeprefix("retry_")).inc()
        elif event == "refused":
            self.refused.inc()
        elif event == "commit_failure":
            self.commit_failures.inc()

    def fatal(self) -> str | None:
        """Why the process must be restarted (``/healthz`` fails): a sticky device fault on
        ``device_faults_to_restart`` attempts in a row of the batch in hand; else None."""
        loop = self.loop
        if loop is None or loop.sticky_faults < self.settings.device_faults_to_restart:
            return None
        return (
            f"device fault on {loop.sticky_faults} attempts in a row of the batch in hand "
            f"({loop.last_failure}); it lasts until the process restarts"
        )

    def stall(self) -> str | None:
        """Why the role cannot make progress, when its batch in hand has failed to complete
        for longer than ``stall_not_ready_s`` or a fatal fault asks for a restart; None
        while it progresses."""
        fatal = self.fatal()
        if fatal is not None:
            return fatal
        loop = self.loop
        if loop is None:
            return None
        stalled = loop.stalled_s()
        if stalled <= self.settings.stall_not_ready_s:
            return None
        return f"stalled for {stalled:.0f}s on a batch it cannot complete: {loop.last_failure}"

    def stop(self) -> None:
        """Finish the batch in hand, commit it, leave the group (safe from a signal handler)."""
        self.stop_event.set()
        if self.loop is not None:
            self.loop.stop()
