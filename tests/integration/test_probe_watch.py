"""The probe watcher thread against a real Redis: it follows publishes and stage changes
from the event stream, serves immutable snapshots, keeps serving through an outage,
reconnects, and stops without leaving its thread behind."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import redis
import torch

from probes.checkpoint import checkpoint_to_bytes, probe_from_bytes
from probes.probe import build_probe
from tests.conftest import RedisNamespace
from tests.process_helpers import wait_until
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.embedded import EmbeddedRedis, free_port
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.rollout.changes import Rollout
from worker.scoring import probe_watch
from worker.scoring.probe_watch import ProbeWatcher
from worker.scoring.served import ServedProbe
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore
from worker.store.redis import Breaker, Keys

pytestmark = pytest.mark.integration


def no_watcher_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name == "probe-watch" and t.is_alive()]


def test_the_thread_follows_publishes_and_canaries_with_fresh_snapshots(
    redis_ns: RedisNamespace,
) -> None:
    fp = make_tiny_llm().fingerprint
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    v1 = publish_probe(registry, fp, seed=1)
    # The periodic stage check is far off: only the event stream can bring changes in time.
    watcher = ProbeWatcher({"toxicity": registry}, fp, check_interval_s=300, block_ms=200)
    watcher.start()
    try:
        wait_until(lambda: watcher.versions()["toxicity"] == {"live": v1, "canary": None}, "v1")
        before = watcher.slots
        v2 = publish_probe(registry, fp, seed=2, set_live=False)
        rollout = Rollout(registry, EvidenceStore(redis_ns.client, redis_ns.keys), actor="test")
        rollout.start_canary(v2, 0.5, reason="test")
        want = {"live": v1, "canary": v2}
        wait_until(lambda: watcher.versions()["toxicity"] == want, "the canary", 10)
        # A swap replaces the snapshot; the one a batch may still hold never changes.
        assert watcher.slots is not before
        assert before["toxicity"].canary is None and before["toxicity"].canary_share == 0.0
        assert watcher.slots["toxicity"].canary_share == 0.5
        v3 = publish_probe(registry, fp, seed=3)
        wait_until(lambda: watcher.versions()["toxicity"]["live"] == v3, "v3 live", 10)
    finally:
        watcher.stop()
    assert not watcher.watching and no_watcher_threads()


def test_the_thread_serves_through_a_redis_outage_and_reconnects() -> None:
    port = free_port()
    client = redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5, protocol=2
    )
    keys = Keys(f"pgtest-watch-{uuid.uuid4().hex[:8]}")
    registry = CheckpointRegistry(client, keys, "toxicity")
    fp = make_tiny_llm().fingerprint
    blob, manifest = checkpoint_to_bytes(build_probe(toxicity_spec(fp.hidden_size)), llm=fp)
    watcher = ProbeWatcher(
        {"toxicity": registry},
        fp,
        check_interval_s=300,
        block_ms=200,
        breaker=Breaker(cooldown_s=0.2, max_cooldown_s=0.5),
    )
    watcher.serve_bootstrap("toxicity", ServedProbe(*probe_from_bytes(blob, manifest, fp)))
    watcher.start()  # no Redis listens on that port yet
    try:
        wait_until(lambda: not watcher.redis_ok, "the outage to be noticed", 10)
        assert watcher.watching and watcher.versions()["toxicity"]["live"] == 0  # still serving
        with EmbeddedRedis(port=port):
            v1 = publish_probe(registry, fp, seed=1)
            wait_until(lambda: watcher.versions()["toxicity"]["live"] == v1, "reconnected", 20)
            assert watcher.redis_ok
            watcher.stop(timeout_s=5)
    finally:
        watcher.stop()
        client.close()
    assert not watcher.watching and no_watcher_threads()


SIGNING_KEY = b"a-test-key-of-sufficient-length"


def two_probes(redis_ns: RedisNamespace) -> tuple[ProbeWatcher, dict[str, CheckpointRegistry]]:
    """A poll-mode watcher over probes ``a`` (listed first) and ``b``, signed: ``a`` v1 live,
    ``b`` v2 live after v1, each in the watcher's hands."""
    fp = make_tiny_llm().fingerprint
    regs = {
        n: CheckpointRegistry(redis_ns.client, redis_ns.keys, n, signing_key=SIGNING_KEY)
        for n in ("a", "b")
    }
    publish_probe(regs["a"], fp, seed=1, signing_key=SIGNING_KEY)
    for seed in (1, 2):
        publish_probe(regs["b"], fp, seed=seed, signing_key=SIGNING_KEY)
    watcher = ProbeWatcher(regs, fp, signing_key=SIGNING_KEY)
    watcher.refresh(force=True)
    assert watcher.versions() == {
        "a": {"live": 1, "canary": None},
        "b": {"live": 2, "canary": None},
    }
    return watcher, regs


def lives(watcher: ProbeWatcher) -> dict[str, int | None]:
    return {name: v["live"] for name, v in watcher.versions().items()}


def rollback_b(redis_ns: RedisNamespace, regs: dict[str, CheckpointRegistry]) -> None:
    evidence = EvidenceStore(redis_ns.client, redis_ns.keys)
    assert Rollout(regs["b"], evidence, actor="op").rollback_live(reason="bad") == 1


def test_one_probes_unreadable_record_does_not_block_the_others_swaps(
    redis_ns: RedisNamespace,
) -> None:
    """M5: a's live manifest no longer parses. It used to abort the whole sync (in poll
    mode: raise out of the scorer), so b's rollback was never applied."""
    watcher, regs = two_probes(redis_ns)
    redis_ns.client.set(redis_ns.keys.manifest("a", 1), b"{}")
    rollback_b(redis_ns, regs)
    watcher.refresh(force=True)  # raises nothing
    assert watcher.versions() == {
        "a": {"live": 1, "canary": None},
        "b": {"live": 1, "canary": None},
    }
    assert "a" in watcher.failing and "b" not in watcher.failing


def test_out_of_device_memory_loading_one_probe_does_not_block_the_others(
    redis_ns: RedisNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M5: moving a's new version to the device runs out of memory; b's rollback is still
    applied, a keeps v1 and gets v2 at a later check, once memory allows."""
    watcher, regs = two_probes(redis_ns)
    fp = make_tiny_llm().fingerprint
    oom = True
    real = probe_watch.probe_from_bytes

    def loading(*args: Any, **kw: Any) -> Any:
        probe, manifest = real(*args, **kw)
        if manifest.probe == "a" and oom:

            def to(*_: object, **__: object) -> None:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

            probe.to = to  # type: ignore[method-assign,assignment]
        return probe, manifest

    monkeypatch.setattr(probe_watch, "probe_from_bytes", loading)
    a2 = publish_probe(regs["a"], fp, seed=2, signing_key=SIGNING_KEY)
    rollback_b(redis_ns, regs)
    watcher.refresh(force=True)
    assert watcher.versions() == {
        "a": {"live": 1, "canary": None},
        "b": {"live": 1, "canary": None},
    }
    oom = False
    watcher.refresh(force=True)
    assert watcher.versions()["a"]["live"] == a2 and not watcher.failing


def test_stage_changes_after_the_seq_counter_went_back_are_applied(
    redis_ns: RedisNamespace,
) -> None:
    """L3: a Redis failover that lost the last writes, or a snapshot restore, sets the
    stage seq counter back below the seq running scorers have seen. The next signed stage
    change (an operator's rollback) then carried a lower seq, and every running scorer
    ignored it as a replay until restarted."""
    watcher, regs = two_probes(redis_ns)
    assert watcher.stage_seq["b"] >= 2
    stages_key = redis_ns.keys.stages("b")
    before: dict[Any, Any] = redis_ns.client.hgetall(stages_key)
    redis_ns.client.set(redis_ns.keys.stage_seq("b"), 0)  # the counter restored from before
    rollback_b(redis_ns, regs)
    watcher.refresh(force=True)
    assert lives(watcher) == {"a": 1, "b": 1}
    assert "b" not in watcher.untrusted
    # A replay of the record from before the rollback is still refused.
    redis_ns.client.delete(stages_key)
    redis_ns.client.hset(stages_key, mapping=before)
    watcher.refresh(force=True)
    assert lives(watcher) == {"a": 1, "b": 1}
    assert "b" in watcher.untrusted


@pytest.mark.parametrize("serving", ["raw", "chat"])
def test_a_probe_of_the_other_text_form_is_refused_naming_it(
    redis_ns: RedisNamespace, serving: str
) -> None:
    """A scorer in the chat form (PROBEGUARD_TEXT_FORM=chat) serves the probes trained on
    chat-form states and refuses the raw ones, and vice versa: same LLM, other states."""
    llm = make_tiny_llm()
    raw = HiddenStateExtractor(llm, max_tokens=64).fingerprint
    chat = HiddenStateExtractor(llm, max_tokens=64, text_form="chat").fingerprint
    mine, other = (raw, chat) if serving == "raw" else (chat, raw)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    refusals: list[tuple[str, int, str]] = []
    watcher = ProbeWatcher({"toxicity": registry}, mine, on_refused=lambda *r: refusals.append(r))
    good = publish_probe(registry, mine, seed=1)
    watcher.refresh(force=True)
    assert watcher.versions()["toxicity"]["live"] == good
    bad = publish_probe(registry, other, seed=2)
    watcher.refresh(force=True)
    assert watcher.versions()["toxicity"]["live"] == good  # the last good probe serves on
    assert bad in watcher.refused["toxicity"]
    assert [(name, v) for name, v, _ in refusals] == [("toxicity", bad)]
    assert "text_form" in refusals[0][2]
