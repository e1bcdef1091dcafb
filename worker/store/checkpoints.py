"""The checkpoint registry in Redis: versions, blobs, manifests, stages, events.

The keys it reads and writes are listed in :class:`worker.store.redis.Keys`.

Stage changes are one Lua script too: pointers, marks and the event together, and
optionally only if the pointers still hold the values the caller read
(compare-and-set), so the updater's policy and an operator cannot overwrite
each other's change unseen. The live versions' history (for rollback) is
derived from the event stream (:func:`live_lineage`).

Publishing is one Lua script: blob, manifest, the version marker and the
event are written together or not at all, and only by the current lease
holder when a fencing token is given. Publishing and stage changes each carry a
request id, so redis-py re-sending one whose reply was lost (a socket timeout after
the script ran) gets the first run's answer rather than "already published" or
"stages changed" (see :mod:`worker.store.scripts`). Readers see a version only once both
blob and manifest exist. Integrity (sha256 of the blob against the
manifest) is checked on every read.

With a signing key, the stage pointers (:mod:`worker.store.stages`) and the Lion
optimizer state published beside each version (:mod:`worker.store.optimizer_state`) are
signed by one scheme, :meth:`CheckpointRegistry.mac`. The scripts are in
:mod:`worker.store.scripts`, the reads in :mod:`worker.store.reading`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import redis
import torch

from probes.checkpoint import verify_signature
from probes.errors import CheckpointError
from schemas import CheckpointEvent, CheckpointManifest, EventKind, utcnow
from worker.errors import Fenced, RegistryError, StagesChanged, UnknownVersion
from worker.store import optimizer_state, scripts
from worker.store.optimizer_state import OPTIM_MAGIC
from worker.store.reading import EVENTS_MAXLEN, CheckpointReader, StoredCheckpoint
from worker.store.redis import Keys
from worker.store.stages import Stages, check_expected, live_lineage, next_stages
from worker.store.stages import field as _field

__all__ = ["OPTIM_MAGIC", "CheckpointRegistry", "Stages", "StoredCheckpoint", "live_lineage"]

LIVE_HISTORY_MAX = 100  # live versions remembered for rollback (newest first)
PROTECTED_LIVES = 3  # retention keeps the live version and the two lives before it


class CheckpointRegistry(CheckpointReader):
    """Versioned checkpoints of one probe: the reads of :class:`CheckpointReader` and the
    writes (publish, stage changes, prune, optimizer state)."""

    def __init__(
        self, client: redis.Redis, keys: Keys, probe: str, *, signing_key: bytes | None = None
    ) -> None:
        super().__init__(client, keys, probe, signing_key=signing_key)
        self._publish = client.register_script(scripts.PUBLISH)
        self._set_stages = client.register_script(scripts.SET_STAGES)
        self._prune = client.register_script(scripts.PRUNE)
        self._next_seq_script = client.register_script(scripts.NEXT_SEQ)

    @property
    def lease_key(self) -> str:
        return self.keys.updater_lease(self.probe)

    # --- writing ---------------------------------------------------------

    def allocate_version(self) -> int:
        """A fresh version number (never reused, even if it is never published)."""
        return int(self.client.incr(self.keys.next_version(self.probe)))

    def publish(
        self,
        blob: bytes,
        manifest_json: bytes,
        *,
        token: str | None = None,
        set_live: bool = False,
        actor: str = "",
        reason: str = "",
    ) -> CheckpointManifest:
        """Store a checkpoint whose manifest carries an allocated version; atomic and fenced.

        ``set_live`` makes it live in the same step, unless the probe is pinned (then the
        event says so and the live version stays).
        """
        manifest = self._parse(manifest_json, blob, where="publish")
        if manifest.probe != self.probe:
            raise RegistryError(f"manifest is for probe {manifest.probe!r}, not {self.probe!r}")
        v = manifest.version
        previous = self.stages().live if set_live else None
        event = self._event(
            "published",
            v,
            previous=previous,
            reason=reason,
            actor=actor,
            details={"parent": manifest.parent, "live": set_live},
        )
        held = self._event(  # recorded instead when the probe is pinned
            "published",
            v,
            reason=f"{reason}; not made live: the probe is pinned".lstrip("; "),
            actor=actor,
            details={"parent": manifest.parent, "live": False},
        )
        for _attempt in range(5):  # a concurrent signed stage change: sign again
            try:
                return self._publish_once(
                    blob, manifest_json, manifest, event, held, token, set_live
                )
            except StagesChanged:
                continue
        raise RegistryError(f"publish of {self.probe} v{v}: the stages kept changing")

    def _publish_once(
        self,
        blob: bytes,
        manifest_json: bytes,
        manifest: CheckpointManifest,
        event: str,
        held: str,
        token: str | None,
        set_live: bool,
    ) -> CheckpointManifest:
        v = manifest.version
        seq, sig, new_seq = "", "", ""
        if set_live and self.signing_key is not None:
            self._check_signed(manifest, blob)  # never sign a pointer to a forgery
            cur = self._verified_stages()
            nxt = Stages(
                live=v, canary=cur.canary, canary_share=cur.canary_share, seq=self._next_seq()
            )
            seq, new_seq = str(cur.seq), str(nxt.seq)
            sig = self.stage_signature(nxt, {v: manifest.tensors_sha256})
        try:
            self._publish(
                keys=[
                    self.keys.versions(self.probe),
                    self.keys.ckpt(self.probe, v),
                    self.keys.manifest(self.probe, v),
                    self.keys.events(self.probe),
                    self.keys.stages(self.probe),
                    self.lease_key,
                    self.keys.live_history(self.probe),
                    self.keys.once(uuid.uuid4().hex),
                ],
                args=[
                    v,
                    blob,
                    manifest_json,
                    event,
                    token or "",
                    int(set_live),
                    EVENTS_MAXLEN,
                    held,
                    LIVE_HISTORY_MAX,
                    seq,
                    sig,
                    new_seq,
                    scripts.ONCE_TTL_S,
                ],
            )
        except redis.ResponseError as exc:
            msg = str(exc)
            if msg.startswith("FENCED"):
                raise Fenced(f"publish of {self.probe} v{v} refused: {msg[7:]}") from None
            if msg.startswith("CHANGED"):
                raise StagesChanged(f"{self.probe} stages changed meanwhile: {msg[8:]}") from None
            raise RegistryError(f"publish of {self.probe} v{v} refused: {msg}") from None
        return manifest

    def set_stages(
        self,
        kind: EventKind,
        *,
        set_fields: dict[str, Any] | None = None,
        delete: list[str] | tuple[str, ...] = (),
        version: int | None = None,
        previous: int | None = None,
        reason: str = "",
        actor: str = "",
        details: dict[str, Any] | None = None,
        expect: dict[str, int | str | None] | None = None,
        mark_rolled_back: dict[int, str] | None = None,
        mark_tried: tuple[int, ...] | list[int] = (),
        reset: tuple[str, ...] | list[str] = (),
        resign: bool = False,
    ) -> None:
        """Change stage pointers, marks and record the event, atomically.

        ``version`` (when given) must be published, else :class:`UnknownVersion`.
        ``expect`` maps stage fields to the values the caller read (``None`` = unset);
        if any differs now, nothing changes and :class:`StagesChanged` is raised.
        ``mark_rolled_back`` adds versions (with a reason) to the rolled-back hash,
        ``mark_tried`` to the tried set; ``reset`` names keys to delete in the same step.
        With a signing key the result is signed (see the module docstring); ``resign``
        accepts current pointers that do not verify, dropping any canary.
        """
        event = self._event(
            kind, version, previous=previous, reason=reason, actor=actor, details=details or {}
        )
        set_fields = dict(set_fields or {})
        delete = list(delete)
        expected = {k: "" if v is None else _field(v) for k, v in (expect or {}).items()}
        if self.signing_key is not None:
            self._sign_change(set_fields, delete, expected, resign=resign)
        sets = {k: _field(v) for k, v in set_fields.items()}
        try:
            self._set_stages(
                keys=[
                    self.keys.versions(self.probe),
                    self.keys.stages(self.probe),
                    self.keys.events(self.probe),
                    self.keys.rolled_back(self.probe),
                    self.keys.tried(self.probe),
                    self.keys.live_history(self.probe),
                    self.keys.once(uuid.uuid4().hex),
                    *reset,
                ],
                args=[
                    json.dumps(sets),
                    json.dumps(list(delete)),
                    "" if version is None else version,
                    event,
                    EVENTS_MAXLEN,
                    json.dumps(expected),
                    json.dumps({str(v): why for v, why in (mark_rolled_back or {}).items()}),
                    json.dumps([int(v) for v in mark_tried]),
                    LIVE_HISTORY_MAX,
                    scripts.ONCE_TTL_S,
                ],
            )
        except redis.ResponseError as exc:
            msg = str(exc)
            if msg.startswith("UNKNOWN"):
                raise UnknownVersion(f"{self.probe} has no published version {version}") from None
            if msg.startswith("CHANGED"):
                raise StagesChanged(f"{self.probe} stages changed meanwhile: {msg[8:]}") from None
            raise RegistryError(msg) from None

    def promote(
        self,
        version: int,
        *,
        reason: str = "",
        actor: str = "",
        details: dict[str, Any] | None = None,
        expect: Stages | None = None,
        resign: bool = False,
    ) -> None:
        """Make ``version`` live; it stops being the canary if it was one.

        With ``expect`` (stages as the caller read them) this is a compare-and-set.
        """
        st = expect or self.stages()
        delete = ["canary", "canary_share"] if st.canary == version else []
        self.set_stages(
            "promoted",
            set_fields={"live": version},
            delete=delete,
            version=version,
            previous=st.live,
            reason=reason,
            actor=actor,
            details=details,
            expect=st.expected() if expect is not None else None,
            mark_tried=[version],
            resign=resign,
        )

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` versions; returns the versions deleted.

        Never the live or canary one, nor the two lives before the live one (rollback
        targets, from ``live_history``), however many events have passed since. One
        Lua script, so a concurrent stage change (e.g. an operator promoting an old
        version) is either seen by it or refused as ``UnknownVersion`` afterwards.
        Evidence and optimizer state of deleted versions go with them, and the
        rolled-back and tried marks of every version no longer retained.
        """
        versions = self.versions()
        old = versions[:-keep] if keep > 0 else []
        if not old:
            return []
        per = len(self.keys.per_version(self.probe, old[0]))
        keys = [k for v in old for k in self.keys.per_version(self.probe, v)]
        doomed = self._prune(
            keys=[
                self.keys.versions(self.probe),
                self.keys.stages(self.probe),
                self.keys.live_history(self.probe),
                self.keys.rolled_back(self.probe),
                self.keys.tried(self.probe),
                *keys,
            ],
            args=[PROTECTED_LIVES, per, json.dumps(old)],
        )
        return [int(v) for v in doomed]

    # --- optimizer state ---------------------------------------------------

    def save_optimizer_state(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Store the optimizer state published with ``version`` (safetensors, no pickle),
        signed when a signing key is set. Nothing is stored for an empty state."""
        if not state:
            return
        blob = optimizer_state.encode(state, self._optimizer_mac(version))
        self.client.set(self.keys.optim(self.probe, version), blob)

    def load_optimizer_state(self, version: int) -> dict[str, torch.Tensor] | None:
        """The optimizer state published with ``version``; None when there is none.

        Raises :class:`RegistryError` (the caller starts the state afresh) when it is
        unsigned or forged while a signing key is set, sealed by the old scheme
        (``PGOPT1``), unreadable, or holds NaN or inf.
        """
        raw = self.client.get(self.keys.optim(self.probe, version))
        if raw is None:
            return None
        where = f"{self.probe} v{version} optimizer state"
        return optimizer_state.decode(raw, self._optimizer_mac(version), where)

    def _optimizer_mac(self, version: int) -> Callable[[bytes], str] | None:
        if self.signing_key is None:
            return None
        prefix, probe = self.keys.deployment, self.probe
        return lambda blob: self.mac(optimizer_state.state_record(prefix, probe, version, blob))

    def _verified_stages(self) -> Stages:
        st = self.stages()
        if not self.stages_verify(st):
            raise RegistryError(
                f"{self.probe}: the stage pointers do not verify with the signing key (written "
                "without it, or tampered); an operator with the key re-signs them with "
                "`probeguard probe promote VERSION --force`"
            )
        return st

    def _sign_change(
        self,
        sets: dict[str, Any],
        delete: list[str],
        expected: dict[str, str],
        *,
        resign: bool,
    ) -> None:
        """Add ``seq`` and ``sig`` for the stages this change produces; expect the ``seq``
        read, so the signature is over exactly what the script leaves behind."""
        cur = self.stages()
        if resign:
            if "canary" not in sets:
                delete.extend(k for k in ("canary", "canary_share") if k not in delete)
        elif not self.stages_verify(cur):
            self._verified_stages()  # raises with the explanation
        check_expected(self.probe, cur, expected)
        nxt = next_stages(cur, sets, delete, resign=resign, seq=self._next_seq())
        sets["seq"] = nxt.seq
        sets["sig"] = self.stage_signature(nxt, self._pointed_shas(cur, nxt, resign=resign))
        expected["seq"] = str(cur.seq) if cur.seq else ""  # signed writes start at 1

    def _pointed_shas(self, cur: Stages, nxt: Stages, *, resign: bool) -> dict[int, str]:
        """The sha256 of each version ``nxt`` points at, each checkpoint's own signature
        verified first (:meth:`get_verified`): an unbound one is accepted when the current
        signed pointers already name it, or with ``resign`` (the operator vouches for it).
        Signing the sha verified, not one read again, leaves no window to swap it."""
        vouched = {} if resign else (self.verified_shas(cur) or {})
        return {
            v: self.get_verified(v, vouched=vouched, unbound_ok=resign).manifest.tensors_sha256
            for v in (nxt.live, nxt.canary)
            if v is not None
        }

    def _check_signed(self, manifest: CheckpointManifest, blob: bytes) -> None:
        """A checkpoint about to go live as it is published must be signed for this
        deployment (:func:`probes.checkpoint.verify_signature`)."""
        assert self.signing_key is not None
        try:
            verify_signature(manifest, blob, self.signing_key, self.keys.deployment)
        except CheckpointError as exc:
            raise RegistryError(f"not publishing it live: {exc}") from None

    def _next_seq(self) -> int:
        """A seq above every one issued before (from a counter, so a replayed, older stage
        record does not set it back), and at least Redis's clock in milliseconds, so a
        counter set back by a failover or a restore still issues seqs above those scorers
        have seen (see ``scripts.NEXT_SEQ``)."""
        return int(self._next_seq_script(keys=[self.keys.stage_seq(self.probe)]))

    def _event(self, kind: EventKind, version: int | None, **fields: Any) -> str:
        return (
            CheckpointEvent(kind=kind, probe=self.probe, version=version, at=utcnow(), **fields)
            .encode()
            .decode()
        )
