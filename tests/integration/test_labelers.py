"""Review M6: the labels topic is not trusted without bounds. One labeler's repeated label
is learned once, a flood past the labeler's limit is quarantined and counted per labeler,
the scorers' cached text wins over a label's own, and one labeler's labels alone cannot
promote a canary. Real broker and Redis."""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr

from schemas import DeadLetter, DecidedRecord, HumanLabel, ProbeDecision, utcnow
from tests.conftest import RedisNamespace
from tests.integration.test_updater import committed, extractor, fast, label
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.kafka.clients import ensure_topics
from worker.learning.labelers import LabelerKeys
from worker.learning.updater import Updater
from worker.rollout.changes import Rollout
from worker.rollout.policy import Policy
from worker.rollout.status import gather, gather_version
from worker.rollout.status_text import render_version
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import join_texts

pytestmark = pytest.mark.integration


def from_mallory(mid: str) -> bytes:
    return json.dumps(
        {
            "message_id": mid,
            "labeler_id": "mallory",
            "label": "toxic",
            "text": "have a nice day",
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


def dropped(updater: Updater, labeler: str, reason: str) -> float:
    return float(updater.metrics.labels_dropped.labels(labeler, reason)._value.get())


def test_a_repeated_label_is_learned_once_and_a_flood_is_quarantined(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    settings = fast(settings, labeler_max_labels=40)
    ensure_topics(settings)
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="u-labelers")
    threads.append(Threaded(updater.run, updater.stop))
    records = [(None, label(i)) for i in range(40)]  # alice: 40 messages, at her limit
    records += [(None, from_mallory("m1"))] * 500  # mallory: one message, 500 times
    records += [(None, from_mallory(f"m-{i}")) for i in range(49)]  # and 49 more messages
    produce_raw(settings, settings.topic_labels, records)
    # mallory's 50 messages: 40 within the limit, 10 quarantined (in any partition order).
    dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= 10, 90)
    letters = [DeadLetter.decode(r.value) for r in dead]
    assert [d.error_kind for d in letters] == ["quarantined"] * 10
    assert all("'mallory'" in d.error_message for d in letters)
    group = settings.updater_group("toxicity")
    wait_until(lambda: committed(settings, group) == len(records), "every label committed", 120)
    assert updater.labels_seen == 40 + 40
    assert dropped(updater, "mallory", "duplicate") == 499
    assert dropped(updater, "mallory", "quarantined") == 10
    assert dropped(updater, "alice", "duplicate") == dropped(updater, "alice", "quarantined") == 0
    newest = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity").latest()
    assert newest is not None
    manifest = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity").manifest(newest)
    assert manifest.counters.labels_seen == 80


def test_the_cached_text_wins_over_the_labels_own(redis_ns: RedisNamespace) -> None:
    redis_ns.client.set(redis_ns.keys.text("m1"), "the text the model judged")
    labels = [
        HumanLabel(
            message_id=mid, labeler_id="mallory", label="toxic", text=text, created_at=utcnow()
        )
        for mid, text in (("m1", "have a nice day"), ("gone", "forgotten by the cache"))
    ]
    got = join_texts(redis_ns.client, redis_ns.keys, labels)
    assert got == ["the text the model judged", "forgotten by the cache"]


def test_one_labelers_labels_alone_do_not_promote_a_canary(redis_ns: RedisNamespace) -> None:
    ex = extractor()
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    publish_probe(registry, ex.fingerprint, seed=1)
    canary = publish_probe(registry, ex.fingerprint, seed=2, set_live=False)
    settings = Settings(redis_prefix=redis_ns.prefix, probes="toxicity", metrics_port=0)
    updater = Updater(settings, ex, redis_ns.client, worker_id="u-evidence")
    rollout = Rollout(registry, updater.evidence, actor="test")
    rollout.start_canary(canary, 0.5, reason="test")
    policy = Policy(mode="canary", promote_min_labels=10, rollback_min_labels=10)
    spec = toxicity_spec(ex.fingerprint.hidden_size)

    def decided(mid: str, d: ProbeDecision) -> None:
        redis_ns.client.set(redis_ns.keys.decided(mid), DecidedRecord(p={"toxicity": d}).encode())

    def credit(mids: list[str], who: str, truth: list[bool]) -> None:
        labels = [
            HumanLabel(
                message_id=m, labeler_id=who, label="toxic" if t else "ok", created_at=utcnow()
            )
            for m, t in zip(mids, truth, strict=True)
        ]
        updater._credit(spec, labels)

    # Live's baseline during the trial, labeled by alice and bob: live is right 3 times in 4.
    base = [f"live-{i}" for i in range(20)]
    for i, m in enumerate(base):
        decided(m, ProbeDecision(v=1, f=i % 2 == 0, c=canary))
    credit(base[:10], "alice", [(i % 2 == 0) != (i % 4 == 3) for i in range(10)])
    credit(base[10:], "bob", [(i % 2 == 0) != (i % 4 == 3) for i in range(10, 20)])
    # Every canary decision labeled first by mallory, with the truth the canary decided.
    mine = [f"canary-{i}" for i in range(20)]
    for i, m in enumerate(mine):
        decided(m, ProbeDecision(v=canary, f=i % 2 == 0))
    credit(mine, "mallory", [i % 2 == 0 for i in range(20)])
    credit(mine, "alice", [i % 2 == 0 for i in range(20)])  # later: not credited, not counted
    decision = rollout.evaluate(policy)
    assert decision.action != "promote", decision.reason
    assert registry.stages().canary == canary
    # `probe status` (and the console's Probes page) shows who the labels come from.
    rows = {r["version"]: r for r in gather(registry, updater.evidence).as_dict()["versions"]}
    assert rows[canary]["labels"] == 20 and rows[canary]["labelers"] == 1
    assert "20 labels from 1 labeler(s)" in render_version(
        gather_version(registry, updater.evidence, canary)
    )
    # A second labeler's own labels on the canary's messages: now it is promoted.
    more = [f"canary-b-{i}" for i in range(4)]
    for i, m in enumerate(more):
        decided(m, ProbeDecision(v=canary, f=i % 2 == 0))
    credit(more, "bob", [i % 2 == 0 for i in range(4)])
    decision = rollout.evaluate(policy)
    assert decision.action == "promote", decision.reason
    assert registry.stages().live == canary


def test_with_labeler_keys_unsigned_labels_are_one_anonymous_labeler(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    """Issue 45: the per-labeler limit and the two-labeler promotion rule trusted the
    labeler_id a producer wrote, so a new id per label defeated both. With
    PROBEGUARD_LABELER_KEYS set, only a signed label is its labeler's."""
    secret = "alice-" + "s" * 26
    settings = fast(settings, labeler_max_labels=10, labeler_keys=SecretStr(f"alice:{secret}"))
    ensure_topics(settings)
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="u-signed")
    threads.append(Threaded(updater.run, updater.stop))
    keys = LabelerKeys.parse(f"alice:{secret}")
    socks = [
        json.dumps(
            {
                "message_id": f"sock-{i}",
                "labeler_id": f"sock-{i}",  # a new id per label
                "label": "toxic",
                "text": "have a nice day",
                "created_at": "2026-11-30T12:00:00Z",
            }
        ).encode()
        for i in range(30)
    ]
    produce_raw(settings, settings.topic_labels, [(None, v) for v in socks])
    signed = [(None, label(i)) for i in range(12)]  # alice's, signed: her own limit of 10
    produce_raw(settings, settings.topic_labels, signed, headers=lambda v: keys.sign("alice", v))
    dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= 22, 90)
    letters = [DeadLetter.decode(r.value) for r in dead]
    assert [d.error_kind for d in letters] == ["quarantined"] * 22
    assert sum("'anonymous'" in d.error_message for d in letters) == 20
    assert sum("'alice'" in d.error_message for d in letters) == 2
    group = settings.updater_group("toxicity")
    wait_until(lambda: committed(settings, group) == 42, "every label committed", 120)
    assert updater.labels_seen == 10 + 10
    assert dropped(updater, "anonymous", "quarantined") == 20
    assert updater.metrics.labels_unsigned._value.get() == 30
