"""Build and publish small probes for tests."""

from __future__ import annotations

from probes.checkpoint import WeightFormat, checkpoint_to_bytes
from probes.probe import Probe, build_probe
from schemas import LLMFingerprint
from worker.llm.tiny import toxicity_spec
from worker.store.checkpoints import CheckpointRegistry

__all__ = ["num", "publish_probe", "toxicity_spec"]


def publish_probe(
    registry: CheckpointRegistry,
    fingerprint: LLMFingerprint,
    *,
    seed: int = 0,
    set_live: bool = True,
    probe: Probe | None = None,
    signing_key: bytes | None = None,
    weights: WeightFormat = "fp32",
) -> int:
    """Publish a (random unless given) probe as the next version; returns the version."""
    probe = probe or build_probe(
        toxicity_spec(fingerprint.hidden_size, name=registry.probe), seed=seed
    )
    version = registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(
        probe,
        llm=fingerprint,
        version=version,
        signing_key=signing_key,
        weights=weights,
        deployment=registry.keys.deployment,
    )
    registry.publish(blob, manifest, set_live=set_live)
    return version


def num(value: object) -> float:
    """A number from an event's or decision's ``details`` (typed there as any JSON scalar)."""
    assert isinstance(value, int | float) and not isinstance(value, bool), value
    return float(value)
