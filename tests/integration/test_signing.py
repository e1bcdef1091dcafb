"""Signed checkpoints: with a key configured, write access to Redis alone cannot push a probe."""

from __future__ import annotations

import operator
import urllib.request
from collections.abc import Iterator
from functools import partial

import pytest

from schemas import CheckpointManifest
from tests.conftest import RedisNamespace
from tests.integration.test_scorer import chat, extractor, verdicts
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe
from worker.embedded import free_port
from worker.kafka.clients import ensure_topics
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

KEY = "a-test-key-of-sufficient-length"


@pytest.fixture
def signed(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "checkpoint_hmac_key": Settings(checkpoint_hmac_key=KEY).checkpoint_hmac_key,
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


def _refused_count(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert KEY not in body  # the key never reaches the metrics
    for line in body.splitlines():
        if line.startswith('probeguard_scorer_checkpoints_refused_total{probe="toxicity"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_scorer_with_a_key_refuses_unsigned_and_wrongly_signed_versions(
    signed: Settings, redis_ns: RedisNamespace, running: Scorer
) -> None:
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
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

    # Someone with Redis write access but without the key pushes each of these live in turn.
    attempts = [
        lambda: publish_probe(registry, fp, seed=2),  # unsigned
        lambda: publish_probe(registry, fp, seed=3, signing_key=b"some-other-key-0123456789"),
        lambda: publish_probe(registry, fp, seed=4, signing_key=key, set_live=False),  # forged
    ]
    for n, attempt in enumerate(attempts):
        bad = attempt()
        if n == 2:
            forge_metrics(bad)
            registry.promote(bad)
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
    from worker.errors import ConfigError
    from worker.learning.updater import Updater

    settings = fast(signed)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    updater = Updater(settings, updater_extractor(), redis_ns.client, worker_id="u-signed")
    runner = Threaded(updater.run, updater.stop)
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: registry.stages().live is not None, "a first version")
    runner.stop()
    version = registry.latest()
    assert version is not None
    stored = registry.get(version)
    fp = updater.extractor.fingerprint
    probe_from_bytes(stored.blob, stored.manifest_json, fp, signing_key=settings.signing_key)
    with pytest.raises(CheckpointError, match="signature"):
        probe_from_bytes(stored.blob, stored.manifest_json, fp, signing_key=b"x" * 16)

    # An unsigned newest version: a keyed updater will not resume from it.
    publish_probe(registry, fp, seed=9)
    again = Updater(settings, updater_extractor(), redis_ns.client, worker_id="u-signed-2")
    with pytest.raises(ConfigError, match="unsigned"):
        again._resume()
