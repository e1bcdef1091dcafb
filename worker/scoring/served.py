"""What one probe name serves: its live and canary versions, and the sticky canary split.

The probe watcher (:mod:`worker.scoring.probe_watch`) fills these slots; the batch scorer
(:mod:`worker.scoring.batch`) reads a snapshot of them per batch; review routing and the
tests share :func:`sticky_fraction`, which decides a conversation's side of the split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from probes.probe import Probe
from schemas import CheckpointManifest

__all__ = ["ProbeSlot", "ServedProbe", "sticky_fraction"]


def sticky_fraction(key: str, salt: str = "") -> float:
    """A stable number in [0, 1) for ``key``: the same key always lands on the same side."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class ServedProbe:
    """A verified probe and the manifest it came with."""

    probe: Probe
    manifest: CheckpointManifest

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass
class ProbeSlot:
    """What one probe name serves right now."""

    name: str
    live: ServedProbe | None = None
    canary: ServedProbe | None = None
    canary_share: float = 0.0

    def layers(self) -> set[int]:
        return {layer for p in (self.live, self.canary) if p for layer in p.probe.layers}
