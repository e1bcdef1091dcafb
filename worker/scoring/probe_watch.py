"""Hot swap: keep every served probe in step with the Redis registry.

Two ways to follow the registry (``Settings.probe_watch``):

- ``thread`` (the default): :meth:`ProbeWatcher.start` runs a watcher thread that blocks
  on the probes' event streams (``XREAD BLOCK``), so it learns of a publish or a stage
  change within a round trip, and also re-reads the stage pointers every
  ``check_interval_s``. It loads and verifies new versions itself, off the scoring
  thread, which never waits on Redis for a swap.
- ``poll``: :meth:`ProbeWatcher.refresh` is called between batches and reads the event
  streams without blocking (one round trip); a change is picked up between batches.

Either way what is served is an immutable snapshot (:attr:`ProbeWatcher.slots`, a new
mapping of new :class:`ProbeSlot` objects per change, swapped in by one reference
assignment): a batch takes the snapshot once when it starts and is scored by it
throughout, so no batch mixes versions, and the batch after a swap uses the new one.

A version is served only after its sha256, optional HMAC signature and LLM fingerprint
verify; anything wrong is refused, counted and remembered, and the last good live probe
stays (a refused canary is simply not served). With a signing key the stage pointers
themselves must verify (see :mod:`worker.store.checkpoints`): pointers that do not,
or that are older than ones already seen, change nothing. The checkpoint loaded must be
the one the verified pointers bind (its tensors' sha256; loading is a second read, and a
Redis writer could swap the checkpoint in between), and its own signature must be bound
to this deployment (an unbound one, published before binding existed, is accepted since
the pointers, which are bound, name its sha256).
If Redis is unreachable the scorer keeps scoring with what it has; the watcher backs off
(``Breaker``: 5 s, doubling up to 60 s) and reconnects by itself. Any other failure while
following one probe (an unreadable record, out of device memory while loading) costs only
that probe: it keeps what it serves, the others are followed, and it is tried again at the
next stage check.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
import torch

from probes.checkpoint import probe_from_bytes
from probes.errors import CheckpointError
from schemas import LLMFingerprint
from worker.errors import RegistryError, UnknownVersion
from worker.scoring.served import ProbeSlot, ServedProbe
from worker.store.checkpoints import CheckpointRegistry, Stages
from worker.store.redis import Breaker

__all__ = ["ProbeWatcher"]

log = logging.getLogger(__name__)


class ProbeWatcher:
    """Owns what every probe a scorer serves: :attr:`slots`, one :class:`ProbeSlot` each."""

    def __init__(
        self,
        registries: dict[str, CheckpointRegistry],
        fingerprint: LLMFingerprint,
        *,
        device: torch.device | str = "cpu",
        signing_key: bytes | None = None,
        check_interval_s: float = 5.0,
        block_ms: int = 1000,
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
        # The watcher thread's longest XREAD BLOCK: below the Redis socket timeout, and how
        # long stop() may wait for the thread.
        self.block_ms = max(1, block_ms)
        self.on_swap = on_swap
        self.on_refused = on_refused
        self.on_loaded = on_loaded
        self.on_untrusted = on_untrusted
        # Signed stage pointers: the newest seq seen per probe, and the last record ignored.
        self.stage_seq: dict[str, int] = {}
        self.untrusted: dict[str, Stages] = {}
        # Per probe, the tensor sha256 the last trusted pointers bind to each version.
        self.bound_shas: dict[str, dict[int, str]] = {}
        self.breaker = breaker or Breaker()
        # The working slots (changed only under _lock) and the snapshot served from them.
        self._work = {name: ProbeSlot(name) for name in registries}
        self._served: Mapping[str, ProbeSlot] = self._snapshot()
        self.refused: dict[str, set[int]] = {name: set() for name in registries}
        self.failing: dict[str, str] = {}  # probe -> why its last sync failed unexpectedly
        self._cursors: dict[str, str] = {}
        self._next_check = 0.0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.redis_ok = True
        self.swaps = 0  # snapshots published
        self._after: list[Callable[[], None]] = []  # callbacks due once a sync is over

    # --- the public calls --------------------------------------------------

    @property
    def slots(self) -> Mapping[str, ProbeSlot]:
        """What is served now: an immutable snapshot, replaced (never changed) on a swap."""
        return self._served

    def serve_bootstrap(self, name: str, served: ServedProbe) -> None:
        """Serve a checkpoint file until the registry has a live version."""
        with self._lock:
            slot = self._work[name]
            if slot.live is None:
                slot.live = ServedProbe(served.probe.to(self.device), served.manifest)
                self._publish()
                self._announce(name, "live", served.version)

    def refresh(self, *, force: bool = False) -> bool:
        """Catch up with the registry now, without blocking on the event streams (the
        ``poll`` way, called between batches); True when anything served changed."""
        with self._lock:
            return self._catch_up(force=force, block_ms=None)

    def start(self) -> None:
        """Follow the registry from a watcher thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="probe-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the watcher thread (it leaves within one ``block_ms``) and wait for it."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(timeout_s if timeout_s is not None else self.block_ms / 1000 + 30)
            if thread.is_alive():
                log.warning("the probe watcher thread did not stop in time")

    def synced(self) -> bool:
        """Whether the registry has been read at least once (so a slot without a live
        version really has none published)."""
        return bool(self._cursors)

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def versions(self) -> dict[str, dict[str, int | None]]:
        return {
            n: {
                "live": s.live.version if s.live else None,
                "canary": s.canary.version if s.canary else None,
            }
            for n, s in self.slots.items()
        }

    # --- internals ---------------------------------------------------------

    def _watch(self) -> None:
        log.info("following the probe registry from a watcher thread")
        while not self._stop.is_set():
            try:
                if not self.breaker.ready():
                    self._stop.wait(0.2)  # Redis failed a moment ago: back off, then retry
                    continue
                if self._cursors and time.monotonic() < self._next_check:
                    # Block on the event streams outside the lock (bootstrap serving and
                    # refresh() take it), until an event or the next stage check is due.
                    wait = self._next_check - time.monotonic()
                    block = max(1, min(self.block_ms, int(wait * 1000)))
                    try:
                        if not self._events_pending(block):
                            continue
                    except (redis.RedisError, OSError) as exc:
                        self._redis_failed(exc)
                        continue
                with self._lock:
                    self._catch_up(force=True, block_ms=None)
            except Exception:  # never die silently: the scorer would serve stale probes
                log.exception("probe watcher failed; retrying in 1 s")
                self._stop.wait(1.0)

    def _catch_up(self, *, force: bool, block_ms: int | None) -> bool:
        """Sync when forced, on first contact, when the stage check is due or on an event
        (waiting up to ``block_ms`` for one; None: not at all). Redis errors trip the
        breaker and change nothing."""
        now = time.monotonic()
        if not self.breaker.ready():
            return False  # Redis failed a moment ago: serve what we have, do not wait on it
        try:
            due = force or not self._cursors or now >= self._next_check
            if not due and not self._events_pending(block_ms):
                return False
            if not self._cursors:  # first contact: remember where the streams are
                self._cursors = {n: r.last_event_id() for n, r in self.registries.items()}
            changed = False
            try:
                for name, registry in self.registries.items():
                    changed |= self._sync_one(name, registry)
                if changed:
                    self._publish()
            finally:
                after, self._after = self._after, []
                for call in after:
                    call()
            self._next_check = time.monotonic() + self.check_interval_s
            if not self.redis_ok:
                log.info("Redis reachable again; probe registry in sync")
            self.redis_ok = True
            self.breaker.reset()
            return changed
        except (redis.RedisError, OSError) as exc:
            self._redis_failed(exc)
            return False

    def _redis_failed(self, exc: BaseException) -> None:
        if self.redis_ok:
            log.warning("Redis unreachable (%s); serving the last good probes", exc)
        self.redis_ok = False
        self.breaker.trip(exc)
        self._next_check = time.monotonic() + self.check_interval_s

    def _snapshot(self) -> dict[str, ProbeSlot]:
        return {name: dataclasses.replace(slot) for name, slot in self._work.items()}

    def _publish(self) -> None:
        # One reference assignment: a batch sees the old mapping or the new one, whole.
        self._served = self._snapshot()
        self.swaps += 1

    def _events_pending(self, block_ms: int | None) -> bool:
        if not self._cursors:
            return True
        client: Any = next(iter(self.registries.values())).client
        streams = {r.keys.events(r.probe): self._cursors[n] for n, r in self.registries.items()}
        reply = client.xread(streams, count=100, block=block_ms)
        if not reply:
            return False
        by_key = {r.keys.events(r.probe): n for n, r in self.registries.items()}
        for stream, entries in reply:
            key = stream.decode() if isinstance(stream, bytes) else stream
            self._cursors[by_key[key]] = entries[-1][0].decode()
        return True

    def _sync_one(self, name: str, registry: CheckpointRegistry) -> bool:
        """:meth:`_sync` for one probe; an unexpected error costs only that probe (it keeps
        what it serves and is tried again at the next stage check), never the probes after
        it nor, in ``poll`` mode, the scorer. Redis errors still end the whole sync: Redis
        is shared, and the breaker backs off for every probe."""
        try:
            changed = self._sync(name, registry)
        except (redis.RedisError, OSError):
            raise
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            if self.failing.get(name) != why:  # log each new failure once, with its trace
                log.exception("syncing %s failed; it keeps what it serves", name)
            self.failing[name] = why
            # What it changed before failing (a live swapped in, then the canary failed)
            # is served: the next check sees it as current and would not publish it.
            return self._work[name] != self._served[name]
        if self.failing.pop(name, None) is not None:
            log.info("syncing %s works again", name)
        return changed

    def _sync(self, name: str, registry: CheckpointRegistry) -> bool:
        stages = registry.stages()
        if not self._trusted(name, registry, stages):
            return False
        slot = self._work[name]
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
                # Told after the swap: logging and Redis writes stay off its critical path.
                self._after.append(functools.partial(self._announce, name, stage, wanted))
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
        shas = registry.verified_shas(stages)
        if shas is None:
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
        self.bound_shas[name] = shas or {}
        return True

    def _load(self, name: str, registry: CheckpointRegistry, version: int) -> ServedProbe | None:
        if version in self.refused[name]:
            return None
        bound = self.bound_shas.get(name, {}).get(version)
        try:
            stored = registry.get(version)
            if self.signing_key is not None and stored.manifest.tensors_sha256 != bound:
                # Swapped since the pointers were verified: not this version's verdict
                # (not remembered), the next stage check reads both again.
                log.error(
                    "refusing %s v%d: its tensors are not the ones the signed stage pointers "
                    "name (swapped in Redis?); keeping the last good probe", name, version
                )  # fmt: skip
                if self.on_untrusted is not None:
                    self.on_untrusted(name, f"v{version} differs from the signed pointers")
                return None
            probe, manifest = probe_from_bytes(
                stored.blob,
                stored.manifest_json,
                self.fingerprint,
                signing_key=self.signing_key,
                deployment=registry.keys.deployment,
                unbound_ok=True,  # the pointers, bound to this deployment, name its sha
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
            self._after.append(functools.partial(self.on_loaded, name, version))
        return ServedProbe(probe.to(self.device), manifest)

    def _announce(self, name: str, stage: str, version: int) -> None:
        log.info("serving %s v%d as %s", name, version, stage)
        if self.on_swap is not None:
            self.on_swap(name, stage, version)
