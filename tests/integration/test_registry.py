"""The Redis checkpoint registry and the updater lease, against a real Redis server."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from schemas import CheckpointManifest, LLMFingerprint, ProbeSpec, utcnow
from tests.conftest import RedisNamespace
from worker.errors import Fenced, RegistryError, UnknownVersion
from worker.store.checkpoints import OPTIM_MAGIC, CheckpointRegistry, Stages
from worker.store.lease import Lease

pytestmark = pytest.mark.integration

FP = LLMFingerprint(
    model_id="tiny", source_sha256="0" * 64, num_layers=4, hidden_size=8, tokenizer_sha256="1" * 64
)
SPEC = ProbeSpec(
    name="tox",
    token_pool="mean",
    layer_mix="scalar_mix",
    layers=[1, 2],
    hidden_size=8,
    task="multiclass",
    labels=["ok", "toxic"],
    flag_labels=["toxic"],
)


def checkpoint(version: int, payload: bytes = b"tensors", parent: int | None = None):
    blob = payload + str(version).encode()
    manifest = CheckpointManifest(
        probe="tox",
        version=version,
        parent=parent,
        created_at=utcnow(),
        spec=SPEC,
        llm=FP,
        tensors_sha256=hashlib.sha256(blob).hexdigest(),
    )
    return blob, manifest.encode()


@pytest.fixture
def registry(redis_ns: RedisNamespace) -> CheckpointRegistry:
    return CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox")


def test_publish_get_and_visibility(registry: CheckpointRegistry) -> None:
    assert registry.versions() == [] and registry.latest() is None
    v1 = registry.allocate_version()
    v2 = registry.allocate_version()
    assert v2 > v1
    with pytest.raises(UnknownVersion):
        registry.get(v1)  # allocated, not published: invisible
    blob, manifest = checkpoint(v2)
    registry.publish(blob, manifest, set_live=True, reason="first")
    assert registry.versions() == [v2] and registry.latest() == v2
    got = registry.get(v2)
    assert got.blob == blob and got.manifest.version == v2
    assert registry.stages().live == v2
    with pytest.raises(RegistryError, match="already published"):
        registry.publish(blob, manifest)
    ((_, event),) = registry.events()
    assert event.kind == "published" and event.version == v2 and event.reason == "first"


def test_corruption_is_detected(registry: CheckpointRegistry, redis_ns: RedisNamespace) -> None:
    v = registry.allocate_version()
    blob, manifest = checkpoint(v)
    with pytest.raises(RegistryError, match="sha256"):
        registry.publish(blob + b"x", manifest)
    registry.publish(blob, manifest)
    redis_ns.client.set(registry.keys.ckpt(registry.probe, v), b"flipped" + blob)
    with pytest.raises(RegistryError, match="sha256"):
        registry.get(v)
    redis_ns.client.set(registry.keys.ckpt(registry.probe, v), blob)
    redis_ns.client.set(registry.keys.manifest(registry.probe, v), b'{"probe": "tox"}')
    with pytest.raises(RegistryError, match="bad manifest"):
        registry.get(v)


def test_fencing_rejects_a_stale_holder(
    registry: CheckpointRegistry, redis_ns: RedisNamespace
) -> None:
    a = Lease(redis_ns.client, registry.lease_key, holder="updater-a", ttl_ms=300)
    b = Lease(redis_ns.client, registry.lease_key, holder="updater-b", ttl_ms=5000)
    token_a = a.acquire()
    assert token_a is not None and b.acquire() is None
    v = registry.allocate_version()
    registry.publish(*checkpoint(v), token=token_a)
    time.sleep(0.5)  # a stalls past its TTL; b takes over with a newer token
    token_b = b.acquire()
    assert token_b is not None and int(token_b) > int(token_a)
    v2 = registry.allocate_version()
    with pytest.raises(Fenced):
        registry.publish(*checkpoint(v2), token=token_a)
    assert a.acquire() is None  # a cannot renew someone else's lease
    registry.publish(*checkpoint(v2), token=token_b)
    assert registry.versions() == [v, v2]
    assert b.current() == (token_b, "updater-b")
    b.release()
    assert b.current() is None


def test_stage_changes_are_events(registry: CheckpointRegistry) -> None:
    versions = []
    for _ in range(3):
        v = registry.allocate_version()
        registry.publish(*checkpoint(v))
        versions.append(v)
    cursor = registry.last_event_id()
    with pytest.raises(UnknownVersion):
        registry.promote(999)
    registry.set_stages(
        "canary", set_fields={"canary": versions[1], "canary_share": 0.25}, version=versions[1]
    )
    registry.promote(versions[0], reason="operator", actor="alice")
    st = registry.stages()
    assert (st.live, st.canary, st.canary_share) == (versions[0], versions[1], 0.25)
    registry.promote(versions[1], reason="canary won")
    st = registry.stages()
    assert (st.live, st.canary, st.canary_share) == (versions[1], None, 0.0)
    kinds = [(e.kind, e.version, e.previous) for _, e in registry.events(cursor)]
    assert kinds == [
        ("canary", versions[1], None),
        ("promoted", versions[0], None),
        ("promoted", versions[1], versions[0]),
    ]
    assert [e.kind for _, e in registry.history(2)] == ["promoted", "promoted"]


def test_blocking_event_read_wakes_on_publish(registry: CheckpointRegistry) -> None:
    cursor = registry.last_event_id()
    got: list[int | None] = []

    def reader() -> None:
        got.extend(e.version for _, e in registry.events(cursor, block_ms=5000))

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.2)
    v = registry.allocate_version()
    registry.publish(*checkpoint(v))
    t.join(6)
    assert got == [v]


def test_prune_keeps_live_and_canary(
    registry: CheckpointRegistry, redis_ns: RedisNamespace
) -> None:
    vs = []
    for _ in range(6):
        v = registry.allocate_version()
        registry.publish(*checkpoint(v))
        vs.append(v)
    registry.promote(vs[0])
    registry.set_stages("canary", set_fields={"canary": vs[1]}, version=vs[1])
    assert registry.prune(keep=2) == vs[2:4]
    assert registry.versions() == [vs[0], vs[1], vs[4], vs[5]]
    assert redis_ns.client.exists(registry.keys.ckpt(registry.probe, vs[2])) == 0


def test_versions_strictly_increase_under_concurrency(registry: CheckpointRegistry) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        for _ in range(50):
            v = registry.allocate_version()
            with lock:
                seen.append(v)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 200


def _momentum() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"mix.weights": torch.randn(2, generator=g), "head.weight": torch.randn(2, 8)}


def test_optimizer_state_round_trips_signed_and_forgeries_are_refused(
    redis_ns: RedisNamespace,
) -> None:
    signed = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox", signing_key=b"k" * 32)
    key = redis_ns.keys.optim("tox", 3)
    saved = _momentum()
    assert signed.load_optimizer_state(3) is None  # none published
    signed.save_optimizer_state(3, saved)
    restored = signed.load_optimizer_state(3)
    assert restored is not None and set(restored) == set(saved)
    for name, t in saved.items():
        assert torch.equal(restored[name], t)
    genuine = redis_ns.client.get(key)
    assert isinstance(genuine, bytes) and genuine.startswith(OPTIM_MAGIC)

    def refused(raw: bytes, reg: CheckpointRegistry = signed) -> str:
        redis_ns.client.set(key, raw)
        with pytest.raises(RegistryError) as info:
            reg.load_optimizer_state(3)
        return str(info.value)

    assert "unsigned" in refused(st_save(saved))  # written without the key
    assert "does not verify" in refused(genuine[:-1] + bytes([genuine[-1] ^ 1]))  # tampered
    other = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox", signing_key=b"j" * 32)
    assert "does not verify" in refused(genuine, other)  # another deployment's key
    redis_ns.client.set(key, genuine)
    assert signed.load_optimizer_state(4) is None  # bound to its version: copy it to v4...
    redis_ns.client.set(redis_ns.keys.optim("tox", 4), genuine)
    with pytest.raises(RegistryError, match="does not verify"):
        signed.load_optimizer_state(4)  # ...and it does not verify there
    # The updater's own framing before the registry signed this state: refused, logged by
    # the updater, and its momentum starts afresh.
    assert "older scheme" in refused(b"PGOPT1" + b"\0" * 32 + st_save(saved))
    nan = {**saved, "head.weight": torch.full((2, 8), float("nan"))}
    unkeyed = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox")
    assert "not finite" in refused(st_save(nan), unkeyed)
    assert "unreadable" in refused(b"not safetensors", unkeyed)


def test_without_a_key_optimizer_state_is_plain_safetensors(registry: CheckpointRegistry) -> None:
    saved = _momentum()
    registry.save_optimizer_state(5, saved)
    raw = registry.client.get(registry.keys.optim("tox", 5))
    assert st_load(raw).keys() == saved.keys()  # stored as before, no framing
    restored = registry.load_optimizer_state(5)
    assert restored is not None
    for name, t in saved.items():
        assert torch.equal(restored[name], t)
    registry.save_optimizer_state(6, {})  # nothing to store
    assert registry.client.get(registry.keys.optim("tox", 6)) is None


def test_stage_signatures_are_unchanged_by_the_shared_mac(redis_ns: RedisNamespace) -> None:
    """Stage records signed before the registry's one ``mac`` still verify."""
    import hmac
    import json

    reg = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox", signing_key=b"k" * 32)
    st = Stages(live=2, canary=3, canary_share=0.25, seq=7)
    shas = {2: "a" * 64, 3: "b" * 64}
    record = ["probeguard-stages/1", redis_ns.keys.prefix, "tox", 2, "a" * 64, 3, "b" * 64]
    message = json.dumps([*record, 0.25, 7], separators=(",", ":")).encode()
    before = hmac.new(b"k" * 32, message, hashlib.sha256).hexdigest()
    assert reg.stage_signature(st, shas) == before


def test_prune_forgets_the_marks_of_versions_it_deletes(
    registry: CheckpointRegistry, redis_ns: RedisNamespace
) -> None:
    """L11: ``tried`` and ``rolled_back`` gained a member per canary or rollback forever,
    and the rollout check reads both whole every 2 s. Marks of deleted versions go with
    them (a deleted version can be neither served nor promoted); so do marks left behind
    by versions pruned before this fix."""
    vs = []
    for _ in range(6):
        v = registry.allocate_version()
        registry.publish(*checkpoint(v))
        vs.append(v)
        registry.set_stages("canary", set_fields={"canary": v}, version=v, mark_tried=[v])
        registry.set_stages(
            "rolled_back", delete=["canary"], version=v, mark_rolled_back={v: "bad"}
        )
    registry.promote(vs[0])
    client, keys, probe = redis_ns.client, registry.keys, registry.probe
    client.sadd(keys.tried(probe), 999_000)  # left behind by an earlier prune
    client.hset(keys.rolled_back(probe), "999000", "old")
    assert registry.tried() == {*vs, 999_000}
    assert registry.prune(keep=2) == vs[1:4]
    assert registry.tried() == {vs[0], vs[4], vs[5]}
    assert set(registry.rolled_back()) == {vs[0], vs[4], vs[5]}
