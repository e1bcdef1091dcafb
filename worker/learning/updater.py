"""The updater (``probeguard train``): human labels in, versioned checkpoints out.

    standby  -- wait for the probe's lease (hot standby; takes over when it expires)
    resume   -- newest published version (weights + Lion state), else the seed
                checkpoint file, else the packaged default of the LLM (worker/defaults),
                else a fresh probe from a spec ("from zero"): worker.learning.resume
    per batch of HumanLabels:
        admit: each labeler's label for a message once, within the labeler's limit
               (worker.learning.admission; the rest dropped or quarantined, counted per labeler)
        join the text (the scorers' Redis text cache, else label.text)
        extract hidden states of the probe's layers (early exit)
        test:  score with the current probe -> windowed prequential metrics
        train: Lion steps on new examples + a class-balanced replay sample
    publish  -- every N labels or T seconds: a new version (fenced by the lease
                token) with counters and prequential metrics; only then are the
                label offsets committed, so a crash loses no label; with
                PROBEGUARD_LEARN_DROP_LAYER_WEIGHT the deepest layers whose mix weight
                stayed negligible are dropped first (a shallower version, cheaper forward)
    rollout  -- every label is credited to the version(s) that judged its message
                (evidence), and between batches the rollout policy promotes, trials
                or rolls back versions (see worker.rollout.changes); the lease holder is the
                only automatic writer of stages

Labels that cannot be joined, name unknown labels, or whose text the model
cannot read go to the dead-letter topic. A fresh probe first collects
``stats_warmup`` examples to fix its input normalization, then learns.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import redis
from kafka.errors import KafkaError

from schemas import HumanLabel, ProbeSpec
from worker.errors import Fenced, KafkaSetupError, RegistryError
from worker.kafka.batch_loop import BatchLoop, Between, Item, Outgoing, Reject
from worker.kafka.clients import ensure_topics
from worker.kafka.runtime import RoleRuntime
from worker.learning.config import LearningConfig
from worker.learning.intake import LabelIntake
from worker.learning.labels import label_truths
from worker.learning.metrics import UpdaterMetrics
from worker.learning.online_learner import OnlineLearner
from worker.learning.publishing import prepare_publish, publish_version
from worker.learning.resume import (
    default_spec,
    published_by_another,
    restore_optimizer,
    starting_point,
)
from worker.llm.extract import HiddenStateExtractor
from worker.rollout.changes import Rollout
from worker.rollout.policy import Policy
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore
from worker.store.lease import Lease, LeaseKeeper
from worker.store.redis import Breaker, keys_for, make_text_redis

__all__ = ["Updater", "default_spec"]  # default_spec: from worker.learning.resume

log = logging.getLogger(__name__)


class Updater:
    """One probe's online learner; one active per probe (lease), others on standby."""

    def __init__(
        self,
        settings: Settings,
        extractor: HiddenStateExtractor,
        redis_client: redis.Redis,
        *,
        worker_id: str | None = None,
        metrics_port: int | None = None,
        text_redis: redis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.extractor = extractor
        self.redis: Any = redis_client
        self.text_redis: Any = text_redis or make_text_redis(settings, redis_client)
        self.keys = keys_for(settings)
        self.name = settings.probe_to_train
        self.worker_id = worker_id or settings.resolved_worker_id()
        self.registry = CheckpointRegistry(
            redis_client, self.keys, self.name, signing_key=settings.signing_key
        )
        self.lease = Lease(
            redis_client, self.registry.lease_key, self.worker_id, settings.lease_ttl_ms
        )
        self.evidence = EvidenceStore.from_settings(redis_client, settings, cache=self.text_redis)
        self.metrics = UpdaterMetrics()
        self.intake = LabelIntake(settings, self.text_redis, self.keys, self.metrics, self.name)
        self.rollout = Rollout(self.registry, self.evidence, actor=self.worker_id)
        self.policy = Policy.from_settings(settings)
        self._next_rollout = 0.0
        self.runtime = RoleRuntime(
            settings,
            self.metrics.collector,
            role="updater",
            worker_id=self.worker_id,
            metrics_port=metrics_port,
        )
        self.health = self.runtime.health
        self.health.ready_check = self._ready
        # Redis failures in a row, for /readyz only: nothing is skipped while it fails (the
        # lease and publishing keep retrying, which is how the updater comes back by itself).
        self.redis_state = Breaker()
        self.active = False
        self.keeper = LeaseKeeper(self.lease)  # replaced by a running one per tenure
        # Set by _resume() when the lease is ours: the learning core, and what it
        # continues from (the version it resumed from, then the last one it published).
        self.learner: OnlineLearner | None = None
        self.parent: int | None = None
        self.unpublished = 0
        self.last_publish = time.monotonic()
        self.published: list[int] = []
        # A version someone else published while this updater held the lease (an
        # operator's `probe add-head`): the tenure ends without publishing and resumes from it.
        self.superseded_by: int | None = None

    @property
    def loop(self) -> BatchLoop[HumanLabel] | None:
        return self.runtime.loop

    @property
    def labels_seen(self) -> int:
        """Labels learned from (warm-up included) by the probe this updater holds."""
        return self.learner.counters.labels_seen if self.learner is not None else 0

    # --- lifecycle -----------------------------------------------------------

    def run(self) -> None:
        """Standby until the lease is ours, learn until it is lost or :meth:`stop`; repeat."""
        with self.runtime.serving():
            try:
                self._standby_or_serve()
            finally:
                self._give_up_lease()

    def _standby_or_serve(self) -> None:
        announced = False
        stop = self.runtime.stop_event
        while not stop.is_set():
            self.health.beat()
            if self._try_lease():
                try:
                    self._serve()
                except (redis.RedisError, OSError, KafkaError, KafkaSetupError) as exc:
                    # e.g. Redis or the broker failing during the resume: give the lease up
                    # and retry, rather than exit (and let the standby fail the same way).
                    log.error("serving %s failed (%s); back to standby", self.name, exc)
                    self._give_up_lease()
                announced = False
            elif not announced:
                announced = self._announce_standby()
            stop.wait(self.settings.lease_ttl_ms / 3000)

    def _announce_standby(self) -> bool:
        """Log who holds the lease; False when Redis cannot say (asked again next time).

        Every Redis call of the standby loop is guarded: an outage of any length leaves
        the updater waiting here, and it takes the lease once Redis answers."""
        try:
            holder = self.lease.current()
        except (redis.RedisError, OSError) as exc:
            self.redis_state.trip(exc)
            return False
        log.info(
            "standby: the %s lease is held by %s",
            self.name,
            holder[1] if holder else "nobody (retrying)",
        )
        return True

    def _give_up_lease(self) -> None:
        with contextlib.suppress(redis.RedisError, OSError):  # it expires anyway
            self.lease.release()

    def stop(self) -> None:
        """Finish the batch in hand, publish what it learned, commit, leave the group."""
        self.runtime.stop()

    def _ready(self) -> tuple[bool, str]:
        stall = self.runtime.stall()
        if stall is not None:
            return False, stall
        outage = self.redis_state.outage()
        if outage is not None:
            # Nothing can be published (nor the lease held) without Redis: not ready, and
            # it says so; the updater takes up again by itself once Redis answers.
            then = "publishes again" if self.active else "takes the lease again"
            return False, f"Redis {outage}: the updater {then} once it answers"
        return True, "active" if self.active else "standby"

    def _try_lease(self) -> bool:
        try:
            token = self.lease.acquire()
        except (redis.RedisError, OSError) as exc:
            if self.redis_state.failing_since is None:
                log.warning("cannot reach Redis for the lease (%s); retrying", exc)
            self.redis_state.trip(exc)
            return False
        self.redis_state.reset()
        return token is not None

    def _serve(self) -> None:
        log.info("lease for %s acquired (token %s); resuming", self.name, self.lease.token)
        # Renewed on its own thread, however long a batch takes; once lost, nothing more
        # is published or committed, and the next tenure resumes from the registry.
        self.keeper = LeaseKeeper(
            self.lease, on_lost=self._lease_lost, breaker=self.redis_state
        ).start()
        try:
            self._serve_tenure()
        finally:
            self.keeper.stop()

    def _lease_lost(self) -> None:
        """The keeper's signal (on its thread, or on a fenced publish): the one place the
        updater stops its loop, so a batch in hand is not retried for a lease gone.
        ``_between_batches`` answers ``STOP`` too, for a loop started after the loss."""
        log.warning("lost the %s lease; finishing the batch in hand, then standby", self.name)
        if self.loop is not None:
            self.loop.stop()

    def _serve_tenure(self) -> None:
        self.active = True
        self.metrics.lease.set(1)
        self._resume()
        ensure_topics(self.settings, [self.settings.topic_labels, self.settings.topic_dead_letter])
        loop = self.runtime.loop_for(
            group_id=self.settings.updater_group(self.name),
            topic=self.settings.topic_labels,
            model=HumanLabel,
            handler=self.handle,
            dead_letters=self.metrics.dead_letters,
            max_batch=self.settings.learn_batch_size,
            between_batches=self._between_batches,
            defer_commits=True,
        )
        try:
            loop.run()
            # Nothing while warming up (see publish). The loop has stopped: its owner
            # commits what the version reflects, as between batches the loop does.
            superseded = self.superseded_by is not None
            if (
                self.unpublished
                and self.keeper.holds()
                and not superseded
                and self.publish(reason="shutdown")
            ):
                loop.commit_pending()
        finally:
            loop.close()
            self.runtime.loop = None
            self.active = False
            self.metrics.lease.set(0)

    # --- resume --------------------------------------------------------------

    def _resume(self) -> None:
        start = starting_point(
            self.settings, self.registry, self.extractor, on_skipped=self.metrics.resume_skipped.inc
        )
        self.parent = start.version
        self.learner = OnlineLearner(
            start.probe,
            LearningConfig.from_settings(self.settings, model_type=self.extractor.model_type),
            counters=start.counters,
            fresh=start.fresh,
        )
        self.unpublished = 0
        self.last_publish = time.monotonic()
        self.superseded_by = None
        if start.version is not None:
            restore_optimizer(self.registry, self.learner, start.version)
        log.info(
            "resumed %s from %s (%d labels seen so far)",
            self.name,
            start.source,
            start.counters.labels_seen,
        )
        if self.learner.anchor is not None:
            log.info(
                "heads %s hold their scores until a label reaches them "
                "(PROBEGUARD_LEARN_ANCHOR_UNLABELED)",
                ", ".join(self.learner.anchor.columns),
            )

    # --- the batch -----------------------------------------------------------

    def handle(self, items: list[Item[HumanLabel]]) -> Sequence[Outgoing | Reject]:
        learner = self._learner()
        spec = learner.probe.spec
        intake = self.intake.take(items, spec)
        rejects, sources, ready = intake.rejects, intake.sources, intake.ready
        self._credit(spec, [i.value for i in sources])
        if not ready:
            return rejects
        ex = self.extractor.extract([x.text for x in ready], learner.probe.layers)
        learned = learner.learn_extraction(ex, ready)
        rejects += [
            Reject(sources[pos], "unscorable", why) for pos, why in learned.unusable.items()
        ]
        if learned.steps:
            self.metrics.steps.inc(learned.steps)
            self.metrics.loss.set(learner.last_loss or 0.0)
        self.unpublished += learned.examples
        self.metrics.labels.inc(learned.examples)
        return rejects

    def _learner(self) -> OnlineLearner:
        if self.learner is None or self.loop is None:
            raise RuntimeError("the updater handles labels only while it holds the lease")
        return self.learner

    def _credit(self, spec: ProbeSpec, labels: list[HumanLabel]) -> None:
        """Evidence: each label against the flag decision of the version(s) that judged it,
        and against the decision of each head it annotates.

        Best-effort: without Redis the labels are still learned from.
        """
        if not spec.flag_labels or not labels:
            return
        truths = label_truths(spec, labels)
        # Who said it, per label that tells the evidence something (the policy promotes
        # only on the labels of several labelers).
        said = [(lb.message_id, lb.labeler_id) for lb in labels if label_truths(spec, [lb])]
        try:
            self.metrics.labels_credited.inc(self.evidence.record_truths(self.name, truths))
            self.evidence.record_labelers(self.name, said)
        except (redis.RedisError, OSError) as exc:
            self.redis_state.trip(exc)
            log.warning("could not record label evidence (%s)", exc)

    # --- between batches: lease and publishing ------------------------------

    def _between_batches(self) -> Between:
        """Publish when due, tick the rollout; tell the loop whether to commit."""
        self.health.beat()
        if self.keeper.lost.is_set():
            return Between.STOP
        if self._superseded():
            return Between.STOP  # nothing committed: the labels come back to the next tenure
        due_labels = self.unpublished >= self.settings.publish_every_labels
        due_time = (
            self.unpublished > 0
            and time.monotonic() - self.last_publish >= self.settings.publish_every_s
        )
        # Commit once a published version reflects the labels; or when nothing was learned
        # since the last version (labels skipped, dead-lettered): no version needs to
        # reflect them, so commit them now rather than redeliver (and re-dead-letter) them
        # after every restart.
        commit = self.unpublished == 0
        if (due_labels or due_time) and not self._learner().warming_up:
            commit = self.publish(reason=f"{self.unpublished} new labels") is not None
        self._rollout_tick()
        if self.keeper.lost.is_set():  # e.g. the publish was fenced
            return Between.STOP
        return Between.COMMIT if commit else Between.POLL

    def _rollout_tick(self) -> None:
        """Evaluate the rollout policy, at most every ``rollout_check_interval_s``."""
        now = time.monotonic()
        if now < self._next_rollout:
            return
        self._next_rollout = now + self.settings.rollout_check_interval_s
        decision = self.rollout.tick(self.policy)
        if decision is not None and decision.action != "none":
            self.metrics.stage_changes.labels(decision.action).inc()

    def publish(self, *, reason: str = "") -> int | None:
        """Publish the current weights (and Lion state) as a new version; the version, or
        None when nothing was published. The caller commits the labels it reflects.

        Never while a fresh probe is still warming up: it has learned nothing and has no
        input normalization yet, and its labels must come back (uncommitted) to whoever
        completes the warm-up.
        """
        learner = self.learner
        if learner is None or self.loop is None:
            return None
        if self.keeper.lost.is_set():
            log.warning("not publishing %s (%s): the lease is lost", self.name, reason)
            return None
        if learner.warming_up:
            log.info(
                "not publishing %s (%s): still warming up (%d of %d examples)",
                self.name,
                reason,
                len(learner.warmup or []),
                learner.config.stats_warmup,
            )
            return None
        start = time.perf_counter()
        reason, metrics = prepare_publish(learner, reason)
        try:
            version, pruned = publish_version(
                learner,
                self.registry,
                self.extractor,
                self.settings,
                self.keys,
                metrics=metrics,
                parent=self.parent,
                token=self.lease.token,
                actor=self.worker_id,
                reason=reason,
            )
        except Fenced as exc:
            self.keeper.mark_lost(f"{exc}; another updater holds it")  # stops the loop
            return None
        except (RegistryError, redis.RedisError, OSError) as exc:
            if not isinstance(exc, RegistryError):
                self.redis_state.trip(exc)
            log.warning("publishing failed (%s); will retry", exc)
            self.last_publish = time.monotonic()
            return None
        self.redis_state.reset()
        self.parent = version
        self.unpublished = 0
        self.last_publish = time.monotonic()
        # Only versions still retained: a pruned one can be no add-head's base (bounded).
        self.published = [v for v in self.published if v not in pruned] + [version]
        self._next_rollout = 0.0  # let the policy see the new candidate at once
        seconds = time.perf_counter() - start
        self.metrics.published(version, seconds, metrics, self.settings.entropy_alarm)
        log.info(
            "published %s v%d (%s; f1=%.3f)",
            self.name,
            version,
            reason,
            metrics.get("prequential_f1", float("nan")),
        )
        return version

    def _superseded(self) -> bool:
        """Whether someone else (an operator's ``probe add-head``) published a newer version
        during this tenure: it then ends without publishing or committing, and the next one
        resumes from that version (the unpublished labels come back from Kafka)."""
        latest = published_by_another(self.registry, self.published, self.parent)
        if latest is not None:
            log.warning(
                "%s v%d was published by someone else; dropping %d unpublished labels (they "
                "come back) and resuming from it", self.name, latest, self.unpublished,
            )  # fmt: skip
            self.superseded_by = latest
        return latest is not None
