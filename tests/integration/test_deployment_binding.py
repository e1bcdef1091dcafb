"""Review M3: a checkpoint signed for one deployment (staging, sharing the key) is never
served, trained on nor signed live in another, and what scorers load is what the signed
stage pointers name. Two registries on one real Redis, prefixes ``…:prod`` and ``…:stg``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from probes.checkpoint import checkpoint_to_bytes, probe_from_bytes, sign
from probes.errors import CheckpointError
from probes.probe import build_probe
from schemas import CheckpointManifest
from tests.conftest import RedisNamespace
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.errors import RegistryError
from worker.llm.tiny import make_tiny_llm
from worker.scoring.probe_watch import ProbeWatcher
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import Keys

pytestmark = pytest.mark.integration

KEY = "a-test-key-of-sufficient-length"


def deployments(redis_ns: RedisNamespace) -> tuple[CheckpointRegistry, CheckpointRegistry]:
    """``toxicity`` in prod and in staging, signed with the same key (cleaned up with the
    test's namespace)."""
    prod, stg = (
        CheckpointRegistry(
            redis_ns.client, Keys(f"{redis_ns.prefix}:{name}"), "toxicity", signing_key=KEY.encode()
        )
        for name in ("prod", "stg")
    )
    return prod, stg


def copy_version(src: CheckpointRegistry, dst: CheckpointRegistry, version: int) -> None:
    """What a Redis writer can do without the key: copy a version's two values across."""
    client = src.client
    client.set(dst.keys.ckpt(dst.probe, version), client.get(src.keys.ckpt(src.probe, version)))
    client.set(
        dst.keys.manifest(dst.probe, version), client.get(src.keys.manifest(src.probe, version))
    )


def test_a_checkpoint_swapped_in_after_the_pointers_verify_is_never_served(
    redis_ns: RedisNamespace,
) -> None:
    fp = make_tiny_llm().fingerprint
    prod, stg = deployments(redis_ns)
    for seed in (1, 2, 3):
        publish_probe(prod, fp, seed=seed, signing_key=KEY.encode())
        # Staging's signed before signatures were bound (the worst case: such a checkpoint
        # verifies anywhere the key does; only the pointers' sha tells it apart).
        v = stg.allocate_version()
        probe = build_probe(toxicity_spec(fp.hidden_size), seed=10 + seed)
        blob, mj = checkpoint_to_bytes(probe, llm=fp, version=v, signing_key=KEY.encode())
        stg.publish(blob, mj)
    assert prod.stages().live == 3 and stg.latest() == 3
    genuine = prod.get(3).manifest.tensors_sha256
    foreign = stg.get(3).manifest.tensors_sha256
    assert genuine != foreign

    # Right after the pointers' signature is checked (against the genuine manifest), the
    # writer swaps staging's v3 in: the load that follows is a second read.
    swapped: list[bool] = []
    real: Callable[..., Any] = prod.stage_signature

    def then_swap(*args: Any, **kwargs: Any) -> str:
        sig = real(*args, **kwargs)
        if not swapped:
            swapped.append(True)
            copy_version(stg, prod, 3)
        return sig

    prod.stage_signature = then_swap  # type: ignore[method-assign]
    watcher = ProbeWatcher({"toxicity": prod}, fp, signing_key=KEY.encode())
    watcher.refresh(force=True)
    assert swapped
    served = watcher.slots["toxicity"].live
    assert served is None or served.manifest.tensors_sha256 == genuine
    # And with the foreign pair left in place, the pointers no longer verify: still nothing
    # foreign is served.
    watcher.refresh(force=True)
    served = watcher.slots["toxicity"].live
    assert served is None or served.manifest.tensors_sha256 == genuine


def test_resume_refuses_a_version_copied_from_another_deployment(
    redis_ns: RedisNamespace,
) -> None:
    from tests.integration.test_updater import extractor
    from worker.learning.updater import Updater

    ex = extractor()
    fp = ex.fingerprint
    prod, stg = deployments(redis_ns)
    for seed in (1, 2, 3):
        publish_probe(prod, fp, seed=seed, signing_key=KEY.encode())
    redis_ns.client.set(stg.keys.next_version("toxicity"), 8)
    assert publish_probe(stg, fp, seed=9, signing_key=KEY.encode()) == 9
    # The writer adds staging's v9 to prod's versions, newest, as the script would.
    copy_version(stg, prod, 9)
    redis_ns.client.zadd(prod.keys.versions("toxicity"), {"9": 9})
    redis_ns.client.set(prod.keys.next_version("toxicity"), 9)
    assert prod.latest() == 9

    settings = Settings(
        redis_prefix=prod.keys.prefix,
        checkpoint_hmac_key=KEY,
        deployment_id=prod.keys.deployment,
        probe_to_train="toxicity",
        probes="toxicity",
        metrics_port=0,
    )
    updater = Updater(settings, ex, redis_ns.client, worker_id="u-binding")
    updater._resume()
    assert updater.parent == 3  # prod's own newest, not staging's v9
    assert updater.metrics.resume_skipped._value.get() == 1


def test_a_forged_or_foreign_checkpoint_is_never_signed_live(redis_ns: RedisNamespace) -> None:
    """An operator's promote (and a publish that goes live) verifies the checkpoint's own
    signature, bound to this deployment, before signing pointers to it."""
    fp = make_tiny_llm().fingerprint
    prod, stg = deployments(redis_ns)
    publish_probe(prod, fp, seed=1, signing_key=KEY.encode())
    v2 = publish_probe(prod, fp, seed=2, signing_key=KEY.encode(), set_live=False)
    # A writer edits v2's manifest (its metrics), keeping the signature.
    manifest = prod.get(v2).manifest
    forged = manifest.model_copy(update={"metrics": {"val_f1": 0.99}})
    redis_ns.client.set(prod.keys.manifest("toxicity", v2), forged.encode())
    with pytest.raises(RegistryError, match="signature"):
        prod.promote(v2)
    # Staging's v3, copied in whole (it verifies, but for staging).
    publish_probe(stg, fp, seed=3, signing_key=KEY.encode(), set_live=False)
    publish_probe(stg, fp, seed=4, signing_key=KEY.encode(), set_live=False)
    v3 = publish_probe(stg, fp, seed=5, signing_key=KEY.encode(), set_live=False)
    copy_version(stg, prod, v3)
    redis_ns.client.zadd(prod.keys.versions("toxicity"), {str(v3): v3})
    with pytest.raises(RegistryError, match="prod"):
        prod.promote(v3)
    assert prod.stages().live == 1
    # Nor does publish(set_live=True) sign pointers to a checkpoint signed for staging.
    v4 = prod.allocate_version()
    blob, mj = checkpoint_to_bytes(
        build_probe(toxicity_spec(fp.hidden_size), seed=6),
        llm=fp,
        version=v4,
        signing_key=KEY.encode(),
        deployment=stg.keys.prefix,
    )
    with pytest.raises(RegistryError, match="not publishing it live"):
        prod.publish(blob, mj, set_live=True)
    assert prod.stages().live == 1


def test_signatures_bound_and_unbound_are_distinct() -> None:
    """A file's signature (unbound) still verifies as before; a bound one verifies only
    for its deployment, and an unbound one in a registry only where vouched for."""
    fp = make_tiny_llm().fingerprint
    probe = build_probe(toxicity_spec(fp.hidden_size), seed=1)
    key = KEY.encode()
    blob, unbound = checkpoint_to_bytes(probe, llm=fp, version=3, signing_key=key)
    blob2, bound = checkpoint_to_bytes(probe, llm=fp, version=3, signing_key=key, deployment="a")
    m = CheckpointManifest.decode(unbound)
    assert sign(m, blob, key) != sign(m, blob, key, "a") != sign(m, blob, key, "b")
    probe_from_bytes(blob, unbound, fp, signing_key=key)  # a file
    probe_from_bytes(blob2, bound, fp, signing_key=key, deployment="a")
    with pytest.raises(CheckpointError, match="for deployment 'b'"):
        probe_from_bytes(blob2, bound, fp, signing_key=key, deployment="b")
    with pytest.raises(CheckpointError, match="not bound"):
        probe_from_bytes(blob, unbound, fp, signing_key=key, deployment="a")
    probe_from_bytes(blob, unbound, fp, signing_key=key, deployment="a", unbound_ok=True)
    with pytest.raises(CheckpointError, match="signature does not verify"):
        probe_from_bytes(blob2, bound, fp, signing_key=key)  # not a file's signature


def test_deployments_with_the_same_prefix_and_key_are_told_apart_by_their_ids(
    redis_ns: RedisNamespace,
) -> None:
    """Issue 45: the binding was the Redis key prefix, `probeguard` everywhere by default,
    so staging and production on separate Redis servers with the same key and the default
    prefix verified each other's checkpoints. The binding is PROBEGUARD_DEPLOYMENT_ID now,
    required with the key."""
    import redis as redis_lib

    with pytest.raises(ValueError, match="PROBEGUARD_DEPLOYMENT_ID is required"):
        Settings(checkpoint_hmac_key=KEY)
    fp = make_tiny_llm().fingerprint
    base, _, db = redis_ns.url.rpartition("/")
    other = redis_lib.Redis.from_url(f"{base}/{1 if db in ('', '0') else 0}")  # staging's own
    assert other.connection_pool.connection_kwargs["db"] != int(db or 0)
    try:
        prod, stg = (
            CheckpointRegistry(
                client, Keys(redis_ns.prefix, deployment), "toxicity", signing_key=KEY.encode()
            )
            for client, deployment in ((redis_ns.client, "production"), (other, "staging"))
        )
        assert prod.keys.prefix == stg.keys.prefix
        mine = publish_probe(prod, fp, seed=1, signing_key=KEY.encode())
        publish_probe(stg, fp, seed=2, signing_key=KEY.encode())
        theirs = publish_probe(stg, fp, seed=3, signing_key=KEY.encode())  # v2
        assert prod.get_verified(mine).manifest.version == mine
        # Staging's next version, copied into production's Redis under the same keys.
        client = prod.client
        client.set(prod.keys.ckpt("toxicity", theirs), other.get(stg.keys.ckpt("toxicity", theirs)))
        client.set(
            prod.keys.manifest("toxicity", theirs),
            other.get(stg.keys.manifest("toxicity", theirs)),
        )
        with pytest.raises(RegistryError, match=r"another deployment|does not verify"):
            prod.get_verified(theirs)
    finally:
        for key in other.scan_iter(match=f"{redis_ns.prefix}:*"):
            other.delete(key)
        other.close()
