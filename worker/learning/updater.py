"""The updater (``probeguard train``): human labels in, versioned checkpoints out.

    standby  -- wait for the probe's lease (hot standby; takes over when it expires)
    resume   -- newest published version (weights + Lion state), else the seed
                checkpoint file, else the packaged default of the LLM (worker/defaults),
                else a fresh probe from a spec ("from zero")
    per batch of HumanLabels:
        join the text (label.text, else the scorers' Redis text cache)
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
from pathlib import Path
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from probes import Probe, ProbeError, build_probe, encode_target, spread_layers
from probes.checkpoint import checkpoint_to_bytes, load_checkpoint, probe_from_bytes
from probes.errors import CheckpointError
from schemas import CheckpointManifest, HumanLabel, ProbeSpec, TrainingCounters
from worker.defaults import PackagedDefault, find_default
from worker.errors import (
    ConfigError,
    Fenced,
    KafkaSetupError,
    RegistryError,
    StagesChanged,
    TransientError,
)
from worker.kafka.batch_loop import BatchLoop, Between, Item, Outgoing, Reject
from worker.kafka.clients import ensure_topics
from worker.kafka.runtime import RoleRuntime
from worker.learning.online_learner import Labeled, LearningConfig, OnlineLearner
from worker.llm.extract import HiddenStateExtractor
from worker.rollout.changes import Rollout
from worker.rollout.policy import Policy
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore
from worker.store.lease import Lease, LeaseKeeper
from worker.store.redis import Keys, make_text_redis

__all__ = ["Updater", "default_spec"]

log = logging.getLogger(__name__)


def default_spec(name: str, num_layers: int, hidden_size: int) -> ProbeSpec:
    """The from-zero probe: binary toxicity, downcast MHA pooling, scalar mix over eight
    spread layers (the layers ``cache build`` stores token by token): the kind that wins on
    held-out data, offline and online (bench/quality.md, bench/online_vs_offline.py)."""
    return ProbeSpec(
        name=name,
        token_pool="mha",
        layer_mix="scalar_mix",
        layers=spread_layers(num_layers, 8),
        hidden_size=hidden_size,
        task="multiclass",
        labels=["non-toxic", "toxic"],
        flag_labels=["toxic"],
    )


def _says_no_flag_head_flags(spec: ProbeSpec, label: HumanLabel) -> bool:
    """Whether a label without a flag label is a negative for the whole flag decision: it
    annotates every head that can flag (a multi-head label for one other head says nothing
    of whether the message should be flagged)."""
    if not spec.heads:
        return True
    flagging = {spec.head_of(x).name for x in spec.flag_labels}
    named = {label.head} if label.head else {spec.head_of(n).name for n in label.all_labels}
    return flagging <= named


class UpdaterMetrics:
    def __init__(self) -> None:
        r = self.collector = CollectorRegistry()
        self.labels = Counter("probeguard_updater_labels", "Labels learned from", registry=r)
        self.steps = Counter("probeguard_updater_steps", "Lion steps", registry=r)
        self.loss = Gauge("probeguard_updater_loss", "Loss of the last step", registry=r)
        self.dead_letters = Counter(
            "probeguard_updater_dead_letters", "Labels dead-lettered", ["kind"], registry=r
        )
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
        self.labels_credited = Counter(
            "probeguard_updater_labels_credited",
            "Labels credited to the version(s) that judged the message (evidence)",
            registry=r,
        )


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
        self.keys = Keys(settings.redis_prefix)
        self.name = settings.probe_to_train
        self.worker_id = worker_id or settings.resolved_worker_id()
        self.registry = CheckpointRegistry(
            redis_client, self.keys, self.name, signing_key=settings.signing_key
        )
        self.lease = Lease(
            redis_client, self.registry.lease_key, self.worker_id, settings.lease_ttl_ms
        )
        self.evidence = EvidenceStore.from_settings(redis_client, settings, cache=self.text_redis)
        self.rollout = Rollout(self.registry, self.evidence, actor=self.worker_id)
        self.policy = Policy.from_settings(settings)
        self._next_rollout = 0.0
        self.metrics = UpdaterMetrics()
        self.runtime = RoleRuntime(
            settings,
            self.metrics.collector,
            role="updater",
            worker_id=self.worker_id,
            metrics_port=metrics_port,
        )
        self.health = self.runtime.health
        self.health.ready_check = self._ready
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
                self.lease.release()

    def _standby_or_serve(self) -> None:
        announced = False
        stop = self.runtime.stop_event
        while not stop.is_set():
            self.health.beat()
            if self._try_lease():
                try:
                    self._serve()
                except (redis.RedisError, OSError, KafkaSetupError) as exc:
                    # e.g. Redis failing during the resume: give the lease up and retry,
                    # rather than exit (and let the standby fail the same way).
                    log.error("serving %s failed (%s); back to standby", self.name, exc)
                    self._give_up_lease()
                announced = False
            elif not announced:
                holder = self.lease.current()
                log.info(
                    "standby: the %s lease is held by %s",
                    self.name,
                    holder[1] if holder else "nobody (retrying)",
                )
                announced = True
            stop.wait(self.settings.lease_ttl_ms / 3000)

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
        return True, "active" if self.active else "standby"

    def _try_lease(self) -> bool:
        try:
            return self.lease.acquire() is not None
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot reach Redis for the lease (%s); retrying", exc)
            return False

    def _serve(self) -> None:
        log.info("lease for %s acquired (token %s); resuming", self.name, self.lease.token)
        # Renewed on its own thread, however long a batch takes; once lost, nothing more
        # is published or committed, and the next tenure resumes from the registry.
        self.keeper = LeaseKeeper(self.lease, on_lost=self._lease_lost).start()
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

    def _newest_verifiable(self) -> tuple[int, Probe, CheckpointManifest] | None:
        """The newest published version this updater can verify and load. One that does
        not verify (corrupt, tampered, signed with another key, another LLM) is skipped
        with an error, rather than stopping every updater of the probe."""
        for version in reversed(self.registry.versions()):
            try:
                stored = self.registry.get(version)
                probe, manifest = probe_from_bytes(
                    stored.blob,
                    stored.manifest_json,
                    self.extractor.fingerprint,
                    signing_key=self.settings.signing_key,
                )
            except (RegistryError, CheckpointError) as exc:
                self.metrics.resume_skipped.inc()
                log.error("cannot resume %s from v%d (%s); trying older", self.name, version, exc)
                continue
            return version, probe, manifest
        return None

    def _resume(self) -> None:
        fp = self.extractor.fingerprint
        found = self._newest_verifiable()
        latest = found[0] if found is not None else None
        if found is not None:
            latest, probe, manifest = found
            self.parent, counters = latest, manifest.counters
            source = f"v{latest}"
        elif self.settings.seed_checkpoint is not None:
            probe, manifest = load_checkpoint(
                self.settings.seed_checkpoint, fp, signing_key=self.settings.signing_key
            )
            if manifest.probe != self.name:
                raise ConfigError(
                    f"seed checkpoint is for probe {manifest.probe!r}, not {self.name!r}"
                )
            self.parent, counters = None, manifest.counters
            source = f"seed checkpoint {self.settings.seed_checkpoint}"
        elif (packaged := self._packaged_default()) is not None:
            probe, manifest = packaged.probe, packaged.manifest
            self.parent, counters = None, manifest.counters
            source = f"the packaged default {packaged.folder}"
        else:
            spec = self._seed_spec()
            probe = build_probe(spec, seed=0)
            self.parent, counters = None, TrainingCounters()
            source = "zero"
        self.learner = OnlineLearner(
            probe,
            LearningConfig.from_settings(self.settings),
            counters=counters,
            fresh=source == "zero",
        )
        self.unpublished = 0
        self.last_publish = time.monotonic()
        self.superseded_by = None
        if found is not None:
            self._restore_optimizer(found[0], found[2])
        log.info(
            "resumed %s from %s (%d labels seen so far)", self.name, source, counters.labels_seen
        )

    def _packaged_default(self) -> PackagedDefault | None:
        """The packaged default to fine-tune from (with ``DEFAULT_PROBE`` on and no seed
        spec asked for): what scorers already serve while nothing is published."""
        if not self.settings.default_probe or self.settings.seed_spec is not None:
            return None
        return find_default(self.extractor.fingerprint, self.name)

    def _seed_spec(self) -> ProbeSpec:
        if self.settings.seed_spec is None:
            return default_spec(self.name, self.extractor.num_layers, self.extractor.hidden_size)
        try:
            spec = ProbeSpec.model_validate_json(Path(self.settings.seed_spec).read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read seed spec {self.settings.seed_spec}: {exc}") from exc
        if spec.name != self.name or spec.hidden_size != self.extractor.hidden_size:
            raise ConfigError(
                f"seed spec is {spec.name!r} for hidden size {spec.hidden_size}; this updater "
                f"trains {self.name!r} on a model of hidden size {self.extractor.hidden_size}"
            )
        return spec

    # --- the batch -----------------------------------------------------------

    def handle(self, items: list[Item[HumanLabel]]) -> Sequence[Outgoing | Reject]:
        learner = self._learner()
        spec = learner.probe.spec
        rejects: list[Reject] = []
        items = [i for i in items if self._is_ours(i.value, spec)]
        texts = self._join_texts([i.value for i in items])
        sources: list[Item[HumanLabel]] = []
        ready: list[Labeled] = []  # ready[k] is the label of sources[k]
        for item, text in zip(items, texts, strict=True):
            if text is None:
                why = "no text in the label and none cached for the message"
                rejects.append(Reject(item, "unjoinable", why))
                continue
            try:
                target, bucket = encode_target(spec, item.value.all_labels, item.value.head)
            except ProbeError as exc:
                rejects.append(Reject(item, "unknown_label", str(exc)))
                continue
            sources.append(item)
            ready.append(Labeled(text, target, bucket))
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

    def _is_ours(self, label: HumanLabel, spec: ProbeSpec) -> bool:
        """Whether this probe should learn (or dead-letter) ``label``.

        Every probe's updaters read every label (one consumer group per probe). A label
        addressed to another probe is not ours; an unaddressed one is, if we know its
        labels, or if no other probe is configured (then it is our unknown label).
        """
        if label.probe is not None:
            ours = label.probe == self.name
            reason = "other_probe"
        else:
            known = all(n in spec.labels for n in label.all_labels)
            ours = known or not [p for p in self.settings.probe_names if p != self.name]
            reason = "unknown_unaddressed"
        if not ours:
            self.metrics.skipped.labels(reason).inc()
        return ours

    def _learner(self) -> OnlineLearner:
        if self.learner is None or self.loop is None:
            raise RuntimeError("the updater handles labels only while it holds the lease")
        return self.learner

    def _credit(self, spec: ProbeSpec, labels: list[HumanLabel]) -> None:
        """Evidence: each label against the flag decision of the version(s) that judged it.

        Best-effort: without Redis the labels are still learned from.
        """
        if not spec.flag_labels or not labels:
            return
        flag = set(spec.flag_labels)
        truths = []
        for lb in labels:
            positive = any(n in flag for n in lb.all_labels)
            if positive or _says_no_flag_head_flags(spec, lb):
                truths.append((lb.message_id, positive))
        try:
            self.metrics.labels_credited.inc(self.evidence.record_labels(self.name, truths))
        except (redis.RedisError, OSError) as exc:
            log.warning("could not record label evidence (%s)", exc)

    def _join_texts(self, labels: list[HumanLabel]) -> list[str | None]:
        missing = [lb.message_id for lb in labels if lb.text is None]
        cached: dict[str, str | None] = {}
        if missing:
            try:
                values = self.text_redis.mget([self.keys.text(m) for m in missing])
            except (redis.RedisError, OSError) as exc:
                raise TransientError(f"text cache unreachable: {exc}") from exc
            cached = {
                m: (v.decode() if v is not None else None)
                for m, v in zip(missing, values, strict=True)
            }
        return [lb.text if lb.text is not None else cached.get(lb.message_id) for lb in labels]

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
        try:
            decision = self.rollout.evaluate(self.policy)
        except StagesChanged as exc:
            log.info("rollout: %s; deciding again next time", exc)
            return
        except (RegistryError, redis.RedisError, OSError) as exc:
            log.warning("rollout policy could not run (%s)", exc)
            return
        if decision.action != "none":
            self.metrics.stage_changes.labels(decision.action).inc()
            log.info(
                "rollout: %s %s v%s: %s",
                decision.action,
                self.name,
                decision.version,
                decision.reason,
            )

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
        dropped = learner.drop_negligible_layers()
        if dropped:
            reason = f"{reason}; dropped layers {dropped} (mix weight stayed negligible)"
        learner.calibrate()
        metrics = learner.metrics()
        try:
            version = self.registry.allocate_version()
            blob, manifest = checkpoint_to_bytes(
                learner.publishable(),
                llm=self.extractor.fingerprint,
                version=version,
                parent=self.parent,
                counters=learner.counters,
                metrics=metrics,
                signing_key=self.settings.signing_key,
                weights=self.settings.publish_weights,
            )
            self.registry.publish(
                blob,
                manifest,
                token=self.lease.token,
                set_live=self.settings.rollout_mode == "auto_live",
                actor=self.worker_id,
                reason=reason,
            )
            self.registry.save_optimizer_state(version, learner.optimizer_state())
            self.registry.prune(self.settings.keep_versions)
        except Fenced as exc:
            self.keeper.mark_lost(f"{exc}; another updater holds it")  # stops the loop
            return None
        except (RegistryError, redis.RedisError, OSError) as exc:
            log.warning("publishing failed (%s); will retry", exc)
            self.last_publish = time.monotonic()
            return None
        self.parent = version
        self.unpublished = 0
        self.last_publish = time.monotonic()
        self.published.append(version)
        self._next_rollout = 0.0  # let the policy see the new candidate at once
        self.metrics.version.set(version)
        self.metrics.publish_seconds.observe(time.perf_counter() - start)
        for k, v in metrics.items():
            if k.startswith("prequential_") and "/" not in k:
                self.metrics.prequential.labels(k.removeprefix("prequential_")).set(v)
        entropy = metrics["layer_entropy"]
        self.metrics.entropy.set(entropy)
        self.metrics.collapse.set(1 if entropy < self.settings.entropy_alarm else 0)
        log.info(
            "published %s v%d (%s; f1=%.3f)",
            self.name,
            version,
            reason,
            metrics.get("prequential_f1", float("nan")),
        )
        return version

    def _superseded(self) -> bool:
        """Whether someone else published a newer version while this updater held the lease
        (an operator adding a head: `probeguard probe add-head`). Then this tenure ends
        without publishing or committing, and the next one resumes from that version: the
        labels learned since the last publish come back from Kafka and are learned again,
        on the new version (with its new head)."""
        try:
            latest = self.registry.latest()
        except (redis.RedisError, OSError):
            return False  # the publish or the next check finds out
        if latest is None or latest in self.published or latest <= (self.parent or 0):
            return False
        log.warning(
            "%s v%d was published by someone else while this updater held the lease; "
            "dropping %d unpublished labels (they come back) and resuming from it",
            self.name,
            latest,
            self.unpublished,
        )
        self.superseded_by = latest
        return True

    def _restore_optimizer(self, version: int, manifest: CheckpointManifest) -> None:
        """Lion's momentum published with ``version``, when the registry vouches for it;
        for a version published without one (an operator's `add-head`), its parent's,
        moved to this version's labels (a new head's rows start at zero momentum). Else
        learning restarts it at zero (see
        :meth:`~worker.store.checkpoints.CheckpointRegistry.load_optimizer_state`)."""
        if self.learner is None:
            return
        source, labels = version, manifest.spec.labels
        try:
            state = self.registry.load_optimizer_state(version)
            if state is None and manifest.parent is not None:
                source = manifest.parent
                state = self.registry.load_optimizer_state(source)
                if state is not None:
                    labels = self.registry.manifest(source).spec.labels
        except RegistryError as exc:
            log.error("Lion state of v%d refused (%s); starting it afresh", source, exc)
            return
        if state is None:
            return
        used = self.learner.load_optimizer_state(state, labels)
        log.info("restored Lion state of v%d (%d tensors) for v%d", source, used, version)
