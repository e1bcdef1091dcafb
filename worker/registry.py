"""The checkpoint registry in Redis: versions, blobs, manifests, stages, events.

Key layout (``K = {prefix}:{probe}``)::

    K:next_version     INCR -> version numbers, strictly increasing
    K:versions         sorted set of published versions (the visibility marker)
    K:ckpt:{v}         safetensors bytes
    K:manifest:{v}     JSON CheckpointManifest
    K:stages           hash: live -> v, canary -> v, canary_share -> float, pinned -> 0/1
    K:events           stream of CheckpointEvent JSON (field "event")
    K:updater_lease    "<token>|<holder>" with a TTL (see worker.lease)

Publishing is one Lua script: blob, manifest, the version marker and the
event are written together or not at all, and only by the current lease
holder when a fencing token is given. Readers see a version only once both
blob and manifest exist. Integrity (sha256 of the blob against the
manifest) is checked on every read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from schemas import CheckpointEvent, CheckpointManifest, EventKind, describe_error, utcnow
from worker.errors import ProbeguardError
from worker.redis_store import Keys

__all__ = [
    "Fenced",
    "Registry",
    "RegistryError",
    "Stages",
    "StoredCheckpoint",
    "UnknownVersion",
]

EVENTS_MAXLEN = 10_000


class RegistryError(ProbeguardError):
    """The registry refused an operation or holds something unusable."""


class UnknownVersion(RegistryError):
    """The version was never published (or has been pruned)."""


class Fenced(RegistryError):
    """The writer's fencing token is not the current lease holder's."""


@dataclass(frozen=True)
class Stages:
    live: int | None = None
    canary: int | None = None
    canary_share: float = 0.0
    pinned: bool = False


@dataclass(frozen=True)
class StoredCheckpoint:
    version: int
    blob: bytes  # safetensors
    manifest_json: bytes
    manifest: CheckpointManifest


# KEYS: versions, ckpt, manifest, events, stages, lease
# ARGV: version, blob, manifest, event, token ('' = no fencing), set_live '0'/'1', maxlen
_PUBLISH = """
if ARGV[5] ~= '' then
  local cur = redis.call('GET', KEYS[6])
  local token = cur and string.match(cur, '^(%d+)|')
  if token ~= ARGV[5] then
    return redis.error_reply('FENCED token ' .. ARGV[5] .. ' is not the lease holder ('
      .. tostring(cur) .. ')')
  end
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return redis.error_reply('EXISTS version ' .. ARGV[1] .. ' is already published')
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[1])
if ARGV[6] == '1' then redis.call('HSET', KEYS[5], 'live', ARGV[1]) end
return redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'event', ARGV[4])
"""

# KEYS: versions, stages, events; ARGV: field-value pairs JSON, fields to delete JSON,
# version that must exist ('' = none), event, maxlen
_SET_STAGES = """
if ARGV[3] ~= '' and not redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  return redis.error_reply('UNKNOWN version ' .. ARGV[3] .. ' is not published')
end
local sets = cjson.decode(ARGV[1])
for k, v in pairs(sets) do redis.call('HSET', KEYS[2], k, v) end
for _, k in ipairs(cjson.decode(ARGV[2])) do redis.call('HDEL', KEYS[2], k) end
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'event', ARGV[4])
"""


class Registry:
    """Versioned checkpoints of one probe."""

    def __init__(self, client: redis.Redis, keys: Keys, probe: str) -> None:
        # redis-py's return types are unions over decode_responses; ours is always bytes.
        self.client: Any = client
        self.keys = keys
        self.probe = probe
        self._publish = client.register_script(_PUBLISH)
        self._set_stages = client.register_script(_SET_STAGES)

    def key(self, *parts: str | int) -> str:
        return self.keys.probe(self.probe, *parts)

    @property
    def lease_key(self) -> str:
        return self.key("updater_lease")

    # --- writing ---------------------------------------------------------

    def allocate_version(self) -> int:
        """A fresh version number (never reused, even if it is never published)."""
        return int(self.client.incr(self.key("next_version")))

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
        """Store a checkpoint whose manifest carries an allocated version; atomic and fenced."""
        manifest = self._parse(manifest_json, blob, where="publish")
        if manifest.probe != self.probe:
            raise RegistryError(f"manifest is for probe {manifest.probe!r}, not {self.probe!r}")
        v = manifest.version
        event = self._event(
            "published",
            v,
            reason=reason,
            actor=actor,
            details={"parent": manifest.parent, "live": set_live},
        )
        try:
            self._publish(
                keys=[
                    self.key("versions"),
                    self.key("ckpt", v),
                    self.key("manifest", v),
                    self.key("events"),
                    self.key("stages"),
                    self.lease_key,
                ],
                args=[v, blob, manifest_json, event, token or "", int(set_live), EVENTS_MAXLEN],
            )
        except redis.ResponseError as exc:
            msg = str(exc)
            if msg.startswith("FENCED"):
                raise Fenced(f"publish of {self.probe} v{v} refused: {msg[7:]}") from None
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
    ) -> None:
        """Change stage pointers and record the event, atomically.

        ``version`` (when given) must be published, else :class:`UnknownVersion`.
        """
        event = self._event(
            kind, version, previous=previous, reason=reason, actor=actor, details=details or {}
        )
        sets = {k: str(int(v) if isinstance(v, bool) else v) for k, v in (set_fields or {}).items()}
        try:
            self._set_stages(
                keys=[self.key("versions"), self.key("stages"), self.key("events")],
                args=[
                    json.dumps(sets),
                    json.dumps(list(delete)),
                    "" if version is None else version,
                    event,
                    EVENTS_MAXLEN,
                ],
            )
        except redis.ResponseError as exc:
            if str(exc).startswith("UNKNOWN"):
                raise UnknownVersion(f"{self.probe} has no published version {version}") from None
            raise RegistryError(str(exc)) from None

    def promote(self, version: int, *, reason: str = "", actor: str = "") -> None:
        """Make ``version`` live; it stops being the canary if it was one."""
        st = self.stages()
        delete = ["canary", "canary_share"] if st.canary == version else []
        self.set_stages(
            "promoted",
            set_fields={"live": version},
            delete=delete,
            version=version,
            previous=st.live,
            reason=reason,
            actor=actor,
        )

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` versions, never the live or canary one."""
        st = self.stages()
        protected = {st.live, st.canary}
        versions = self.versions()
        doomed = [v for v in versions[:-keep] if v not in protected] if keep > 0 else []
        if doomed:
            pipe = self.client.pipeline(transaction=True)
            pipe.zrem(self.key("versions"), *doomed)
            for v in doomed:
                pipe.delete(self.key("ckpt", v), self.key("manifest", v))
            pipe.execute()
        return doomed

    # --- reading ---------------------------------------------------------

    def versions(self) -> list[int]:
        return [int(v) for v in self.client.zrange(self.key("versions"), 0, -1)]

    def latest(self) -> int | None:
        newest = self.client.zrange(self.key("versions"), -1, -1)
        return int(newest[0]) if newest else None

    def stages(self) -> Stages:
        raw = {k.decode(): v.decode() for k, v in self.client.hgetall(self.key("stages")).items()}
        return Stages(
            live=int(raw["live"]) if "live" in raw else None,
            canary=int(raw["canary"]) if "canary" in raw else None,
            canary_share=float(raw.get("canary_share", 0.0)),
            pinned=raw.get("pinned") == "1",
        )

    def manifest(self, version: int) -> CheckpointManifest:
        raw = self.client.get(self.key("manifest", version))
        if raw is None:
            raise UnknownVersion(f"{self.probe} has no version {version}")
        return self._decode_manifest(raw, where=f"v{version}")

    def get(self, version: int) -> StoredCheckpoint:
        """Blob and manifest of ``version``, with the blob's sha256 verified."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.key("ckpt", version))
        pipe.get(self.key("manifest", version))
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
        reply = self.client.xread({self.key("events"): after}, count=count, block=block_ms)
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
        entries = self.client.xrevrange(self.key("events"), count=count)
        out = []
        for entry_id, fields in reversed(entries):
            try:
                out.append((entry_id.decode(), CheckpointEvent.decode(fields[b"event"])))
            except (KeyError, ValidationError):
                continue
        return out

    def last_event_id(self) -> str:
        """Id of the newest event, or ``"0-0"`` when there is none (a cursor for :meth:`events`)."""
        newest = self.client.xrevrange(self.key("events"), count=1)
        return newest[0][0].decode() if newest else "0-0"

    # --- helpers ---------------------------------------------------------

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

    def _event(self, kind: EventKind, version: int | None, **fields: Any) -> str:
        return (
            CheckpointEvent(kind=kind, probe=self.probe, version=version, at=utcnow(), **fields)
            .encode()
            .decode()
        )
