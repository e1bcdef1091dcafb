"""The updater (``probeguard train``): human labels in, versioned checkpoints out.

    standby  -- wait for the probe's lease (hot standby; takes over when it expires)
    resume   -- newest published version (weights + Lion state), else the seed
                checkpoint file, else a fresh probe from a spec ("from zero")
    per batch of HumanLabels:
        join the text (label.text, else the scorers' Redis text cache)
        extract hidden states of the probe's layers (early exit)
        test:  score with the current probe -> windowed prequential metrics
        train: Lion steps on new examples + a class-balanced replay sample
    publish  -- every N labels or T seconds: a new version (fenced by the lease
                token) with counters and prequential metrics; only then are the
                label offsets committed, so a crash loses no label
    rollout  -- every label is credited to the version(s) that judged its message
                (evidence), and between batches the rollout policy promotes, trials
                or rolls back versions (see worker.rollout.stages); the lease holder is the
                only automatic writer of stages

Labels that cannot be joined, name unknown labels, or whose text the model
cannot read go to the dead-letter topic. A fresh probe first collects
``stats_warmup`` examples to fix its input normalization, then learns.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from probes.checkpoint import checkpoint_to_bytes, load_checkpoint, probe_from_bytes
from probes.errors import CheckpointError
from probes.learner import Learner
from probes.metrics import choose_thresholds
from probes.pooling import SUMMARIES
from probes.probe import Probe, build_probe
from schemas import HumanLabel, ProbeSpec, TrainingCounters
from worker.errors import ConfigError
from worker.health import Health, HealthServer
from worker.kafka.batch_loop import BatchLoop, Item, Outgoing, TransientError
from worker.kafka.clients import ensure_topics
from worker.learning.replay import Example, Prequential, ReplayBuffer, collate
from worker.llm.extract import HiddenStateExtractor
from worker.rollout.stages import Policy, Rollout
from worker.settings import Settings
from worker.store.checkpoints import Fenced, Registry, RegistryError, StagesChanged
from worker.store.evidence import EvidenceStore
from worker.store.lease import Lease
from worker.store.redis import Keys

__all__ = ["Updater", "default_spec"]

log = logging.getLogger(__name__)


def default_spec(name: str, num_layers: int, hidden_size: int) -> ProbeSpec:
    """The from-zero probe: binary toxicity, mean pooling, scalar mix over six spread layers."""
    layers = sorted({max(1, round(num_layers * k / 6)) for k in range(1, 7)})
    return ProbeSpec(
        name=name,
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=layers,
        hidden_size=hidden_size,
        task="multiclass",
        labels=["non-toxic", "toxic"],
        flag_labels=["toxic"],
    )


class UpdaterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
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
    ) -> None:
        self.settings = settings
        self.extractor = extractor
        self.redis: Any = redis_client
        self.keys = Keys(settings.redis_prefix)
        self.name = settings.trained_probe
        self.worker_id = worker_id or settings.resolved_worker_id()
        self.registry = Registry(redis_client, self.keys, self.name)
        self.lease = Lease(
            redis_client, self.registry.lease_key, self.worker_id, settings.lease_ttl_ms
        )
        self.evidence = EvidenceStore(
            redis_client,
            self.keys,
            pairs_max=settings.evidence_pairs,
            marker_ttl_s=settings.text_cache_ttl_s,
        )
        self.rollout = Rollout(self.registry, self.evidence, actor=self.worker_id)
        self.policy = Policy.from_settings(settings)
        self._next_rollout = 0.0
        self.metrics = UpdaterMetrics()
        self.health = Health(stale_after_s=max(60.0, settings.kafka_max_poll_interval_ms / 1000))
        self.health.ready_check = lambda: (True, "active" if self.active else "standby")
        port = settings.metrics_port if metrics_port is None else metrics_port
        self._server = HealthServer(self.metrics.registry, self.health, port) if port else None
        self._stop = threading.Event()
        self.loop: BatchLoop[HumanLabel] | None = None
        self.active = False
        # Learning state, set by _resume().
        self.probe: Probe | None = None
        self.learner: Learner | None = None
        self.ema: dict[str, torch.Tensor] | None = None
        self.parent: int | None = None
        self.counters = TrainingCounters()
        self.replay: ReplayBuffer | None = None
        self.prequential: Prequential | None = None
        self.warmup: list[Example] = []
        self.needs_stats = False
        self.unpublished = 0
        self.last_publish = time.monotonic()
        self.published: list[int] = []

    # --- lifecycle -----------------------------------------------------------

    def run(self) -> None:
        """Standby until the lease is ours, learn until it is lost or :meth:`stop`; repeat."""
        if self._server is not None:
            self._server.start()
        try:
            announced = False
            while not self._stop.is_set():
                self.health.beat()
                if self._try_lease():
                    self._serve()
                    announced = False
                elif not announced:
                    holder = self.lease.current()
                    log.info(
                        "standby: the %s lease is held by %s",
                        self.name,
                        holder[1] if holder else "nobody (retrying)",
                    )
                    announced = True
                self._stop.wait(self.settings.lease_ttl_ms / 3000)
        finally:
            self.lease.release()
            if self._server is not None:
                self._server.stop()

    def stop(self) -> None:
        self._stop.set()
        if self.loop is not None:
            self.loop.stop()

    def _try_lease(self) -> bool:
        try:
            return self.lease.acquire() is not None
        except (redis.RedisError, OSError) as exc:
            log.warning("cannot reach Redis for the lease (%s); retrying", exc)
            return False

    def _serve(self) -> None:
        log.info("lease for %s acquired (token %s); resuming", self.name, self.lease.token)
        self.active = True
        self.metrics.lease.set(1)
        self._resume()
        ensure_topics(self.settings, [self.settings.topic_labels, self.settings.topic_dead_letter])
        self.loop = BatchLoop.for_topic(
            self.settings,
            group_id=self.settings.group_updater,
            topic=self.settings.topic_labels,
            model=HumanLabel,
            handler=self.handle,
            worker_id=self.worker_id,
            max_batch=self.settings.learn_batch_size,
            between_batches=self._between_batches,
            on_dead_letter=lambda kind: self.metrics.dead_letters.labels(kind).inc(),
            defer_commits=True,
        )
        if self._stop.is_set():
            self.loop.stop()
        try:
            self.loop.run()
            if self.unpublished and self._holds_lease():
                self.publish(reason="shutdown")
        finally:
            self.loop.close()
            self.loop = None
            self.active = False
            self.metrics.lease.set(0)

    # --- resume --------------------------------------------------------------

    def _resume(self) -> None:
        fp = self.extractor.fingerprint
        latest = self.registry.latest()
        if latest is not None:
            stored = self.registry.get(latest)
            try:
                probe, manifest = probe_from_bytes(
                    stored.blob, stored.manifest_json, fp, signing_key=self.settings.signing_key
                )
            except CheckpointError as exc:
                raise ConfigError(f"cannot resume {self.name} from v{latest}: {exc}") from exc
            self.parent, self.counters = latest, manifest.counters
            source = f"v{latest}"
        elif self.settings.seed_checkpoint is not None:
            probe, manifest = load_checkpoint(
                self.settings.seed_checkpoint, fp, signing_key=self.settings.signing_key
            )
            if manifest.probe != self.name:
                raise ConfigError(
                    f"seed checkpoint is for probe {manifest.probe!r}, not {self.name!r}"
                )
            self.parent, self.counters = None, manifest.counters
            source = f"seed checkpoint {self.settings.seed_checkpoint}"
        else:
            spec = self._seed_spec()
            probe = build_probe(spec, seed=0)
            self.parent, self.counters = None, TrainingCounters()
            source = "zero"
        self._start_learning(probe, fresh=source == "zero")
        if latest is not None:
            self._load_optimizer(latest)
        log.info(
            "resumed %s from %s (%d labels seen so far)",
            self.name,
            source,
            self.counters.labels_seen,
        )

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

    def _start_learning(self, probe: Probe, *, fresh: bool) -> None:
        s = self.settings
        probe.train()
        self.probe = probe
        self.learner = Learner(probe, lr=s.learn_lr, weight_decay=s.learn_weight_decay)
        self.learner.steps = self.counters.steps
        buckets = len(probe.spec.labels) + (1 if probe.spec.task == "multilabel" else 0)
        self.replay = ReplayBuffer(s.replay_size, buckets)
        self.prequential = Prequential(probe.spec, s.prequential_window)
        self.ema = (
            {k: v.detach().clone() for k, v in probe.state_dict().items()}
            if s.ema_decay is not None
            else None
        )
        self.needs_stats = fresh
        self.warmup = []
        self.unpublished = 0
        self.last_publish = time.monotonic()

    # --- the batch -----------------------------------------------------------

    def handle(self, items: list[Item[HumanLabel]]) -> Sequence[Outgoing]:
        probe, learner, loop = self.probe, self.learner, self.loop
        if probe is None or learner is None or loop is None or self.prequential is None:
            raise RuntimeError("handle() called before resume")
        spec = probe.spec
        dead: list[Outgoing] = []
        texts = self._join_texts([i.value for i in items])
        ready: list[tuple[Item[HumanLabel], str, torch.Tensor, int]] = []
        for item, text in zip(items, texts, strict=True):
            if text is None:
                dead.append(
                    self._reject(
                        item, "unjoinable", "no text in the label and none cached for the message"
                    )
                )
                continue
            target = _target(spec, item.value)
            if isinstance(target, str):
                dead.append(self._reject(item, "unknown_label", target))
                continue
            ready.append((item, text, *target))
        self._credit(spec, [r[0].value for r in ready])
        if not ready:
            return dead
        ex = self.extractor.extract([t for _, t, _, _ in ready], probe.layers)
        for pos, reason in ex.errors.items():
            dead.append(self._reject(ready[pos][0], "unscorable", reason))
        if not ex.index:
            return dead
        targets = torch.stack([ready[pos][2] for pos in ex.index])
        buckets = [ready[pos][3] for pos in ex.index]
        hidden = ex.hidden.float()  # [L, B, T, D]
        mask = ex.mask
        # Test, then train: the prequential score comes from the probe before this step.
        self.prequential.add(learner.predict_proba_many(hidden, mask), targets)
        new = self._examples(hidden, mask, targets, buckets)
        self._learn(new)
        self.counters = _count(self.counters, spec, targets, len(new), learner.steps)
        self.unpublished += len(new)
        self.metrics.labels.inc(len(new))
        return dead

    def _credit(self, spec: ProbeSpec, labels: list[HumanLabel]) -> None:
        """Evidence: each label against the flag decision of the version(s) that judged it.

        Best-effort: without Redis the labels are still learned from.
        """
        if not spec.flag_labels or not labels:
            return
        flag = set(spec.flag_labels)
        truths = [(lb.message_id, any(n in flag for n in lb.all_labels)) for lb in labels]
        try:
            self.metrics.labels_credited.inc(self.evidence.record_labels(self.name, truths))
        except (redis.RedisError, OSError) as exc:
            log.warning("could not record label evidence (%s)", exc)

    def _join_texts(self, labels: list[HumanLabel]) -> list[str | None]:
        missing = [lb.message_id for lb in labels if lb.text is None]
        cached: dict[str, str | None] = {}
        if missing:
            try:
                values = self.redis.mget([self.keys.text(m) for m in missing])
            except (redis.RedisError, OSError) as exc:
                raise TransientError(f"text cache unreachable: {exc}") from exc
            cached = {
                m: (v.decode() if v is not None else None)
                for m, v in zip(missing, values, strict=True)
            }
        return [lb.text if lb.text is not None else cached.get(lb.message_id) for lb in labels]

    def _reject(self, item: Item[HumanLabel], kind: Any, why: str) -> Outgoing:
        if self.loop is None:
            raise RuntimeError("no loop")
        return self.loop.dead_letter(
            item.topic, item.partition, item.offset, item.key, item.value.encode(), kind, why
        )

    def _examples(
        self, hidden: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, buckets: list[int]
    ) -> list[Example]:
        probe = self.probe
        if probe is None:
            raise RuntimeError("no probe")
        if probe.separable:
            with torch.no_grad():
                raw = SUMMARIES[probe.spec.token_pool](hidden, mask)  # [L, B, D], unnormalized
                pooled = raw.half()
            return [
                Example(pooled[:, b].clone(), targets[b], buckets[b]) for b in range(len(buckets))
            ]
        out = []
        for b in range(len(buckets)):
            real = mask[b].nonzero().flatten()
            out.append(Example(hidden[:, b, real].half().clone(), targets[b], buckets[b]))
        return out

    def _learn(self, new: list[Example]) -> None:
        probe, learner, replay = self.probe, self.learner, self.replay
        if probe is None or learner is None or replay is None:
            raise RuntimeError("no learner")
        if self.needs_stats:  # a fresh probe: fix the input normalization first
            self.warmup.extend(new)
            if len(self.warmup) < self.settings.stats_warmup:
                return
            self._set_stats(self.warmup)
            self.needs_stats, new, self.warmup = False, self.warmup, []
        bs = self.settings.learn_batch_size
        for start in range(0, len(new), bs):
            fresh = new[start : start + bs]
            # At least as many replayed (class-balanced) examples as fresh ones: a full
            # batch of fresh labels must not crowd the replay out, or a skewed stream
            # (ToxicChat: 7 % toxic) teaches mostly its majority class.
            extra = max(bs - len(fresh), len(fresh))
            for _ in range(self.settings.learn_steps_per_batch):
                batch = fresh + replay.sample(extra)
                hidden, mask, targets = collate(batch)
                loss = learner.learn_many(hidden, mask, targets)
                self.metrics.steps.inc()
                self.metrics.loss.set(loss)
                self._update_ema()
            replay.add(fresh)

    def _set_stats(self, examples: list[Example]) -> None:
        probe = self.probe
        if probe is None:
            raise RuntimeError("no probe")
        if examples[0].x.dim() == 2:
            data = torch.stack([e.x.float() for e in examples])  # [N, L, D]
        else:
            data = torch.cat([e.x.float().transpose(0, 1) for e in examples])  # [N_tok, L, D]
        mean, std = data.mean(dim=0), data.std(dim=0)
        probe.set_input_stats(mean, torch.where(std > 1e-6, std, torch.ones_like(std)))
        log.info("input normalization fixed from %d examples", len(examples))

    def _update_ema(self) -> None:
        if self.ema is None or self.probe is None or self.settings.ema_decay is None:
            return
        d = self.settings.ema_decay
        with torch.no_grad():
            for k, v in self.probe.state_dict().items():
                if v.is_floating_point():
                    self.ema[k].mul_(d).add_(v, alpha=1 - d)
                else:
                    self.ema[k].copy_(v)

    # --- between batches: lease and publishing ------------------------------

    def _between_batches(self) -> None:
        self.health.beat()
        if not self._holds_lease():
            log.warning("lost the %s lease; back to standby", self.name)
            if self.loop is not None:
                self.loop.stop()
            return
        due_labels = self.unpublished >= self.settings.publish_every_labels
        due_time = (
            self.unpublished > 0
            and time.monotonic() - self.last_publish >= self.settings.publish_every_s
        )
        if (due_labels or due_time) and not self.needs_stats:
            self.publish(reason=f"{self.unpublished} new labels")
        self._rollout_tick()

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

    def _holds_lease(self) -> bool:
        try:
            return self.lease.acquire() is not None
        except (redis.RedisError, OSError) as exc:
            # Redis is down: keep learning; publishing waits (and is fenced anyway).
            log.warning("cannot renew the lease (%s)", exc)
            return True

    def publish(self, *, reason: str = "") -> int | None:
        """Publish the current weights as a new version; commit the labels they reflect."""
        probe, learner = self.probe, self.learner
        if probe is None or learner is None or self.prequential is None or self.loop is None:
            return None
        start = time.perf_counter()
        self._calibrate()
        metrics = self.prequential.report()
        metrics["layer_entropy"] = probe.layer_entropy()
        try:
            version = self.registry.allocate_version()
            blob, manifest = checkpoint_to_bytes(
                self._publishable(),
                llm=self.extractor.fingerprint,
                version=version,
                parent=self.parent,
                counters=self.counters,
                metrics=metrics,
                signing_key=self.settings.signing_key,
            )
            self.registry.publish(
                blob,
                manifest,
                token=self.lease.token,
                set_live=self.settings.rollout_mode == "auto_live",
                actor=self.worker_id,
                reason=reason,
            )
            self._save_optimizer(version)
            self.registry.prune(self.settings.keep_versions)
        except Fenced as exc:
            log.error("%s; stopping (another updater holds the lease)", exc)
            self.loop.stop()
            return None
        except (RegistryError, redis.RedisError, OSError) as exc:
            log.warning("publishing failed (%s); will retry", exc)
            self.last_publish = time.monotonic()
            return None
        self.loop.commit_pending()  # only now: the labels are in a published version
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

    def _calibrate(self) -> None:
        """Flag thresholds that maximize F1 on the prequential window: the online
        counterpart of ``fit`` choosing them on validation. Each label's threshold moves only
        once the window holds ``calibrate_min_positives`` of its positives (0: never)."""
        need = self.settings.calibrate_min_positives
        window = self.prequential.window() if self.prequential is not None else None
        if not need or window is None or self.probe is None:
            return
        spec = self.probe.spec
        chosen = choose_thresholds(spec, *window, min_positives=need)
        if chosen:
            self.probe.set_thresholds({**spec.thresholds, **chosen})

    def _publishable(self) -> Probe:
        if self.probe is None:
            raise RuntimeError("no probe")
        if self.ema is None:
            return self.probe
        shadow = copy.deepcopy(self.probe)
        shadow.load_state_dict(self.ema)
        return shadow

    def _save_optimizer(self, version: int) -> None:
        if self.learner is None or self.probe is None:
            return
        state = {}
        for name, param in self.probe.named_parameters():
            exp_avg = self.learner.optimizer.state.get(param, {}).get("exp_avg")
            if exp_avg is not None:
                state[name] = exp_avg.detach().cpu().contiguous()
        if state:
            self.redis.set(self.registry.keys.optim(self.registry.probe, version), st_save(state))

    def _load_optimizer(self, version: int) -> None:
        if self.learner is None or self.probe is None:
            return
        raw = self.redis.get(self.registry.keys.optim(self.registry.probe, version))
        if raw is None:
            return
        state = st_load(raw)  # safetensors: no pickle
        params = dict(self.probe.named_parameters())
        for name, exp_avg in state.items():
            param = params.get(name)
            if param is not None and param.shape == exp_avg.shape:
                self.learner.optimizer.state[param]["exp_avg"] = exp_avg.clone()
        log.info("restored Lion state of v%d (%d tensors)", version, len(state))


def _target(spec: ProbeSpec, label: HumanLabel) -> tuple[torch.Tensor, int] | str:
    """``(target, balance bucket)`` for ``label``, or why it cannot be learned."""
    names = label.all_labels
    unknown = [n for n in names if n not in spec.labels]
    if unknown:
        return f"labels {unknown} are not among the probe's {spec.labels}"
    if spec.task == "multiclass":
        if len(names) != 1:
            return f"a multiclass probe needs exactly one label, got {list(names)}"
        idx = spec.labels.index(names[0])
        return torch.tensor(idx), idx
    hot = torch.zeros(len(spec.labels))
    for n in names:
        hot[spec.labels.index(n)] = 1.0
    bucket = spec.labels.index(names[0]) if names else len(spec.labels)
    return hot, bucket


def _count(
    counters: TrainingCounters, spec: ProbeSpec, targets: torch.Tensor, n: int, steps: int
) -> TrainingCounters:
    per_label = dict(counters.per_label)
    if spec.task == "multiclass":
        for idx in targets.tolist():
            per_label[spec.labels[idx]] = per_label.get(spec.labels[idx], 0) + 1
    else:
        for j, label in enumerate(spec.labels):
            per_label[label] = per_label.get(label, 0) + int(targets[:, j].sum())
    return TrainingCounters(labels_seen=counters.labels_seen + n, steps=steps, per_label=per_label)
