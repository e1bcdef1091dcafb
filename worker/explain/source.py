"""Where ``probeguard explain`` (and the console's explanations) get the probe: a checkpoint
directory or a registry version, read as two blobs and verified as a scorer verifies them
(sha256, the LLM fingerprint, the signature with a key); and a scored message's cached text.

The explanation itself is :mod:`worker.explain.breakdown`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.checkpoint import MANIFEST_FILE, TENSORS_FILE, probe_from_bytes
from worker.errors import ExplainError

if TYPE_CHECKING:
    from probes.probe import Probe
    from schemas import CheckpointManifest
    from worker.llm.extract import HiddenStateExtractor
    from worker.store.checkpoints import CheckpointRegistry
    from worker.store.redis import Keys

__all__ = [
    "ProbeSource",
    "cached_text",
    "resolve_version",
    "source_from_checkpoint",
    "source_from_registry",
    "verify",
]


@dataclass(frozen=True)
class ProbeSource:
    """A checkpoint's two blobs, not yet verified, and where they came from."""

    blob: bytes
    manifest_json: bytes
    where: str  # "checkpoint PATH" or "registry live v3"
    deployment: str | None = None  # the registry's key prefix (its signatures are bound)


def source_from_checkpoint(path: Path) -> ProbeSource:
    """A checkpoint directory (``probeguard fit --out``), or a file inside one."""
    directory = path.parent if path.is_file() else path
    try:
        blob = (directory / TENSORS_FILE).read_bytes()
        manifest = (directory / MANIFEST_FILE).read_bytes()
    except OSError as exc:
        raise ExplainError(
            f"cannot read checkpoint {str(path)!r}: {exc.strerror or exc} (expected a "
            f"directory with {TENSORS_FILE} and {MANIFEST_FILE}, as `probeguard fit` writes)"
        ) from exc
    return ProbeSource(blob, manifest, f"checkpoint {directory}")


def source_from_registry(
    registry: CheckpointRegistry, stage: str, version: int | None
) -> ProbeSource:
    """``version``, else the version at ``stage`` (``live`` or ``canary``)."""
    version, where = resolve_version(registry, stage, version)
    stored = registry.get(version)  # UnknownVersion / integrity errors name the version
    return ProbeSource(stored.blob, stored.manifest_json, where, registry.keys.deployment)


def resolve_version(
    registry: CheckpointRegistry, stage: str, version: int | None
) -> tuple[int, str]:
    """``version``, else the version at ``stage``, and how to name it (``registry live v3``);
    nothing downloaded (a caller with the verified probe cached needs no blob)."""
    if version is None:
        stages = registry.stages()
        version = stages.live if stage == "live" else stages.canary
        if version is None:
            what = "live version" if stage == "live" else "canary on trial"
            raise ExplainError(
                f"probe {registry.probe!r} has no {what} in the registry (prefix "
                f"{registry.keys.prefix!r}); publish one with `probeguard train`, name one "
                "with --version, or explain a file with --checkpoint"
            )
        where = f"registry {stage} v{version}"
    else:
        where = f"registry v{version}"
    return version, where


def cached_text(client: Any, keys: Keys, message_id: str) -> str:
    """The text scorers cached for ``message_id`` (``{prefix}:text:{id}``)."""
    raw = client.get(keys.text(message_id))
    if raw is None:
        raise ExplainError(
            f"no cached text for message id {message_id!r} under {keys.text(message_id)!r} "
            "(never scored, or older than PROBEGUARD_TEXT_CACHE_TTL_S); pass the text instead"
        )
    return bytes(raw).decode("utf-8", errors="replace")


def verify(
    source: ProbeSource, extractor: HiddenStateExtractor, signing_key: bytes | None = None
) -> tuple[Probe, CheckpointManifest]:
    """The probe, verified as a scorer would: hash, LLM fingerprint and, with a key, the
    HMAC signature (raises ``probes.IncompatibleCheckpoint`` etc.): a registry version's
    bound to its deployment, or unbound (published before binding; shown, never served)."""
    probe, manifest = probe_from_bytes(
        source.blob,
        source.manifest_json,
        extractor.fingerprint,
        signing_key=signing_key,
        deployment=source.deployment,
        unbound_ok=True,
    )
    return probe.float().eval(), manifest
