"""Hot swap: keep every served probe in step with the Redis registry.

Called between batches (never during one). Each call reads the probes' event
streams without blocking (one round trip); an event, or the periodic stage
check every ``check_interval_s``, triggers a re-read of the stage pointers
and loading of any new live/canary version. A version is served only after
its sha256, optional HMAC signature and LLM fingerprint verify; anything
wrong is refused, counted and remembered, and the last good live probe stays
(a refused canary is simply not served). With a signing key the stage pointers
themselves must verify (see :mod:`worker.store.checkpoints`): pointers that do not,
or that are older than ones already seen, change nothing.
If Redis is unreachable the scorer keeps scoring with what it has and
retries after ``check_interval_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
import torch

from probes.checkpoint import probe_from_bytes
from probes.errors import CheckpointError
from schemas import LLMFingerprint
from worker.errors import RegistryError, UnknownVersion
from worker.scoring.batch import ProbeSlot, ServedProbe
from worker.store.checkpoints import CheckpointRegistry, Stages
from worker.store.redis import Breaker

__all__ = ["ProbeWatcher"]

log = logging.getLogger(__name__)


class ProbeWatcher:
    """Owns the :class:`ProbeSlot` of every probe a scorer serves."""

    def __init__(
        self,
        registries: dict[str, CheckpointRegistry],
        fingerprint: LLMFingerprint,
        *,
        device: torch.device | str = "cpu",
        signing_key: bytes | None = None,
        check_interval_s: float = 5.0,
        on_swap: Callable[[str, str, int], None] | None = None,
        on_refused: Callable[[str, int, str], None] | None = None,
        on_loaded: Callable[[str, int], None] | None = None,
        on_untrusted: Callable[[str, str], None] | None = None,
        breaker: Breaker | None = None,
    ) -> None:
        self.registries = registries
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self.signing_key = signing_key
        self.check_interval_s = check_interval_s
        self.on_swap = on_swap
        self.on_refused = on_refused
        self.on_loaded = on_loaded
        self.on_untrusted = on_untrusted
        # Signed stage pointers: the newest seq seen per probe, and the last record ignored.
        self.stage_seq: dict[str, int] = {}
        self.untrusted: dict[str, Stages] = {}
        self.breaker = breaker or Breaker()
        self.slots = {name: ProbeSlot(name) for name in registries}
        self.refused: dict[str, set[int]] = {name: set() for name in registries}
        self._cursors: dict[str, str] = {}
        self._next_check = 0.0
        self.redis_ok = True

    # --- the public calls --------------------------------------------------

    def serve_bootstrap(self, name: str, served: ServedProbe) -> None:
        """Serve a checkpoint file until the registry has a live version."""
        slot = self.slots[name]
        if slot.live is None:
            slot.live = ServedProbe(served.probe.to(self.device), served.manifest)
            self._announce(name, "live", served.version)

    def refresh(self, *, force: bool = False) -> bool:
        """Catch up with the registry; True when anything served changed."""
        now = time.monotonic()
        if not self.breaker.ready():
            return False  # Redis failed a moment ago: serve what we have, do not wait on it
        try:
            if not force and not self._events_pending() and now < self._next_check:
                return False
            if not self._cursors:  # first contact: remember where the streams are
                self._cursors = {n: r.last_event_id() for n, r in self.registries.items()}
            changed = False
            for name, registry in self.registries.items():
                changed |= self._sync(name, registry)
            self._next_check = now + self.check_interval_s
            if not self.redis_ok:
                log.info("Redis reachable again; probe registry in sync")
            self.redis_ok = True
            self.breaker.reset()
            return changed
        except (redis.RedisError, OSError) as exc:
            if self.redis_ok:
                log.warning("Redis unreachable (%s); serving the last good probes", exc)
            self.redis_ok = False
            self.breaker.trip()
            self._next_check = now + self.check_interval_s
            return False

    def versions(self) -> dict[str, dict[str, int | None]]:
        return {
            n: {
                "live": s.live.version if s.live else None,
                "canary": s.canary.version if s.canary else None,
            }
            for n, s in self.slots.items()
        }

    # --- internals ---------------------------------------------------------

    def _events_pending(self) -> bool:
        if not self._cursors:
            return True
        client: Any = next(iter(self.registries.values())).client
        streams = {r.keys.events(r.probe): self._cursors[n] for n, r in self.registries.items()}
        reply = client.xread(streams, count=100)
        if not reply:
            return False
        by_key = {r.keys.events(r.probe): n for n, r in self.registries.items()}
        for stream, entries in reply:
            name = by_key[stream.decode()]
            self._cursors[name] = entries[-1][0].decode()
        return True

    def _sync(self, name: str, registry: CheckpointRegistry) -> bool:
        stages = registry.stages()
        if not self._trusted(name, registry, stages):
            return False
        slot = self.slots[name]
        changed = False
        for stage, wanted in (("live", stages.live), ("canary", stages.canary)):
            current: ServedProbe | None = getattr(slot, stage)
            if wanted is None:
                if stage == "canary" and current is not None:
                    slot.canary = None
                    changed = True
                continue  # no live version published: keep serving the bootstrap, if any
            if current is not None and current.version == wanted:
                continue
            loaded = self._load(name, registry, wanted)
            if loaded is not None:
                setattr(slot, stage, loaded)
                self._announce(name, stage, wanted)
                changed = True
            elif stage == "canary" and current is not None:
                # The wanted canary cannot be served: serve none rather than an older one
                # (only the live stage keeps its last good probe).
                log.warning("%s: no canary served (v%d refused)", name, wanted)
                slot.canary = None
                changed = True
        if slot.canary_share != stages.canary_share:
            slot.canary_share = stages.canary_share
            changed = True
        return changed

    def _trusted(self, name: str, registry: CheckpointRegistry, stages: Stages) -> bool:
        """With a signing key: the pointers verify and are not older than any seen (a
        replayed record). Otherwise nothing changes and the last good probes stay."""
        if self.signing_key is None:
            return True
        seen = self.stage_seq.get(name, 0)
        why = None
        if not registry.stages_verify(stages):
            why = "their signature does not verify"
        elif stages.seq < seen:
            why = f"seq {stages.seq} is older than {seen} (a replayed record)"
        if why is not None:
            if self.untrusted.get(name) != stages:  # count and log each record once
                log.error("ignoring the %s stage pointers: %s", name, why)
                if self.on_untrusted is not None:
                    self.on_untrusted(name, why)
            self.untrusted[name] = stages
            return False
        self.untrusted.pop(name, None)
        self.stage_seq[name] = stages.seq
        return True

    def _load(self, name: str, registry: CheckpointRegistry, version: int) -> ServedProbe | None:
        if version in self.refused[name]:
            return None
        try:
            stored = registry.get(version)
            probe, manifest = probe_from_bytes(
                stored.blob, stored.manifest_json, self.fingerprint, signing_key=self.signing_key
            )
        except UnknownVersion as exc:
            # Gone (pruned, or not yet visible): not a verdict on the version; the next
            # stage check looks again.
            log.warning("cannot load %s v%d: %s", name, version, exc)
            return None
        except (RegistryError, CheckpointError) as exc:
            self.refused[name].add(version)
            log.error("refusing %s v%d: %s (keeping the last good probe)", name, version, exc)
            if self.on_refused is not None:
                self.on_refused(name, version, str(exc))
            return None
        if manifest.probe != name:
            self.refused[name].add(version)
            log.error("refusing %s v%d: it is a checkpoint of %r", name, version, manifest.probe)
            return None
        if self.on_loaded is not None:
            self.on_loaded(name, version)
        return ServedProbe(probe.to(self.device), manifest)

    def _announce(self, name: str, stage: str, version: int) -> None:
        log.info("serving %s v%d as %s", name, version, stage)
        if self.on_swap is not None:
            self.on_swap(name, stage, version)
