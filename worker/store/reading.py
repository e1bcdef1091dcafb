"""Reading the checkpoint registry: versions, verified blobs and manifests, stage
pointers and their signatures, marks and the event stream.

Everything a scorer, the console or an operator's status needs, and nothing that writes:
:class:`worker.store.checkpoints.CheckpointRegistry` adds the writes on top. Integrity
(sha256 of the blob against the manifest) is checked on every read; stage pointers are
verified against the signing key (:mod:`worker.store.stages`) by the one HMAC scheme,
:meth:`CheckpointReader.mac`, that also seals the optimizer state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from probes.checkpoint import verify_signature
from probes.errors import CheckpointError
from schemas import CheckpointEvent, CheckpointManifest, describe_error
from worker.errors import RegistryError, UnknownVersion
from worker.store.redis import Keys
from worker.store.stages import Stages, live_lineage, stage_record

__all__ = ["EVENTS_MAXLEN", "CheckpointReader", "StoredCheckpoint"]

EVENTS_MAXLEN = 10_000


@dataclass(frozen=True)
class StoredCheckpoint:
    version: int
    blob: bytes  # safetensors
    manifest_json: bytes
    manifest: CheckpointManifest


class CheckpointReader:
    """The versioned checkpoints of one probe, read-only."""

    def __init__(
        self, client: redis.Redis, keys: Keys, probe: str, *, signing_key: bytes | None = None
    ) -> None:
        # redis-py's return types are unions over decode_responses; ours is always bytes.
        self.client: Any = client
        self.keys = keys
        self.probe = probe
        self.signing_key = signing_key

    def mac(self, record: list[Any]) -> str:
        """HMAC-SHA256 (hex) with the signing key over ``record`` as compact JSON: the one
        scheme for stage pointers and optimizer state (``record`` names its kind first, and
        binds the deployment's key prefix and the probe)."""
        if self.signing_key is None:
            raise RegistryError("no signing key configured")
        message = json.dumps(record, separators=(",", ":")).encode()
        return hmac.new(self.signing_key, message, hashlib.sha256).hexdigest()

    def stage_signature(self, st: Stages, shas: dict[int, str] | None = None) -> str:
        """HMAC of the pointers scorers act on, bound to this deployment's prefix, the
        probe, each pointed version's tensor sha256 (read from its manifest unless given)
        and ``st.seq``."""
        if self.signing_key is None:
            raise RegistryError("no signing key configured")  # before reading manifests
        shas = dict(shas or {})
        for v in (st.live, st.canary):
            if v is not None and v not in shas:
                shas[v] = self.manifest(v).tensors_sha256
        return self.mac(stage_record(self.keys.deployment, self.probe, st, shas))

    def stages_verify(self, st: Stages) -> bool:
        """Whether ``st`` carries a valid signature (always, without a key). Empty
        pointers need none: they point nowhere."""
        return self.verified_shas(st) is not None

    def verified_shas(self, st: Stages) -> dict[int, str] | None:
        """The tensor sha256 the signature of ``st`` binds to each pointed version, when it
        verifies; None when it does not. Without a key: ``{}`` (nothing is bound).

        A reader loads a pointed version by a second read, so it must compare what it
        loaded with these (a writer may swap the checkpoint between the two reads)."""
        if self.signing_key is None:
            return {}
        if st.live is None and st.canary is None and st.sig is None:
            return {}
        if st.sig is None:
            return None
        try:
            shas = {v: self.manifest(v).tensors_sha256 for v in (st.live, st.canary) if v}
        except UnknownVersion:
            return None
        if not hmac.compare_digest(st.sig, self.stage_signature(st, shas)):
            return None
        return shas

    def get_verified(
        self, version: int, *, vouched: dict[int, str] | None = None, unbound_ok: bool = False
    ) -> StoredCheckpoint:
        """:meth:`get`, and with a key the checkpoint's own signature, bound to this
        deployment (:func:`probes.checkpoint.verify_signature`); an unbound one only when
        ``vouched`` (verified stage pointers, :meth:`verified_shas`) names its sha256, or
        ``unbound_ok`` (an operator's ``--force``). Raises :class:`RegistryError` when it
        does not verify."""
        stored = self.get(version)
        if self.signing_key is not None:
            sha = stored.manifest.tensors_sha256
            try:
                verify_signature(
                    stored.manifest,
                    stored.blob,
                    self.signing_key,
                    self.keys.deployment,
                    unbound_ok=unbound_ok or (vouched or {}).get(version) == sha,
                )
            except CheckpointError as exc:
                raise RegistryError(str(exc)) from None
        return stored

    def versions(self) -> list[int]:
        return [int(v) for v in self.client.zrange(self.keys.versions(self.probe), 0, -1)]

    def latest(self) -> int | None:
        newest = self.client.zrange(self.keys.versions(self.probe), -1, -1)
        return int(newest[0]) if newest else None

    def stages(self) -> Stages:
        raw = {
            k.decode(): v.decode()
            for k, v in self.client.hgetall(self.keys.stages(self.probe)).items()
        }
        return Stages.from_hash(raw)

    def rolled_back(self) -> dict[int, str]:
        """Versions judged bad, with the reason; the policy never promotes one of them."""
        raw = self.client.hgetall(self.keys.rolled_back(self.probe))
        return {int(k): v.decode() for k, v in raw.items()}

    def tried(self) -> set[int]:
        """Versions that have been canaries (or live): the policy never starts them again."""
        return {int(v) for v in self.client.smembers(self.keys.tried(self.probe))}

    def lineage(self, count: int = EVENTS_MAXLEN) -> list[int]:
        """Versions that were live, oldest first, the current last; rolled-back lives left
        out (kept in ``live_history`` by the scripts that change ``live``; for a registry
        written before that list existed, derived from the events, :func:`live_lineage`)."""
        raw = self.client.lrange(self.keys.live_history(self.probe), 0, -1)
        if raw:
            return [int(v) for v in reversed(raw)]
        return live_lineage(e for _, e in self.history(count))

    def manifest(self, version: int) -> CheckpointManifest:
        raw = self.client.get(self.keys.manifest(self.probe, version))
        if raw is None:
            raise UnknownVersion(f"{self.probe} has no version {version}")
        return self._decode_manifest(raw, where=f"v{version}")

    def get(self, version: int) -> StoredCheckpoint:
        """Blob and manifest of ``version``, with the blob's sha256 verified."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.keys.ckpt(self.probe, version))
        pipe.get(self.keys.manifest(self.probe, version))
        blob, manifest_json = pipe.execute()
        if blob is None or manifest_json is None:
            raise UnknownVersion(f"{self.probe} has no version {version}")
        manifest = self._parse(manifest_json, blob, where=f"v{version}")
        if manifest.version != version:
            raise RegistryError(f"{self.probe} v{version}: manifest says v{manifest.version}")
        return StoredCheckpoint(version, blob, manifest_json, manifest)

    def events(
        self, after: str = "0-0", *, block_ms: int | None = None, count: int = 100
    ) -> list[tuple[str, CheckpointEvent]]:
        """Events after stream id ``after`` (``"$"`` = only new ones), oldest first.

        Unparseable entries are skipped: an event is a hint, stages are the truth.
        """
        reply = self.client.xread(
            {self.keys.events(self.probe): after}, count=count, block=block_ms
        )
        out: list[tuple[str, CheckpointEvent]] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                try:
                    out.append((entry_id.decode(), CheckpointEvent.decode(fields[b"event"])))
                except (KeyError, ValidationError):
                    continue
        return out

    def history(self, count: int = 50) -> list[tuple[str, CheckpointEvent]]:
        """The newest ``count`` events, oldest first."""
        entries = self.client.xrevrange(self.keys.events(self.probe), count=count)
        out = []
        for entry_id, fields in reversed(entries):
            try:
                out.append((entry_id.decode(), CheckpointEvent.decode(fields[b"event"])))
            except (KeyError, ValidationError):
                continue
        return out

    def last_event_id(self) -> str:
        """Id of the newest event, or ``"0-0"`` when there is none (a cursor for :meth:`events`)."""
        newest = self.client.xrevrange(self.keys.events(self.probe), count=1)
        return newest[0][0].decode() if newest else "0-0"

    def _decode_manifest(self, raw: bytes, *, where: str) -> CheckpointManifest:
        try:
            return CheckpointManifest.decode(raw)
        except ValidationError as exc:
            reason = describe_error(exc)[1]
            raise RegistryError(f"{self.probe} {where}: bad manifest: {reason}") from None

    def _parse(self, manifest_json: bytes, blob: bytes, *, where: str) -> CheckpointManifest:
        manifest = self._decode_manifest(manifest_json, where=where)
        actual = hashlib.sha256(blob).hexdigest()
        if actual != manifest.tensors_sha256:
            raise RegistryError(
                f"{self.probe} {where}: tensor sha256 {actual[:12]}… does not match the "
                f"manifest's {manifest.tensors_sha256[:12]}…"
            )
        return manifest
