"""Writing one version of the learner's probe to the registry: the checkpoint, its Lion
state, and the pruning of old versions.

Apart from :mod:`worker.learning.updater`, which decides *when* to publish (labels or time
due, lease held, warm-up done) and what a failure means; this is *what* a publish writes,
in order, fenced by the lease token.
"""

from __future__ import annotations

from probes.checkpoint import checkpoint_to_bytes
from worker.learning.online_learner import OnlineLearner
from worker.llm.extract import HiddenStateExtractor
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import Keys

__all__ = ["prepare_publish", "publish_version"]


def prepare_publish(learner: OnlineLearner, reason: str) -> tuple[str, dict[str, float]]:
    """Ready the learner's probe for a version: drop the deepest layers whose mix weight
    stayed negligible, recalibrate on the prequential window; the publish reason (naming
    the dropped layers) and the manifest metrics."""
    dropped = learner.drop_negligible_layers()
    if dropped:
        reason = f"{reason}; dropped layers {dropped} (mix weight stayed negligible)"
    learner.calibrate()
    return reason, learner.metrics()


def publish_version(
    learner: OnlineLearner,
    registry: CheckpointRegistry,
    extractor: HiddenStateExtractor,
    settings: Settings,
    keys: Keys,
    *,
    metrics: dict[str, float],
    parent: int | None,
    token: str | None,
    actor: str,
    reason: str,
) -> tuple[int, set[int]]:
    """Publish the learner's probe as a new version (its parent ``parent``) with its Lion
    state, and prune to ``keep_versions``; the version and the versions pruned.

    Raises what the registry raises: ``Fenced`` (the lease ``token`` is no longer the
    holder's), ``RegistryError``, Redis and OS errors; the caller decides what each means."""
    version = registry.allocate_version()
    probe = learner.publishable()
    blob, manifest = checkpoint_to_bytes(
        probe,
        llm=extractor.fingerprint,
        version=version,
        parent=parent,
        counters=learner.counters,
        metrics=metrics,
        signing_key=settings.signing_key,
        weights=settings.publish_weights,
        drift=learner.drift_reference(probe),
        deployment=keys.deployment,
    )
    registry.publish(
        blob,
        manifest,
        token=token,
        set_live=settings.rollout == "auto_live",
        actor=actor,
        reason=reason,
    )
    registry.save_optimizer_state(version, learner.optimizer_state())
    pruned = set(registry.prune(settings.keep_versions))
    return version, pruned
