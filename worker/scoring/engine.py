"""What every scoring front end shares: probes in step with the registry, one LLM pass per
batch, verdicts, review routing, and what a label needs later.

The Kafka scorer (:mod:`worker.scoring.scorer`) and the HTTP server
(:mod:`worker.serve`, and the inline guard, through :mod:`worker.scoring.front`) each hold
one :class:`ScoringEngine`: a batch of
:class:`~schemas.ChatMessage` goes in, :meth:`ScoringEngine.judge` scores it with every
served probe (:class:`~worker.scoring.batch.BatchScorer`), builds one :class:`Verdict` per
message, routes uncertain and audit-sampled messages to review (rate-limited across every
scorer and server by a budget counted in Redis), and writes each message's text and how
each probe decided to Redis with a TTL, so a label given later is joined and credits the
version that judged it, and every decision to its version's evidence counters (see
:mod:`worker.store.evidence`). Only moving records (Kafka offsets, HTTP responses) is
left to the front end.

How much of a message stays behind is its :class:`Retain`: ``ALL`` (the scorer's
messages), ``COUNT`` (Perspective's ``doNotStore``: no text, no decided record, no review
request; its decision still counts in the aggregate evidence counters, which hold no text)
or ``NOTHING`` (inputs derived from another, such as a Perspective span). The Redis writes
are its :class:`~worker.scoring.ledger.Ledger`'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import redis

from probes.checkpoint import load_checkpoint
from schemas import ChatMessage, ReviewRequest, Verdict, utcnow
from worker.defaults import missing, serving_default
from worker.errors import ConfigError
from worker.llm.extract import Extraction, HiddenStateExtractor
from worker.scoring import review_routing
from worker.scoring.batch import BatchScorer, BatchScores, ExitPolicy
from worker.scoring.drift import DriftMonitor
from worker.scoring.ledger import Ledger, Retain
from worker.scoring.metrics import ScorerMetrics
from worker.scoring.probe_watch import ProbeWatcher
from worker.scoring.served import ServedProbe
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import keys_for, make_text_redis

__all__ = ["Judged", "Retain", "ScoringEngine"]

log = logging.getLogger(__name__)
# With the watcher thread, serve the packaged default only once the registry has been read
# (or after this long without Redis): a published live version wins from the first message.
DEFAULT_AFTER_S = 5.0


@dataclass
class Judged:
    """One batch's outcome, by input position."""

    verdicts: dict[int, Verdict]
    errors: dict[int, str]  # why a message could not be scored (a dead letter, a 500)
    reviews: list[tuple[int, ReviewRequest]] = field(default_factory=list)  # within budget
    scores: BatchScores | None = None
    elapsed_s: float = 0.0


class ScoringEngine:
    """Extractor, probes, registry watcher and Redis, wired for scoring batches."""

    def __init__(
        self,
        settings: Settings,
        extractor: HiddenStateExtractor,
        redis_client: redis.Redis,
        *,
        worker_id: str,
        metrics: ScorerMetrics,
        text_redis: redis.Redis | None = None,
        watch: Literal["thread", "poll"] | None = None,
    ) -> None:
        """``watch``: how the probe watcher follows the registry (None: ``probe_watch``;
        a front door without a batch loop to poll it watches on a thread)."""
        self.settings = settings
        self.threaded = (watch or settings.probe_watch) == "thread"
        self.extractor = extractor
        self.keys = keys_for(settings)
        self.worker_id = worker_id
        self.metrics = metrics
        metrics.serving(settings.probe_names)
        self.review_policy = review_routing.ReviewPolicy.from_settings(settings)
        self.drift = DriftMonitor(
            metrics, window=settings.drift_window, min_messages=settings.drift_min_messages
        )
        self.ledger = Ledger(
            settings,
            redis_client,
            # The per-message cache: its own Redis when configured (see make_text_redis).
            text_redis or make_text_redis(settings, redis_client),
            keys=self.keys,
            worker_id=worker_id,
            metrics=metrics,
            drift=self.drift,
            review_policy=self.review_policy,
        )
        self.redis_breaker = self.ledger.redis_breaker  # the watcher's too
        registries = {
            n: CheckpointRegistry(redis_client, self.keys, n, signing_key=settings.signing_key)
            for n in settings.probe_names
        }
        self.watcher = ProbeWatcher(
            registries,
            extractor.fingerprint,
            device=extractor.device,
            signing_key=settings.signing_key,
            check_interval_s=settings.stage_check_interval_s,
            # Block on the event streams for at most half the socket timeout: a blocked
            # read must never look like a dead connection.
            block_ms=min(1000, int(settings.redis_socket_timeout_s * 500)),
            on_swap=lambda name, stage, v: self.metrics.version.labels(name, stage).set(v),
            on_refused=self.ledger.refused,
            on_loaded=self.ledger.loaded,
            on_untrusted=lambda name, why: self.metrics.untrusted.labels(name).inc(),
            breaker=self.redis_breaker,
        )
        self.batch_scorer = BatchScorer(
            extractor,
            lambda: self.watcher.slots,
            shadow=settings.shadow,
            flag_heads=settings.flag_head_names,
            limits=settings.limits,
            route_salt=settings.routing_salt,
            exit_policy=ExitPolicy.from_settings(settings),
        )
        # probe -> the packaged default folder served while nothing is published (None: none
        # for this LLM), decided once at start.
        self.defaults: dict[str, str | None] = {}

    # --- the batch -----------------------------------------------------------

    def judge(
        self,
        messages: Sequence[ChatMessage],
        *,
        retain: Sequence[Retain] | None = None,
        review: bool = True,
        sources: Sequence[tuple[str, int, int]] | None = None,
        states: Extraction | None = None,
    ) -> Judged:
        """Score ``messages``; verdicts, review requests within budget (``review``: none
        are asked for, and the shared budget is left alone, when nobody will send them),
        texts and decisions written for label joins and evidence, as each message's
        ``retain`` allows (``Retain.ALL`` for every message by default). ``sources``: each
        message's Kafka record (topic, partition, offset), so a redelivered one is counted
        and charged once (:meth:`EvidenceStore.record_scored`). ``states``: the messages'
        hidden states, already computed (the inline guard's); the extractor runs only
        when they lack a layer the served probes read (:meth:`BatchScorer.score`)."""
        start = time.perf_counter()
        scores = self.batch_scorer.score(messages, states)
        elapsed = time.perf_counter() - start
        latency_ms = elapsed * 1000.0
        keep = [Retain.ALL] * len(messages) if retain is None else list(retain)
        now = utcnow()
        verdicts: dict[int, Verdict] = {}
        for pos, results in scores.results.items():
            msg = messages[pos]
            verdicts[pos] = Verdict.build(
                self.settings.limits,
                verdict_id=Verdict.make_id(msg.message_id, results),
                message_id=msg.message_id,
                conversation_id=msg.conversation_id,
                decision="flag" if any(r.flagged for r in results) else "allow",
                results=results,
                latency_ms=latency_ms,
                worker_id=self.worker_id,
                scored_at=now,
                reply_to=msg.reply_to,
            )
            for r in results:
                if r.flagged:
                    self.metrics.flags.labels(r.probe).inc()
        candidates = self._candidates(messages, scores, keep) if review else []
        self.drift.observe(scores.drift)
        admitted = self.ledger.record(scores, latency_ms, keep, sources, candidates)
        self.metrics.reviews_dropped.inc(len(candidates) - len(admitted))
        for _, req in admitted:
            self.metrics.reviews.labels(req.reason).inc()
        judged = Judged(
            verdicts=verdicts,
            errors=dict(scores.errors),
            reviews=admitted,
            scores=scores,
            elapsed_s=elapsed,
        )
        self.ledger.remember(messages, scores, keep)
        n = len(scores.results)
        self.metrics.messages.inc(n)
        self.metrics.batch_size.observe(len(messages))
        self.metrics.batch_seconds.observe(elapsed)
        self.metrics.probe_seconds.observe(scores.probe_s)
        self.metrics.llm_cpu_seconds.inc(scores.extract_cpu_s)
        if n:
            self.metrics.message_seconds.observe(elapsed / n)
        return judged

    def _candidates(
        self, messages: Sequence[ChatMessage], scores: BatchScores, keep: list[Retain]
    ) -> list[tuple[int, ReviewRequest]]:
        """The review requests the batch asks for, before the budget."""
        candidates: list[tuple[int, ReviewRequest]] = []
        for pos, results in scores.results.items():
            msg = messages[pos]
            if keep[pos] < Retain.ALL:
                continue  # nothing of a do-not-store message is queued
            for r in results:
                flag_score = scores.flag_scores.get((pos, r.probe))
                reason = review_routing.route(self.review_policy, msg.message_id, flag_score)
                if reason is None:
                    continue
                request = ReviewRequest.build(
                    self.settings.limits,
                    message_id=msg.message_id,
                    conversation_id=msg.conversation_id,
                    text=msg.text,
                    probe=r.probe,
                    version=r.version,
                    scores=r.scores,
                    reason=reason,
                    created_at=utcnow(),
                    reply_to=msg.reply_to,
                )
                candidates.append((pos, request))
        return candidates

    # --- probes --------------------------------------------------------------

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """The probe watcher thread (``probe_watch=thread``) for the duration of the block."""
        if self.threaded:
            self.watcher.start()
        try:
            yield
        finally:
            if self.threaded:
                self.watcher.stop()

    def wait_for_probes(
        self,
        stop: threading.Event,
        beat: Callable[[], None],
        on_wait: Callable[[], None] | None = None,
    ) -> bool:
        """Block until every probe has a live version (published, the bootstrap checkpoint
        or the packaged default); False if ``stop`` was set first. ``beat`` is called while
        waiting (waiting is healthy: liveness probes must not restart us); ``on_wait`` once,
        when it has to wait (the scorer leaves the group it joined early)."""
        bootstrap = self.settings.bootstrap_checkpoint
        # The watcher thread's first sync takes a moment: say "waiting" only after it.
        started = time.monotonic()
        last_note = started - 9.0 if self.threaded else 0.0
        while not stop.is_set():
            if not self.threaded:
                self.watcher.refresh(force=True)
            if bootstrap is not None:
                self._serve_bootstrap(bootstrap)
            elif self.settings.default_probe and (
                self.watcher.synced() or time.monotonic() - started > DEFAULT_AFTER_S
            ):
                self._serve_packaged_defaults()
            if self.batch_scorer.ready():
                log.info("serving %s", self.watcher.versions())
                return True
            if time.monotonic() - last_note > 10:
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                missing = [n for n, sl in self.watcher.slots.items() if sl.live is None]
                log.warning(
                    "no live version of %s in the registry yet; waiting (publish one with "
                    "`probeguard train`, or set PROBEGUARD_BOOTSTRAP_CHECKPOINT)",
                    missing,
                )
                last_note = time.monotonic()
            beat()
            stop.wait(0.1 if self.threaded else 1.0)
        return False

    def _serve_bootstrap(self, path: Path) -> None:
        probe, manifest = load_checkpoint(
            path, self.extractor.fingerprint, signing_key=self.settings.signing_key
        )
        if manifest.probe not in self.watcher.slots:
            raise ConfigError(
                f"bootstrap checkpoint {str(path)!r} is for probe {manifest.probe!r}, "
                f"not one of {self.settings.probe_names}"
            )
        self.watcher.serve_bootstrap(manifest.probe, ServedProbe(probe, manifest))

    def _serve_packaged_defaults(self) -> None:
        """Serve the packaged default (version 0) for every probe with nothing published,
        once: moderation from the first message, until the registry has a live version."""
        for name, slot in self.watcher.slots.items():
            if slot.live is not None or name in self.defaults:
                continue
            found = serving_default(
                self.extractor.fingerprint, name, self.settings.default_flag_budget
            )
            self.defaults[name] = found.folder if found is not None else None
            if found is None:
                log.info(
                    "probe %s waits for a version: %s", name, missing(self.extractor.fingerprint)
                )
                continue
            self.watcher.serve_bootstrap(name, ServedProbe(found.probe, found.manifest))
            heads = ", ".join(h.name for h in found.probe.spec.heads)
            log.info(
                "serving the packaged default %s as %s v0 (heads: %s) until a version is published",
                found.folder,
                name,
                heads,
            )

    def serving_note(self) -> tuple[bool, str]:
        """Whether every probe has a live version, and what is served (for ``/readyz``)."""
        if not self.batch_scorer.ready():
            return False, "no live probe loaded yet"
        versions = self.watcher.versions()
        packaged = [
            f"{name}: the packaged default {folder}"
            for name, folder in self.defaults.items()
            if folder is not None and versions.get(name, {}).get("live") == 0
        ]
        note = f" ({'; '.join(packaged)} until a version is published)" if packaged else ""
        return True, f"serving {versions}{note}{self.ledger.degraded()}"
