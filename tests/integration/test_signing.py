"""Signed checkpoints: with a key configured, write access to Redis alone cannot push a probe."""

from __future__ import annotations

import operator
import urllib.request
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch

from schemas import CheckpointManifest
from tests.conftest import RedisNamespace
from tests.integration.test_scorer import chat, extractor, verdicts
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe
from worker.embedded import free_port
from worker.errors import RegistryError
from worker.kafka.clients import ensure_topics
from worker.rollout.changes import Rollout
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry, Stages
from worker.store.evidence import EvidenceStore
from worker.store.redis import Keys

pytestmark = pytest.mark.integration

KEY = "a-test-key-of-sufficient-length"


@pytest.fixture
def signed(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "checkpoint_hmac_key": Settings(
                checkpoint_hmac_key=KEY, deployment_id="t"
            ).checkpoint_hmac_key,
            "stage_check_interval_s": 0.3,
            "metrics_port": free_port(),
        }
    )


@pytest.fixture
def running(signed: Settings, redis_ns: RedisNamespace) -> Iterator[Scorer]:
    ensure_topics(signed)
    scorer = Scorer(signed, extractor(signed), redis_ns.client)
    runner = Threaded(scorer.run, scorer.stop)
    yield scorer
    runner.stop()


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert KEY not in body  # the key never reaches the metrics
    for line in body.splitlines():
        if line.startswith(f'{name}{{probe="toxicity"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _refused_count(port: int) -> float:
    return _metric(port, "probeguard_scorer_checkpoints_refused_total")


def keyed(redis_ns: RedisNamespace, key: bytes | None = KEY.encode()) -> CheckpointRegistry:
    """The registry as an updater or operator sees it: with the signing key (or without:
    a Redis writer who lacks it)."""
    return CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity", signing_key=key)


def point_live(registry: CheckpointRegistry, version: int) -> None:
    """Signed stage pointers making ``version`` live, written without the checks of
    :meth:`CheckpointRegistry.set_stages` (which refuses a checkpoint that does not verify)."""
    nxt = Stages(live=version, seq=registry._next_seq())
    registry.client.hset(
        registry.keys.stages(registry.probe),
        mapping={"live": version, "seq": nxt.seq, "sig": registry.stage_signature(nxt)},
    )


def test_scorer_with_a_key_refuses_unsigned_and_wrongly_signed_versions(
    signed: Settings, redis_ns: RedisNamespace, running: Scorer
) -> None:
    registry = keyed(redis_ns)  # the operator signs the stage pointers
    fp = running.extractor.fingerprint
    key = signed.signing_key
    assert key is not None
    v1 = publish_probe(registry, fp, seed=1, signing_key=key)
    wait_until(lambda: running.watcher.versions()["toxicity"]["live"] == v1, "signed v1 served")

    def forge_metrics(version: int) -> None:
        """Edit a signed manifest (its metrics) and keep the old signature."""
        manifest = CheckpointManifest.decode(registry.get(version).manifest_json)
        forged = manifest.model_copy(update={"metrics": {"val_f1": 0.99}})
        assert forged.signature == manifest.signature is not None
        redis_ns.client.set(registry.keys.manifest(registry.probe, version), forged.encode())

    # Versions that do not verify, pointed at with valid signed pointers: refused at load.
    # (The registry's writers refuse to sign such pointers, review M3; they are written
    # here as a key holder's older release could have.)
    attempts = [
        lambda: publish_probe(registry, fp, seed=2, set_live=False),  # unsigned
        lambda: publish_probe(
            registry, fp, seed=3, signing_key=b"some-other-key-0123456789", set_live=False
        ),
        lambda: publish_probe(registry, fp, seed=4, signing_key=key, set_live=False),  # forged
    ]
    for n, attempt in enumerate(attempts):
        bad = attempt()
        if n == 2:
            forge_metrics(bad)
        point_live(registry, bad)
        refused_now = running.watcher.refused["toxicity"]
        wait_until(partial(operator.contains, refused_now, bad), f"v{bad} refused")
    assert running.watcher.versions()["toxicity"]["live"] == v1
    assert _refused_count(signed.metrics_port) == 3

    # Scoring went on with the last good (signed) probe the whole time.
    produce_raw(signed, signed.topic_chat, [(None, chat(i)) for i in range(8)])
    assert {v.results[0].version for v in verdicts(signed, 8)} == {v1}

    # A properly signed version is served without a restart.
    v5 = publish_probe(registry, fp, seed=5, signing_key=key)
    wait_until(lambda: running.watcher.versions()["toxicity"]["live"] == v5, "signed v5 served")


def test_updater_signs_what_it_publishes_and_resumes_only_from_signed(
    signed: Settings, redis_ns: RedisNamespace
) -> None:
    from probes.checkpoint import probe_from_bytes
    from probes.errors import CheckpointError
    from tests.integration.test_updater import extractor as updater_extractor
    from tests.integration.test_updater import fast, label
    from worker.learning.updater import Updater

    settings = fast(signed)
    ensure_topics(settings)
    registry = keyed(redis_ns)
    updater = Updater(settings, updater_extractor(), redis_ns.client, worker_id="u-signed")
    runner = Threaded(updater.run, updater.stop)
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: registry.stages().live is not None, "a first version")
    runner.stop()
    version = registry.latest()
    assert version is not None
    stored = registry.get(version)
    fp = updater.extractor.fingerprint
    prefix = registry.keys.prefix
    key = settings.signing_key
    probe_from_bytes(stored.blob, stored.manifest_json, fp, signing_key=key, deployment=prefix)
    with pytest.raises(CheckpointError, match="signature"):
        probe_from_bytes(stored.blob, stored.manifest_json, fp, signing_key=b"x" * 16)
    with pytest.raises(CheckpointError, match="signature"):  # bound to its deployment
        probe_from_bytes(stored.blob, stored.manifest_json, fp, signing_key=key)

    # Review C10: an unverifiable newest version (unsigned here; a corrupt blob or a key
    # rotation alike) used to make every updater exit at resume. It is skipped.
    publish_probe(registry, fp, seed=9, set_live=False)
    again = Updater(settings, updater_extractor(), redis_ns.client, worker_id="u-signed-2")
    again._resume()
    assert again.parent == version
    assert again.metrics.resume_skipped._value.get() == 1


def test_stage_pointers_written_without_the_key_are_ignored(
    signed: Settings, redis_ns: RedisNamespace, running: Scorer
) -> None:
    # Review C6 (a), (b): the HMAC covered artefacts, not which one is live; a Redis
    # writer could point live at any retained signed version (a rolled-back one, one
    # copied from another deployment) and scorers served it.
    key = signed.signing_key
    assert key is not None
    registry, unkeyed = keyed(redis_ns), keyed(redis_ns, key=None)
    fp = running.extractor.fingerprint
    v1 = publish_probe(registry, fp, seed=1, signing_key=key)
    v2 = publish_probe(registry, fp, seed=2, signing_key=key)
    wait_until(lambda: running.watcher.versions()["toxicity"]["live"] == v2, "v2 served")
    old_record: dict[Any, Any] = redis_ns.client.hgetall(registry.keys.stages("toxicity"))
    v3 = publish_probe(registry, fp, seed=3, signing_key=key)
    wait_until(lambda: running.watcher.versions()["toxicity"]["live"] == v3, "v3 served")
    Rollout(registry, EvidenceStore(redis_ns.client, redis_ns.keys), actor="op").rollback_live(
        reason="v3 misbehaves"
    )
    wait_until(lambda: running.watcher.versions()["toxicity"]["live"] == v2, "rolled back")
    stages_key = registry.keys.stages("toxicity")
    untrusted = "probeguard_scorer_stage_pointers_refused_total"

    # (a) live -> the rolled-back v3, by a writer without the key.
    unkeyed.promote(v3, reason="attacker")
    wait_until(lambda: _metric(signed.metrics_port, untrusted) >= 1, "the pointer ignored")
    # (b) a signed checkpoint copied in from another deployment (same key).
    other = CheckpointRegistry(redis_ns.client, Keys(redis_ns.prefix + "-staging"), "toxicity")
    copied = publish_probe(other, fp, seed=7, signing_key=key)
    stored = other.get(copied)
    redis_ns.client.set(registry.keys.ckpt("toxicity", 99), stored.blob)
    redis_ns.client.set(
        registry.keys.manifest("toxicity", 99),
        stored.manifest.model_copy(update={"version": 99}).encode(),
    )
    redis_ns.client.zadd(registry.keys.versions("toxicity"), {"99": 99})
    redis_ns.client.hset(stages_key, "live", 99)
    wait_until(lambda: _metric(signed.metrics_port, untrusted) >= 2, "the copy ignored")
    # A replay of a record that once verified (live v2 at an older seq).
    redis_ns.client.delete(stages_key)
    redis_ns.client.hset(stages_key, mapping=old_record)
    assert registry.stages_verify(registry.stages())  # it does verify...
    wait_until(lambda: _metric(signed.metrics_port, untrusted) >= 3, "the replay ignored")
    assert running.watcher.versions()["toxicity"]["live"] == v2  # ...but is older than seen
    assert v1 in registry.versions()

    # A writer with the key starts afresh from pointers that do not verify.
    redis_ns.client.hset(stages_key, "live", v3)
    with pytest.raises(RegistryError, match="do not verify"):
        registry.promote(v1, reason="on tampered pointers")
    registry.promote(v1, reason="operator re-signs", resign=True)
    wait_until(lambda: running.watcher.versions()["toxicity"]["live"] == v1, "v1 served")


def test_optimizer_state_is_signed_and_forged_momentum_is_refused(
    signed: Settings, redis_ns: RedisNamespace
) -> None:
    # Review C6 (c): the Lion momentum was loaded unsigned; its sign steers every step of
    # the weights the updater then signs.
    from safetensors.torch import save as st_save

    from tests.integration.test_updater import extractor as updater_extractor
    from tests.integration.test_updater import fast, label
    from worker.learning.updater import Updater

    settings = fast(signed)
    ensure_topics(settings)
    registry = keyed(redis_ns)
    updater = Updater(settings, updater_extractor(), redis_ns.client, worker_id="u-1")
    runner = Threaded(updater.run, updater.stop)
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(48)])
    wait_until(lambda: updater.labels_seen >= 48 and updater.unpublished == 0, "published")
    runner.stop()
    latest = registry.latest()
    assert latest is not None
    optim_key = registry.keys.optim("toxicity", latest)

    def momentum_restored() -> int:
        again = Updater(settings, updater_extractor(), redis_ns.client, worker_id="u-2")
        again._resume()
        assert again.learner is not None
        restored = again.learner.optimizer_state()
        for name, t in restored.items():  # the published momentum, tensor for tensor
            assert torch.equal(t, saved[name]), name
        return len(again.learner.lion.optimizer.state)

    assert updater.learner is not None
    saved = updater.learner.optimizer_state()  # nothing learned since the last publish
    assert saved and momentum_restored() == len(saved)  # the signed state is restored
    genuine = redis_ns.client.get(optim_key)
    assert isinstance(genuine, bytes)
    forged = {name: torch.full_like(t, 1e3) for name, t in saved.items()}
    redis_ns.client.set(optim_key, st_save(forged))  # written without the key
    assert momentum_restored() == 0
    redis_ns.client.set(optim_key, genuine[:-1] + bytes([genuine[-1] ^ 1]))  # tampered
    assert momentum_restored() == 0


def test_an_updater_refuses_to_start_over_when_no_published_version_verifies(
    signed: Settings, redis_ns: RedisNamespace
) -> None:
    """L7: after a key rotation (every retained version signed with the old key), the
    updater used to skip them all and learn "from zero", a probe that auto_live then put
    live after its warm-up. It refuses, naming what to do; an explicit setting lets it."""
    from tests.integration.test_updater import extractor as updater_extractor
    from tests.integration.test_updater import fast
    from worker.errors import ConfigError
    from worker.learning.updater import Updater

    settings = fast(signed)
    old_key = b"the-old-key-before-rotation-0123"
    fp = updater_extractor().fingerprint
    registry = keyed(redis_ns, old_key)
    published = [publish_probe(registry, fp, seed=s, signing_key=old_key) for s in (1, 2, 3)]
    updater = Updater(settings, updater_extractor(), redis_ns.client, worker_id="u-rotated")
    with pytest.raises(ConfigError, match="START_OVER_UNVERIFIED") as info:
        updater._resume()
    assert f"v{published[0]}..v{published[-1]}" in str(info.value)
    assert KEY not in str(info.value) and old_key.decode() not in str(info.value)
    assert updater.metrics.resume_skipped._value.get() == 3
    assert updater.learner is None and registry.versions() == published  # nothing learned

    allowed = settings.model_copy(update={"start_over_unverified": True})
    over = Updater(allowed, updater_extractor(), redis_ns.client, worker_id="u-rotated-2")
    over._resume()
    assert over.parent is None and over.learner is not None and over.labels_seen == 0
