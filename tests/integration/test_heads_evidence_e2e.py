"""Per-head evidence end to end, through the real broker and Redis on the tiny LLM: a
multi-head live and canary, the scorer counting each head's messages and flags per version,
the updater crediting labels for two heads to each head of the version that decided, and
the rollout policy rolling the canary back on the one head whose flag rate departs."""

from __future__ import annotations

import json

import pytest

from probes.probe import Probe, build_probe
from schemas import HeadSpec, ProbeSpec, Verdict
from tests.conftest import RedisNamespace
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import num, publish_probe
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.rollout.changes import Rollout
from worker.rollout.policy import Policy
from worker.scoring.scorer import Scorer
from worker.scoring.served import sticky_fraction
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore
from worker.store.evidence_counts import Confusion

pytestmark = pytest.mark.integration

N = 32  # messages, one conversation each


@pytest.fixture(scope="module")
def ex() -> HiddenStateExtractor:
    """One tiny LLM for the scorer and the updater (see test_rollout.ex)."""
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=16)


def two_heads(ex: HiddenStateExtractor, thresholds: dict[str, float], seed: int) -> Probe:
    spec = ProbeSpec(
        name="toxicity",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=ex.hidden_size,
        task="multilabel",
        labels=["non-toxic", "toxic", "spam"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
            HeadSpec(name="spam", task="multilabel", labels=["spam"]),
        ],
        flag_labels=["toxic", "spam"],
        thresholds=thresholds,
    )
    return build_probe(spec, seed=seed).eval()


def chats(settings: Settings) -> list[Verdict]:
    """Message ``m-i`` in conversation ``m-ci``; their verdicts."""
    body = {"text": "", "created_at": "2026-12-01T12:00:00Z"}
    records = [
        (f"m-{i}".encode(), json.dumps(body | {
            "message_id": f"m-{i}", "conversation_id": f"m-c{i}", "text": f"message number {i}"
        }).encode())
        for i in range(N)
    ]  # fmt: skip
    produce_raw(settings, settings.topic_chat, records)
    got = drain(settings, settings.topic_verdicts, lambda rs: len({r.key for r in rs}) >= N, 60)
    return list({r.key: Verdict.decode(r.value) for r in got}.values())  # one per message


def label(i: int) -> bytes:
    """Even messages get a toxicity label as single-head deployments send them, odd ones a
    label for the spam head alone (``[]``: not spam); no text: joined from the cache."""
    body: dict[str, object] = {
        "message_id": f"m-{i}",
        "labeler_id": "alice",
        "created_at": "2026-12-01T12:00:00Z",
    }
    if i % 2 == 0:
        body["label"] = "toxic" if i % 4 == 0 else "non-toxic"
    else:
        body |= {"head": "spam", "labels": ["spam"] if i % 4 == 1 else []}
    return json.dumps(body).encode()


def expected_confusion(ids: list[int], head: str, flags: bool) -> Confusion:
    """The cells of a head that flags every message (``flags``) or none, on ``ids``'s labels."""
    mine = [i for i in ids if (i % 2 == 0) == (head == "toxicity")]
    positive = sum(1 for i in mine if i % 4 in (0, 1))
    negative = len(mine) - positive
    if flags:
        return Confusion(tp=positive, fp=negative)
    return Confusion(fn=positive, tn=negative)


def test_scorer_and_updater_keep_evidence_per_head_and_the_policy_names_the_broken_head(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], ex: HiddenStateExtractor
) -> None:
    settings = settings.model_copy(
        update={
            "rollout": "manual",  # the test applies the policy itself, at the end
            "flag_heads": "toxicity",  # spam scores but does not flag a verdict
            "default_probe": False,
            "stage_check_interval_s": 0.5,
            "publish_every_labels": 100_000,  # the updater only credits labels here
            "publish_every_s": 3600.0,
            "lease_ttl_ms": 2000,
            "metrics_port": 0,
            "review_audit_share": 0.0,
        }
    )
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    evidence = EvidenceStore(redis_ns.client, redis_ns.keys)
    fp = ex.fingerprint
    # Both versions flag every message for toxicity; the canary's spam head flags every
    # message too, live's none: the verdicts' flag rates agree, the spam head's do not.
    live = publish_probe(registry, fp, probe=two_heads(ex, {"toxic": 0.0, "spam": 1.0}, 0))
    canary_probe = two_heads(ex, {"toxic": 0.0, "spam": 0.0}, 1)
    canary = publish_probe(registry, fp, probe=canary_probe, set_live=False)
    Rollout(registry, evidence, actor="test").start_canary(canary, 0.5, reason="test")
    scorer = Scorer(settings, ex, redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    wait_until(
        lambda: scorer.watcher.versions()["toxicity"] == {"live": live, "canary": canary},
        "the scorer to serve live and canary",
    )

    verdicts = chats(settings)
    assert len(verdicts) == N
    on_canary = [i for i in range(N) if sticky_fraction(f"m-c{i}", "toxicity") < 0.5]
    on_live = [i for i in range(N) if i not in on_canary]
    assert on_canary and on_live
    for v in verdicts:
        (result,) = v.results
        i = int(v.message_id.split("-")[1])
        assert result.version == (canary if i in on_canary else live)
        assert result.flagged and v.decision == "flag"  # toxicity flags, on either version
    # Evidence is counted once the verdicts' batch is acknowledged and committed, a moment
    # after the verdicts can be read: wait for the total, then check it is exact.
    wait_until(
        lambda: sum(evidence.read("toxicity", v).messages for v in (live, canary)) >= N,
        "every verdict's evidence recorded",
        timeout_s=60,
    )
    lv, cv = evidence.read("toxicity", live), evidence.read("toxicity", canary)
    assert (lv.messages, lv.flags) == (len(on_live), len(on_live))
    assert (cv.messages, cv.flags) == (len(on_canary), len(on_canary))
    assert {h: (c.messages, c.flags) for h, c in lv.heads.items()} == {
        "toxicity": (len(on_live), len(on_live)),
        "spam": (len(on_live), 0),
    }
    assert {h: (c.messages, c.flags) for h, c in cv.heads.items()} == {
        "toxicity": (len(on_canary), len(on_canary)),
        "spam": (len(on_canary), len(on_canary)),
    }
    assert (cv.heads["spam"].baseline_messages, cv.heads["spam"].baseline_flags) == (
        len(on_live),
        0,
    )

    updater = Updater(settings, ex, redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    produce_raw(settings, settings.topic_labels, [(f"m-{i}".encode(), label(i)) for i in range(N)])

    def credited() -> int:
        """Labels credited per head to the version that decided (each label once)."""
        lv, cv = evidence.read("toxicity", live), evidence.read("toxicity", canary)
        return sum(c.labels.labeled for e in (lv, cv) for c in e.heads.values())

    wait_until(lambda: credited() == N, "every label credited to its head", timeout_s=90)
    lv, cv = evidence.read("toxicity", live), evidence.read("toxicity", canary)
    assert lv.heads["toxicity"].labels == expected_confusion(on_live, "toxicity", flags=True)
    assert lv.heads["spam"].labels == expected_confusion(on_live, "spam", flags=False)
    assert cv.heads["toxicity"].labels == expected_confusion(on_canary, "toxicity", flags=True)
    assert cv.heads["spam"].labels == expected_confusion(on_canary, "spam", flags=True)
    # Live's decisions during the trial are the canary's per-head baseline.
    assert cv.heads["spam"].baseline_labels == expected_confusion(on_live, "spam", flags=False)

    policy = Policy(mode="canary", rollback_min_messages=4, rollback_head_min_flags=4)
    decision = Rollout(registry, evidence, actor="test").evaluate(policy)
    assert (decision.action, decision.version) == ("rollback", canary)
    assert decision.reason.startswith("head spam: flag rate") and decision.numbers["k"] == 2.0
    assert num(decision.numbers["flag_rate_factor"]) < 1.1  # the verdicts' rates agree
    assert registry.stages().canary is None and canary in registry.rolled_back()
