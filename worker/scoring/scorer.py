"""The scoring worker (``probeguard score``): chat messages in, verdicts out.

One consumer-group member on the chat topic. Per batch: decode (bad payloads
become dead letters), then :meth:`ScoringEngine.judge <worker.scoring.engine.ScoringEngine.judge>`:
one LLM pass for the union of the layers every served probe reads, every probe scores,
one :class:`Verdict` per message keyed by message id (a message no probe could score is
returned as a :class:`Reject`: a dead letter); uncertain and audit-sampled messages go to
the review topic (rate-limited across all scorers); message texts and how each probe
decided go to Redis with a TTL so labels can be joined later, and every decision is added
to its version's evidence counters. Offsets are committed only after the broker has
acknowledged everything the batch produced (see :mod:`worker.kafka.batch_loop`). Probes
hot-swap from a watcher thread, each batch scored by one snapshot of them (see
:mod:`worker.scoring.probe_watch`). The HTTP server (``probeguard serve``) holds the same
engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis
from prometheus_client import Histogram

from schemas import ChatMessage
from worker.errors import KafkaSetupError
from worker.kafka.batch_loop import BatchLoop, Item, Outgoing, Reject
from worker.kafka.clients import consumer_lag, ensure_topics
from worker.kafka.early_join import EarlyJoin
from worker.kafka.judged import judged_records
from worker.kafka.runtime import RoleRuntime
from worker.llm.extract import HiddenStateExtractor
from worker.scoring.batch import BatchScorer
from worker.scoring.engine import ScoringEngine
from worker.scoring.metrics import ScorerMetrics
from worker.scoring.pacing import MicroBatchPlanner
from worker.scoring.probe_watch import ProbeWatcher
from worker.settings import Settings

__all__ = ["Scorer", "ScorerMetrics"]

log = logging.getLogger(__name__)
SETUP_RETRY_S = 5.0  # between attempts to reach the broker at start


class Scorer:
    """The scoring engine on the chat topic's consumer group."""

    def __init__(
        self,
        settings: Settings,
        extractor: HiddenStateExtractor,
        redis_client: redis.Redis,
        *,
        worker_id: str | None = None,
        metrics_port: int | None = None,
        text_redis: redis.Redis | None = None,
        early: EarlyJoin | None = None,
    ) -> None:
        """``early``: the consumer group joined while the LLM loaded (``probeguard score``);
        without it the scorer joins when it starts consuming."""
        self.settings = settings
        self.early = early
        self.worker_id = worker_id or settings.resolved_worker_id()
        self.metrics = ScorerMetrics()
        self.runtime = RoleRuntime(
            settings,
            self.metrics.collector,
            role="scorer",
            worker_id=self.worker_id,
            metrics_port=metrics_port,
        )
        self.health = self.runtime.health
        self.health.ready_check = self._ready
        self.engine = ScoringEngine(
            settings,
            extractor,
            redis_client,
            worker_id=self.worker_id,
            metrics=self.metrics,
            text_redis=text_redis,
        )
        self.setup_error = ""  # why the batch loop could not be set up yet (the broker)
        # Not the extractor's batching (Batching.for_device): its token budget cut a backlog
        # poll into length-sorted groups whose offsets interleave, and the evidence's
        # high-water mark per partition then skipped the later groups' records (exact
        # counts lost; test_heads_evidence_e2e). The extractor splits each call by length.
        self.planner = MicroBatchPlanner(
            latency_target_s=settings.latency_target_ms / 1000,
            batch_tokens=settings.batch_tokens or None,
            batch_size=settings.batch_size,
            min_fill=settings.batch_min_fill,
        )
        # Real tokens per polled record, counted when its poll was cut (see _split).
        self._tokens: dict[tuple[str, int, int], int] = {}

    @property
    def extractor(self) -> HiddenStateExtractor:
        return self.engine.extractor

    @property
    def watcher(self) -> ProbeWatcher:
        return self.engine.watcher

    @property
    def batch_scorer(self) -> BatchScorer:
        return self.engine.batch_scorer

    @property
    def loop(self) -> BatchLoop[ChatMessage] | None:
        return self.runtime.loop

    # --- lifecycle -----------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`: wait for a probe, then the batch loop; leave cleanly."""
        with self.runtime.serving(), self.engine.watching():
            # Nothing to serve yet: leave the group joined early, or its partitions stall.
            release = self.early.release if self.early is not None else None
            if not self.engine.wait_for_probes(
                self.runtime.stop_event, self.health.beat, on_wait=release
            ):
                if self.early is not None:
                    self.early.release()
                return
            loop = self._open_loop()
            if loop is None:
                return
            log.info("scoring %s as %s", self.settings.topic_chat, self.worker_id)
            try:
                loop.run()
            finally:
                loop.close()
                log.info("scorer stopped after %d messages", loop.stats.handled)

    def stop(self) -> None:
        """Finish the batch in hand, commit it, leave the group (safe from a signal handler)."""
        self.runtime.stop()

    def _open_loop(self) -> BatchLoop[ChatMessage] | None:
        """The batch loop, once the broker answers (topics made, clients created); None if
        stopped first. A broker that is down at start is waited out (and said on
        ``/readyz``), like an outage later on, rather than ending the scorer."""
        stop = self.runtime.stop_event
        early = self.early.take() if self.early is not None else None
        while not stop.is_set():
            try:
                if early is None:  # the early join made the topics
                    ensure_topics(self.settings)
                consumer, early = early, None
                return self.runtime.loop_for(
                    group_id=self.settings.group_scorer,
                    topic=self.settings.topic_chat,
                    model=ChatMessage,
                    handler=self.handle,
                    dead_letters=self.metrics.dead_letters,
                    max_batch=self.settings.batch_size,
                    between_batches=self._between_batches,
                    consumer=consumer,
                    split=self._split,
                )
            except KafkaSetupError as exc:
                if consumer is not None:
                    consumer.close()
                self.setup_error = str(exc)
                log.warning("%s; retrying in %.0f s", exc, SETUP_RETRY_S)
                self.health.beat()
                stop.wait(SETUP_RETRY_S)
        if early is not None:  # stopped before it was used
            early.close()
        return None

    @property
    def port(self) -> int | None:
        return self.runtime.port

    # --- the batch -----------------------------------------------------------

    def _split(self, items: list[Item[ChatMessage]], full: bool) -> list[list[Item[ChatMessage]]]:
        """A poll cut into micro-batches (:class:`MicroBatchPlanner`): by the latency
        target while the queue is short, by the token budget on a backlog."""
        counts = self.extractor.token_counts([i.value.text for i in items])
        self._tokens = {_where(i): n for i, n in zip(items, counts, strict=True)}
        if not full and self.loop is not None:
            # A poll may hold one partition's records while others wait: what the fetches
            # say is left behind this poll counts toward a long queue too.
            full = sum(consumer_lag(self.loop.consumer).values()) >= self.settings.batch_size
        return [[items[k] for k in group] for group in self.planner.plan(counts, full=full)]

    def handle(self, items: list[Item[ChatMessage]]) -> Sequence[Outgoing | Reject]:
        started = time.time()
        _observe_since(self.metrics.queue_seconds, items, started)
        judged = self.engine.judge(
            [i.value for i in items], sources=[(i.topic, i.partition, i.offset) for i in items]
        )
        done = time.time()
        missing = [i for i in items if _where(i) not in self._tokens]
        counts = self.extractor.token_counts([i.value.text for i in missing]) if missing else []
        tokens = sum(counts) + sum(self._tokens.pop(_where(i), 0) for i in items)
        self.planner.observe(tokens, done - started)
        _observe_since(self.metrics.verdict_seconds, items, done)
        out: list[Outgoing | Reject] = [
            Reject(items[pos], "unscorable", reason) for pos, reason in judged.errors.items()
        ]
        out += judged_records(
            judged.verdicts,
            judged.reviews,
            verdict_topic=self.settings.topic_verdicts,
            review_topic=self.settings.topic_review,
            source=items.__getitem__,
        )
        return out

    # --- helpers -------------------------------------------------------------

    def _between_batches(self) -> None:
        if not self.engine.threaded:
            self.watcher.refresh()
        self.health.beat()
        if self.loop is not None:
            self.metrics.lag.set(sum(consumer_lag(self.loop.consumer).values()))

    def _ready(self) -> tuple[bool, str]:
        ready, note = self.engine.serving_note()
        if not ready:
            return False, note
        if self.loop is None and self.setup_error:
            return False, f"waiting for the broker: {self.setup_error}"
        if self.loop is None or not self.loop.consumer.assignment():
            return False, "no partitions assigned yet"
        stall = self.runtime.stall()
        if stall is not None:
            return False, stall
        return True, note


def _where(item: Item[ChatMessage]) -> tuple[str, int, int]:
    return item.topic, item.partition, item.offset


def _observe_since(histogram: Histogram, items: list[Item[ChatMessage]], now: float) -> None:
    """Each record's time from its Kafka timestamp to ``now`` (records without one skipped)."""
    for i in items:
        if i.timestamp_ms > 0:
            histogram.observe(max(0.0, now - i.timestamp_ms / 1000))
