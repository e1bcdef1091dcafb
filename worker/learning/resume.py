"""Where an updater's tenure starts: the newest published version it can verify, else
the seed checkpoint file, else the packaged default of the LLM (``worker/defaults``; given
an attention pool to learn, :func:`attend`), else a fresh probe from a spec ("from zero":
the seed spec, or :func:`default_spec`). When versions are published but none verifies (a
key rotation), it refuses rather than start over, unless
``PROBEGUARD_START_OVER_UNVERIFIED`` says to."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from probes import Probe, build_probe, spread_layers
from probes.checkpoint import load_checkpoint, probe_from_bytes
from probes.errors import CheckpointError
from probes.probe import with_attention
from schemas import CheckpointManifest, ProbeSpec, TrainingCounters
from worker.defaults import PackagedDefault, serving_default
from worker.errors import ConfigError, RegistryError
from worker.learning.online_learner import OnlineLearner
from worker.llm.extract import HiddenStateExtractor
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

__all__ = [
    "Start",
    "default_spec",
    "given_attention",
    "newest_verifiable",
    "published_by_another",
    "restore_optimizer",
    "seed_spec",
    "starting_point",
]

log = logging.getLogger(__name__)

# The attention pool the packaged default is given (:func:`with_attention`): measured in
# docs/default-probe.md, "With the deployment's labels".
ATTENTION_DIM = 16
ATTENTION_HEADS = 2


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


@dataclass(frozen=True)
class Start:
    """What a tenure learns from: the probe, its counters, and the published version it
    was read from (``None`` otherwise; its Lion state is restored with it)."""

    probe: Probe
    counters: TrainingCounters
    version: int | None
    source: str  # for the log: "v7", "seed checkpoint PATH", ..., "zero"

    @property
    def fresh(self) -> bool:
        return self.source == "zero"


def starting_point(
    settings: Settings,
    registry: CheckpointRegistry,
    extractor: HiddenStateExtractor,
    *,
    on_skipped: Callable[[], object] = lambda: None,
) -> Start:
    """The first of: the newest verifiable version, the seed checkpoint, the packaged
    default, a fresh probe (see the module docstring). ``on_skipped`` is called for each
    published version that does not verify; when versions exist and none verifies, it
    refuses (:class:`ConfigError`) unless ``start_over_unverified`` is set."""
    name, fp = registry.probe, extractor.fingerprint
    skipped: list[int] = []

    def skip(version: int) -> None:
        skipped.append(version)
        on_skipped()

    found = newest_verifiable(registry, extractor, settings.signing_key, skip)
    if found is not None:
        latest, probe, manifest = found
        return Start(probe, manifest.counters, latest, f"v{latest}")
    if skipped and not settings.start_over_unverified:
        raise ConfigError(
            f"no published version of {name} verifies (v{min(skipped)}..v{max(skipped)}: "
            "signed with another CHECKPOINT_HMAC_KEY, for another LLM, or corrupt; see the "
            "errors above): refusing to start over and throw away what they learned. Set the "
            "key they were signed with, or PROBEGUARD_START_OVER_UNVERIFIED=true to start over"
        )
    if settings.seed_checkpoint is not None:
        probe, manifest = load_checkpoint(
            settings.seed_checkpoint, fp, signing_key=settings.signing_key
        )
        if manifest.probe != name:
            raise ConfigError(f"seed checkpoint is for probe {manifest.probe!r}, not {name!r}")
        return Start(probe, manifest.counters, None, f"seed checkpoint {settings.seed_checkpoint}")
    if (packaged := packaged_default(settings, extractor, name)) is not None:
        probe, source = packaged.probe, f"the packaged default {packaged.folder}"
        if attend(settings, probe):
            probe = given_attention(probe)
            source += " given an attention pool"
        return Start(probe, packaged.manifest.counters, None, source)
    probe = build_probe(seed_spec(settings, extractor, name), seed=0)
    return Start(probe, TrainingCounters(), None, "zero")


def given_attention(default: Probe) -> Probe:
    """The packaged default as an updater fine-tunes it: given an attention pool
    (:func:`~probes.probe.with_attention`), scoring as it did until it learns."""
    return with_attention(default, d_inner=ATTENTION_DIM, num_heads=ATTENTION_HEADS)


def attend(settings: Settings, probe: Probe) -> bool:
    """Whether an updater gives the packaged default ``probe`` an attention pool before it
    learns (``DEFAULT_ATTENTION``): a mean pool whose pooling learns (not with
    ``LEARN_FREEZE_SHARED``, which would keep the block silent)."""
    return (
        settings.default_attention
        and probe.spec.token_pool == "mean"
        and not settings.learn_freeze_shared
    )


def newest_verifiable(
    registry: CheckpointRegistry,
    extractor: HiddenStateExtractor,
    signing_key: bytes | None,
    on_skipped: Callable[[int], object] = lambda version: None,
) -> tuple[int, Probe, CheckpointManifest] | None:
    """The newest published version this updater can verify and load. One that does
    not verify (corrupt, tampered, signed with another key or for another deployment,
    another LLM) is skipped with an error, rather than stopping every updater of the probe.

    With a key, a version's signature must be bound to this deployment; an unbound one
    (published before binding existed) only when the verified stage pointers name it."""
    vouched = (registry.verified_shas(registry.stages()) or {}) if signing_key else {}
    for version in reversed(registry.versions()):
        try:
            stored = registry.get(version)
            sha = stored.manifest.tensors_sha256
            probe, manifest = probe_from_bytes(
                stored.blob,
                stored.manifest_json,
                extractor.fingerprint,
                signing_key=signing_key,
                deployment=registry.keys.deployment,
                unbound_ok=vouched.get(version) == sha,
            )
        except (RegistryError, CheckpointError) as exc:
            on_skipped(version)
            log.error("cannot resume %s from v%d (%s); trying older", registry.probe, version, exc)
            continue
        return version, probe, manifest
    return None


def packaged_default(
    settings: Settings, extractor: HiddenStateExtractor, name: str
) -> PackagedDefault | None:
    """The packaged default to fine-tune from (with ``DEFAULT_PROBE`` on and no seed
    spec asked for): what scorers already serve while nothing is published."""
    if not settings.default_probe or settings.seed_spec is not None:
        return None
    return serving_default(extractor.fingerprint, name, settings.default_flag_budget)


def seed_spec(settings: Settings, extractor: HiddenStateExtractor, name: str) -> ProbeSpec:
    """The spec of a probe started from zero: ``seed_spec`` when set, else the default."""
    if settings.seed_spec is None:
        return default_spec(name, extractor.num_layers, extractor.hidden_size)
    try:
        spec = ProbeSpec.model_validate_json(Path(settings.seed_spec).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read seed spec {settings.seed_spec}: {exc}") from exc
    if spec.name != name or spec.hidden_size != extractor.hidden_size:
        raise ConfigError(
            f"seed spec is {spec.name!r} for hidden size {spec.hidden_size}; this updater "
            f"trains {name!r} on a model of hidden size {extractor.hidden_size}"
        )
    return spec


def restore_optimizer(registry: CheckpointRegistry, learner: OnlineLearner, version: int) -> None:
    """Lion's momentum published with ``version``, when the registry vouches for it; for a
    version published without one (an operator's ``add-head``), its parent's, moved to this
    version's labels (a new head's rows start at zero momentum). Else learning restarts it
    at zero (see :meth:`~worker.store.checkpoints.CheckpointRegistry.load_optimizer_state`)."""
    source = version
    try:
        manifest = registry.manifest(version)
        labels = manifest.spec.labels
        state = registry.load_optimizer_state(version)
        if state is None and manifest.parent is not None:
            source = manifest.parent
            state = registry.load_optimizer_state(source)
            if state is not None:
                labels = registry.manifest(source).spec.labels
    except RegistryError as exc:
        log.error("Lion state of v%d refused (%s); starting it afresh", source, exc)
        return
    if state is None:
        return
    used = learner.load_optimizer_state(state, labels)
    log.info("restored Lion state of v%d (%d tensors) for v%d", source, used, version)


def published_by_another(
    registry: CheckpointRegistry, published: list[int], parent: int | None
) -> int | None:
    """The newest version when someone else built it on this tenure's lineage (an
    operator's ``add-head`` on the version this tenure continues from or published), so
    the tenure must continue from it; None otherwise, or when Redis cannot say (the next
    publish or check finds out). A version from outside the lineage (another writer's
    seed) does not interrupt the tenure: its next publish supersedes it as before."""
    try:
        latest = registry.latest()
        if latest is None or latest in published or latest <= (parent or 0):
            return None
        base = registry.manifest(latest).parent
    except (RegistryError, redis.RedisError, OSError):
        return None
    lineage = set(published) | ({parent} if parent is not None else set())
    return latest if base is not None and base in lineage else None
