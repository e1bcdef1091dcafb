"""The checkpoint registry in Redis: versions, blobs, manifests, stages, events.

The keys it reads and writes are listed in :class:`worker.store.redis.Keys`.

Stage changes are one Lua script too: pointers, marks and the event together, and
optionally only if the pointers still hold the values the caller read
(compare-and-set), so the updater's policy and an operator cannot overwrite
each other's change unseen. The live versions' history (for rollback) is
derived from the event stream (:func:`live_lineage`).

Publishing is one Lua script: blob, manifest, the version marker and the
event are written together or not at all, and only by the current lease
holder when a fencing token is given. Readers see a version only once both
blob and manifest exist. Integrity (sha256 of the blob against the
manifest) is checked on every read.

With a signing key, the stage pointers are authenticated like the checkpoints: every
change writes ``seq`` (from a counter that only grows) and ``sig``, an HMAC over the key prefix,
the probe, live and canary with the sha256 of their tensors, the canary share and
``seq`` (:meth:`CheckpointRegistry.stage_signature`). A Redis writer without the key
cannot point ``live`` at another version (a rolled-back one, one copied from another
deployment); scorers ignore pointers that do not verify, and refuse a ``seq`` older
than one they have seen (a replayed record). Writers refuse to build on pointers that
do not verify; ``resign=True`` (the operator's ``promote --force``) starts them afresh.

The Lion optimizer state published beside each version (:meth:`save_optimizer_state`)
is signed by the same scheme: an HMAC (:meth:`CheckpointRegistry.mac`, the one the stage
pointers use) over the key prefix, the probe, the version and the sha256 of the state.
A forged momentum would steer the sign of every step of weights the updater then signs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from schemas import CheckpointEvent, CheckpointManifest, EventKind, describe_error, utcnow
from worker.errors import Fenced, RegistryError, StagesChanged, UnknownVersion
from worker.store.redis import Keys

__all__ = ["OPTIM_MAGIC", "CheckpointRegistry", "Stages", "StoredCheckpoint", "live_lineage"]

EVENTS_MAXLEN = 10_000
LIVE_HISTORY_MAX = 100  # live versions remembered for rollback (newest first)
PROTECTED_LIVES = 3  # retention keeps the live version and the two lives before it
# Signed optimizer state: OPTIM_MAGIC, the hex HMAC (64 bytes), the safetensors blob. A
# safetensors file starts with its header length, never "PGOPT". "PGOPT1", the updater's
# own HMAC framing before the registry signed this state, is refused (momentum restarts).
OPTIM_MAGIC = b"PGOPT2"
_OPTIM_MAC_LEN = 64


@dataclass(frozen=True)
class Stages:
    live: int | None = None
    canary: int | None = None
    canary_share: float = 0.0
    pinned: bool = False
    seq: int = 0  # signed stage records: how many signed changes so far
    sig: str | None = None

    def expected(self) -> dict[str, int | str | None]:
        """These stages as a compare-and-set expectation: the pointers and the pin (a
        change decided on unpinned stages must not land after an operator's pin)."""
        return {"live": self.live, "canary": self.canary, "pinned": "1" if self.pinned else None}


@dataclass(frozen=True)
class StoredCheckpoint:
    version: int
    blob: bytes  # safetensors
    manifest_json: bytes
    manifest: CheckpointManifest


# KEYS: versions, ckpt, manifest, events, stages, lease, live_history
# ARGV: version, blob, manifest, event, token ('' = no fencing), set_live '0'/'1', maxlen,
#       event to record instead when set_live is refused because the probe is pinned,
#       live history length, stage seq expected ('' = unsigned), stage signature, its seq
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
if ARGV[6] == '1' and ARGV[10] ~= '' then
  local seq = redis.call('HGET', KEYS[5], 'seq') or '0'
  if seq ~= ARGV[10] and redis.call('HGET', KEYS[5], 'pinned') ~= '1' then
    return redis.error_reply('CHANGED seq is ' .. seq .. ', expected ' .. ARGV[10])
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[1])
local event = ARGV[4]
if ARGV[6] == '1' then
  if redis.call('HGET', KEYS[5], 'pinned') == '1' then
    event = ARGV[8]
  else
    redis.call('HSET', KEYS[5], 'live', ARGV[1])
    if ARGV[10] ~= '' then
      redis.call('HSET', KEYS[5], 'seq', ARGV[12], 'sig', ARGV[11])
    end
    redis.call('LREM', KEYS[7], 0, ARGV[1])
    redis.call('LPUSH', KEYS[7], ARGV[1])
    redis.call('LTRIM', KEYS[7], 0, tonumber(ARGV[9]) - 1)
  end
end
return redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'event', event)
"""

# KEYS: versions, stages, events, rolled_back, tried, live_history, then keys to delete
# ARGV: field-value pairs JSON, fields to delete JSON, version that must exist ('' = none),
#       event, maxlen, expected stage fields JSON ('' = must be absent),
#       rolled-back marks JSON {version: reason}, versions to mark tried JSON,
#       live history length
# A new live version goes to the front of live_history; rolled-back ones leave it.
_SET_STAGES = """
if ARGV[3] ~= '' and not redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  return redis.error_reply('UNKNOWN version ' .. ARGV[3] .. ' is not published')
end
for k, want in pairs(cjson.decode(ARGV[6])) do
  local cur = redis.call('HGET', KEYS[2], k) or ''
  if cur ~= want then
    return redis.error_reply('CHANGED ' .. k .. ' is ' .. (cur == '' and 'unset' or cur)
      .. ', expected ' .. (want == '' and 'unset' or want))
  end
end
for v, why in pairs(cjson.decode(ARGV[7])) do
  redis.call('HSET', KEYS[4], v, why)
  redis.call('LREM', KEYS[6], 0, v)
end
for _, v in ipairs(cjson.decode(ARGV[8])) do redis.call('SADD', KEYS[5], v) end
for i = 7, #KEYS do redis.call('DEL', KEYS[i]) end
local sets = cjson.decode(ARGV[1])
for k, v in pairs(sets) do redis.call('HSET', KEYS[2], k, v) end
for _, k in ipairs(cjson.decode(ARGV[2])) do redis.call('HDEL', KEYS[2], k) end
if sets['live'] then
  redis.call('LREM', KEYS[6], 0, sets['live'])
  redis.call('LPUSH', KEYS[6], sets['live'])
  redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[9]) - 1)
end
return redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'event', ARGV[4])
"""

# KEYS: versions, stages, live_history, then `per` keys of each candidate version
# ARGV: lives protected (the newest n of live_history), per, candidate versions JSON
# Deletes the candidates that are not live, canary or a recent live, atomically with any
# stage change (scripts run one at a time). Returns the versions deleted.
_PRUNE = """
local protected = {}
for _, k in ipairs({'live', 'canary'}) do
  local v = redis.call('HGET', KEYS[2], k)
  if v then protected[v] = true end
end
for _, v in ipairs(redis.call('LRANGE', KEYS[3], 0, tonumber(ARGV[1]) - 1)) do
  protected[v] = true
end
local per = tonumber(ARGV[2])
local doomed = {}
for i, v in ipairs(cjson.decode(ARGV[3])) do
  local vs = tostring(v)
  if not protected[vs] and redis.call('ZSCORE', KEYS[1], vs) then
    redis.call('ZREM', KEYS[1], vs)
    for j = 1, per do redis.call('DEL', KEYS[3 + (i - 1) * per + j]) end
    table.insert(doomed, v)
  end
end
return doomed
"""


class CheckpointRegistry:
    """Versioned checkpoints of one probe."""

    def __init__(
        self, client: redis.Redis, keys: Keys, probe: str, *, signing_key: bytes | None = None
    ) -> None:
        # redis-py's return types are unions over decode_responses; ours is always bytes.
        self.client: Any = client
        self.keys = keys
        self.probe = probe
        self.signing_key = signing_key
        self._publish = client.register_script(_PUBLISH)
        self._set_stages = client.register_script(_SET_STAGES)
        self._prune = client.register_script(_PRUNE)

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
        Evidence and optimizer state of deleted versions go with them.
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
        blob = st_save(dict(state))
        if self.signing_key is not None:
            blob = OPTIM_MAGIC + self._optimizer_mac(version, blob).encode() + blob
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
        blob = self._unseal_optimizer(version, raw, where)
        try:
            state = st_load(blob)  # safetensors: no pickle
        except Exception as exc:  # safetensors raises its own error types
            raise RegistryError(f"{where} is unreadable ({exc})") from None
        if not all(torch.isfinite(t).all() for t in state.values()):
            raise RegistryError(f"{where} is not finite (NaN or inf)")
        return state

    def _unseal_optimizer(self, version: int, raw: bytes, where: str) -> bytes:
        head = len(OPTIM_MAGIC) + _OPTIM_MAC_LEN
        sealed = raw.startswith(OPTIM_MAGIC)
        if not sealed and raw.startswith(OPTIM_MAGIC[:-1]):
            raise RegistryError(f"{where} is sealed by an older scheme ({raw[:6]!r})")
        if self.signing_key is None:
            return raw[head:] if sealed else raw
        if not sealed:
            raise RegistryError(f"{where} is unsigned but a signing key is configured")
        mac, blob = raw[len(OPTIM_MAGIC) : head], raw[head:]
        if not hmac.compare_digest(mac, self._optimizer_mac(version, blob).encode()):
            raise RegistryError(f"{where}: signature does not verify")
        return blob

    def _optimizer_mac(self, version: int, blob: bytes) -> str:
        digest = hashlib.sha256(blob).hexdigest()
        return self.mac(["probeguard-optim/2", self.keys.prefix, self.probe, version, digest])

    # --- signing -----------------------------------------------------------

    def mac(self, record: list[Any]) -> str:
        """HMAC-SHA256 (hex) with the signing key over ``record`` as compact JSON: the one
        scheme for stage pointers and optimizer state (``record`` names its kind first, and
        binds the deployment's key prefix and the probe)."""
        if self.signing_key is None:
            raise RegistryError("no signing key configured")
        message = json.dumps(record, separators=(",", ":")).encode()
        return hmac.new(self.signing_key, message, hashlib.sha256).hexdigest()

    # --- signed stage pointers -------------------------------------------

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
        record = [
            "probeguard-stages/1",
            self.keys.prefix,
            self.probe,
            st.live,
            shas.get(st.live) if st.live is not None else None,
            st.canary,
            shas.get(st.canary) if st.canary is not None else None,
            round(float(st.canary_share), 6) if st.canary is not None else 0.0,
            st.seq,
        ]
        return self.mac(record)

    def stages_verify(self, st: Stages) -> bool:
        """Whether ``st`` carries a valid signature (always, without a key). Empty
        pointers need none: they point nowhere."""
        if self.signing_key is None:
            return True
        if st.live is None and st.canary is None and st.sig is None:
            return True
        if st.sig is None:
            return False
        try:
            expected = self.stage_signature(st)
        except UnknownVersion:
            return False
        return hmac.compare_digest(st.sig, expected)

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
        for field, want in expected.items():
            have = getattr(cur, field, None)
            now = "" if have is None or have is False else _field(have)
            if field in ("live", "canary", "pinned") and now != want:
                raise StagesChanged(
                    f"{self.probe} stages changed meanwhile: {field} is {now or 'unset'}, "
                    f"expected {want or 'unset'}"
                )
        values = {
            "live": cur.live,
            "canary": None if resign else cur.canary,
            "canary_share": 0.0 if resign else cur.canary_share,
        }
        for k in delete:
            if k in values:
                values[k] = 0.0 if k == "canary_share" else None
        for k, v in sets.items():
            if k in values:
                values[k] = float(v) if k == "canary_share" else int(v)
        nxt = Stages(
            live=values["live"],  # type: ignore[arg-type]
            canary=values["canary"],  # type: ignore[arg-type]
            canary_share=float(values["canary_share"] or 0.0),
            seq=self._next_seq(),
        )
        sets["seq"] = nxt.seq
        sets["sig"] = self.stage_signature(nxt)
        expected["seq"] = str(cur.seq) if cur.seq else ""  # signed writes start at 1

    def _next_seq(self) -> int:
        """A seq above every one issued before (from a counter, so a replayed, older stage
        record does not set it back)."""
        return int(self.client.incr(self.keys.stage_seq(self.probe)))

    # --- reading ---------------------------------------------------------

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
        return Stages(
            live=int(raw["live"]) if "live" in raw else None,
            canary=int(raw["canary"]) if "canary" in raw else None,
            canary_share=float(raw.get("canary_share", 0.0)),
            pinned=raw.get("pinned") == "1",
            seq=int(raw.get("seq", 0)),
            sig=raw.get("sig"),
        )

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


def _field(value: Any) -> str:
    return str(int(value) if isinstance(value, bool) else value)


def live_lineage(events: Iterable[CheckpointEvent]) -> list[int]:
    """The live versions in the order they went live, oldest first, the current last.

    A version that goes live again moves to the end; a live rollback removes the
    rolled-back version, so the element before the last is always the version a
    rollback restores. Events are read oldest first.

    >>> from schemas import utcnow
    >>> def ev(kind, v, **kw):
    ...     return CheckpointEvent(kind=kind, probe="p", version=v, at=utcnow(), **kw)
    >>> live_lineage([ev("promoted", 1), ev("promoted", 3), ev("promoted", 5),
    ...               ev("rolled_back", 5, details={"stage": "live", "restored": 3})])
    [1, 3]
    """
    stack: list[int] = []

    def to_top(v: int) -> None:
        if v in stack:
            stack.remove(v)
        stack.append(v)

    for e in events:
        if e.version is None:
            continue
        if e.kind == "promoted" or (e.kind == "published" and e.details.get("live") is True):
            to_top(e.version)
        elif e.kind == "rolled_back" and e.details.get("stage") == "live":
            stack[:] = [v for v in stack if v != e.version]
            restored = e.details.get("restored")
            if isinstance(restored, int) and not isinstance(restored, bool):
                to_top(restored)
    return stack
