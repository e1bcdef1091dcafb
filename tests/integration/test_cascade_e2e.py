"""Issue 26's cascade through the real broker and Redis (the tiny LLM): a scorer serving a
probe with an exit head decides confident messages at the exit layer (``depth`` in the
verdict) and the others at full depth; labels make the updater publish a version whose exit
head it trained too, and the scorer serves that one the same way."""

from __future__ import annotations

import pytest
import torch

from probes.checkpoint import probe_from_bytes
from probes.probe import build_probe
from schemas import ExitSpec
from tests.conftest import RedisNamespace
from tests.integration.test_updater import extractor, fast, label, toy_verdicts
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration


def depths(settings: Settings, tag: str, n: int) -> dict[int, int | None]:
    """Score the toy texts 0..n-1 as chat messages: the depth that decided each."""
    return {i: v.results[0].depth for i, v in toy_verdicts(settings, tag, n).items()}


def test_a_cascade_decides_early_and_the_updater_keeps_its_exit_head_current(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    settings = fast(settings, learn_lr=3e-2)  # Lion: 100 steps must train a random head
    ensure_topics(settings)
    ex = extractor()
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    spec = toxicity_spec(ex.hidden_size, layers=[1, 3]).model_copy(
        update={
            "labels": ["non-toxic", "toxic"],  # the toy task's labels
            "exit": ExitSpec(layer=1, temperature=1.0, allow_below=0.5),
        }
    )
    first = publish_probe(registry, ex.fingerprint, probe=build_probe(spec, seed=2))
    old, _ = probe_from_bytes(registry.get(first).blob, registry.get(first).manifest_json, None)
    scorer = Scorer(settings, extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == first, "scorer serves")
    before = depths(settings, "a", 16)

    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    # 800 labels (100 steps): with 160 the head separated the styles by under 0.1 and the
    # toxic texts sat near allow_below (0.49-0.55), so under load it allowed them at layer
    # 1; with 800 both styles clear it by 0.17 or more.
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(800)])
    wait_until(lambda: updater.labels_seen >= 800 and updater.unpublished == 0, "labels published")
    last = registry.stages().live
    assert last is not None and last > first
    new, _ = probe_from_bytes(registry.get(last).blob, registry.get(last).manifest_json, None)
    assert new.spec.exit == spec.exit  # carried through every version
    assert new.exit_head is not None and old.exit_head is not None
    moved = [
        not torch.equal(a, b)
        for a, b in zip(old.exit_head.parameters(), new.exit_head.parameters(), strict=True)
    ]
    assert any(moved)  # the Lion steps trained the exit head on the labels
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == last, "scorer swap")
    after = depths(settings, "b", 32)
    # Trained on the toy task, the exit head is confident on the clean texts (even i):
    # they are decided at layer 1; the others run to full depth. The random head of v1
    # was confident on none of them.
    assert after == {i: 1 if i % 2 == 0 else None for i in range(32)}, after
    assert list(before.values()).count(1) < 8, before
