"""Canary rollout end to end: real broker, real Redis, scorers and the updater's policy.

Probes are trained offline on a toy task the tiny random LLM separates perfectly:
``good`` learns it, ``flipped`` learns the opposite labels, ``flag_all`` learns to
flag everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from probes.decision import decide
from probes.kinds.pooling import masked_mean
from probes.learner import Learner
from probes.probe import Probe, build_probe
from schemas import Verdict
from tests.conftest import RedisNamespace
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import num, publish_probe, toxicity_spec
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm, settings_env
from worker.rollout.changes import Rollout
from worker.scoring.scorer import Scorer
from worker.scoring.served import sticky_fraction
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore

pytestmark = pytest.mark.integration

GOOD = ["what a lovely day", "thanks, that helps", "see you tomorrow", "nice work team"]
BAD = ["XXXX ZZZZ QQQQ!!!", "ZZZZ XXXX #### !!!", "QQQQ #### XXXX ZZZZ", "!!!! XXXX QQQQ"]
LAYERS = (1, 2)


def toy(i: int) -> tuple[str, bool]:
    """Text number ``i`` and whether it deserves a flag (odd ones do)."""
    return (f"{BAD[i % 4]} {i}", True) if i % 2 else (f"{GOOD[i % 4]} {i}", False)


@pytest.fixture(scope="module")
def ex() -> HiddenStateExtractor:
    """One tiny LLM shared by every scorer and updater of a test (it serializes calls).

    Building one per worker would race: ``make_tiny_llm`` seeds torch's global RNG
    while already running workers draw from it (a probe's random init before loading),
    and a different RNG state means different weights and another fingerprint.
    """
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=16)


def train(ex: HiddenStateExtractor, target: Callable[[bool], int], seed: int) -> Probe:
    texts = [toy(i) for i in range(64)]
    got = ex.extract([t for t, _ in texts], LAYERS)
    hidden, mask = got.hidden.float(), got.mask  # [L, B, T, D], [B, T]
    y = torch.tensor([target(flag) for _, flag in texts])
    probe = build_probe(toxicity_spec(ex.hidden_size), seed=seed)
    with torch.no_grad():
        pooled = masked_mean(hidden, mask)  # [L, B, D], the probe's (mean) pooling
    probe.set_input_stats(pooled.mean(dim=1), pooled.std(dim=1))
    learner = Learner(probe, lr=3e-3)
    for _ in range(60):
        learner.learn_many(hidden, mask, y)
    return probe.eval()


@pytest.fixture(scope="module")
def probes(ex: HiddenStateExtractor) -> dict[str, Probe]:
    return {
        "good": train(ex, lambda flag: int(flag), seed=0),
        "good2": train(ex, lambda flag: int(flag), seed=1),
        "flipped": train(ex, lambda flag: 1 - int(flag), seed=2),
        "flag_all": _flag_everything(train(ex, lambda flag: 1, seed=3)),
    }


def _flag_everything(probe: Probe) -> Probe:
    """Make sure the 'flag everything' probe really flags everything, whatever training did."""
    with torch.no_grad():
        probe.head.bias[1] += 50.0
    return probe


def chat(mid: str, i: int, conv: str) -> bytes:
    return json.dumps(
        {
            "message_id": mid,
            "conversation_id": conv,
            "text": toy(i)[0],
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


def label(mid: str, i: int) -> bytes:
    body = {
        "message_id": mid,  # no text: joined from the scorers' cache
        "label": "toxic" if toy(i)[1] else "ok",
        "labeler_id": ("alice", "bob")[i % 2],  # a promotion needs two labelers (review M6)
        "created_at": "2026-11-30T12:00:00Z",
    }
    return json.dumps(body).encode()


def tuned(settings: Settings, **kw: object) -> Settings:
    base = {
        "rollout": "canary",
        "stage_check_interval_s": 0.5,
        "rollout_check_interval_s": 0.2,
        "publish_every_labels": 100_000,  # the updater only judges here; it never publishes
        "publish_every_s": 3600.0,
        "lease_ttl_ms": 2000,
        "metrics_port": 0,
        "review_audit_share": 0.0,
        "batch_size": 8,
    }
    return settings.model_copy(update={**base, **kw})


def start_scorer(
    settings: Settings,
    ex: HiddenStateExtractor,
    redis_ns: RedisNamespace,
    running: list[Threaded],
    n: int,
) -> Scorer:
    scorer = Scorer(settings, ex, redis_ns.client, worker_id=f"scorer-{n}")
    running.append(Threaded(scorer.run, scorer.stop))
    return scorer


def start_updater(
    settings: Settings, ex: HiddenStateExtractor, redis_ns: RedisNamespace, running: list[Threaded]
) -> Updater:
    updater = Updater(settings, ex, redis_ns.client, worker_id="updater-a")
    running.append(Threaded(updater.run, updater.stop))
    return updater


def send_chats(settings: Settings, tag: str, n: int, convs: int = 40) -> list[str]:
    ids = [f"{tag}-{i}" for i in range(n)]
    records = [(m.encode(), chat(m, i, f"{tag}-c{i % convs}")) for i, m in enumerate(ids)]
    produce_raw(settings, settings.topic_chat, records)
    return ids


def verdicts_for(settings: Settings, ids: list[str], timeout_s: float = 90) -> dict[str, Verdict]:
    want = set(ids)
    records = drain(
        settings,
        settings.topic_verdicts,
        lambda rs: want <= {r.key.decode() for r in rs},
        timeout_s,
    )
    got = {r.key.decode(): Verdict.decode(r.value) for r in records}
    assert want <= set(got), f"{len(want - set(got))} verdicts missing"
    return {m: got[m] for m in ids}


def serving(scorer: Scorer) -> dict[str, int | None]:
    return scorer.watcher.versions()["toxicity"]


# --- the tests ---------------------------------------------------------------------


def test_flag_everything_canary_is_rolled_back_while_live_keeps_serving(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], probes, ex
) -> None:
    settings = tuned(
        settings,
        canary_share=0.5,
        rollback_min_messages=20,
        rollback_flag_rate_factor=1.5,
    )
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    fp = ex.fingerprint
    v1 = publish_probe(registry, fp, probe=probes["good"])
    v2 = publish_probe(registry, fp, probe=probes["flag_all"], set_live=False)
    scorer = start_scorer(settings, ex, redis_ns, threads, 1)
    start_updater(settings, ex, redis_ns, threads)

    wait_until(lambda: registry.stages().canary == v2, "the policy to trial the candidate")
    wait_until(lambda: serving(scorer)["canary"] == v2, "the scorer to serve the canary")
    ids = send_chats(settings, "a", 80)
    got = verdicts_for(settings, ids)
    wait_until(lambda: v2 in registry.rolled_back(), "the automatic rollback")

    st = registry.stages()
    assert (st.live, st.canary) == (v1, None)
    event = next(e for _, e in reversed(registry.history(20)) if e.kind == "rolled_back")
    assert event.version == v2 and event.actor == "updater-a"
    assert "flag rate" in event.reason and "k=1.5" in event.reason
    assert event.details["stage"] == "canary" and event.details["canary_flag_rate"] == 1.0
    assert registry.rolled_back()[v2] == event.reason
    # Live traffic kept the good version: every message outside the canary's share of
    # conversations was decided by v1, correctly; the canary flagged all of its own.
    for i, mid in enumerate(ids):
        r = got[mid].results[0]
        if r.canary:
            assert r.version == v2 and r.flagged
        else:
            assert r.version == v1 and r.flagged == toy(i)[1]
    assert 0 < sum(v.results[0].canary for v in got.values()) < len(ids)
    # After the rollback nobody is served the canary any more.
    wait_until(lambda: serving(scorer)["canary"] is None, "the scorer to drop the canary")
    later = verdicts_for(settings, send_chats(settings, "b", 20))
    assert {v.results[0].version for v in later.values()} == {v1}
    assert registry.stages().canary is None  # v2 is never put on trial again


def test_refused_canary_is_rolled_back_as_an_error(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], probes, ex
) -> None:
    settings = tuned(settings)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    fp = ex.fingerprint
    v1 = publish_probe(registry, fp, probe=probes["good"])
    scorer = start_scorer(settings, ex, redis_ns, threads, 1)
    wait_until(lambda: serving(scorer)["live"] == v1, "the scorer to serve live")
    updater = start_updater(settings, ex, redis_ns, threads)
    wait_until(lambda: updater.learner is not None, "the updater to resume from v1")
    other = fp.model_copy(update={"model_id": "some-other-llm"})
    v2 = publish_probe(registry, other, probe=probes["good2"], set_live=False)
    wait_until(lambda: v2 in registry.rolled_back(), "the rollback of a refused canary")
    reason = registry.rolled_back()[v2]
    assert "refused by 1 scorer(s)" in reason and "scorer-1" in reason and "model_id" in reason
    assert registry.stages().live == v1 and serving(scorer) == {"live": v1, "canary": None}


def test_one_misconfigured_scorer_does_not_roll_back_every_canary(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], probes, ex
) -> None:
    # Review C8 part 2: a single scorer with the wrong model (mid-upgrade, or a wrong
    # PROBEGUARD_MODEL) refused every canary, and its refusal rolled each one back.
    # Another scorer loads it: the trial goes on.
    settings = tuned(settings)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    fp = ex.fingerprint
    v1 = publish_probe(registry, fp, probe=probes["good"])
    right = start_scorer(settings, ex, redis_ns, threads, 1)
    other_model = HiddenStateExtractor(make_tiny_llm(seed=5), max_tokens=64, batch_size=16)
    wrong = start_scorer(settings, other_model, redis_ns, threads, 2)
    wait_until(lambda: serving(right)["live"] == v1, "the right scorer to serve live")
    wait_until(lambda: v1 in wrong.watcher.refused["toxicity"], "the wrong one to refuse v1")
    start_updater(settings, ex, redis_ns, threads)
    v2 = publish_probe(registry, fp, probe=probes["good2"], set_live=False)
    wait_until(lambda: serving(right)["canary"] == v2, "the right scorer to serve the canary")
    wait_until(lambda: v2 in wrong.watcher.refused["toxicity"], "the wrong one to refuse it")
    policy_key = registry.keys.policy("toxicity")
    wait_until(
        lambda: b"loaded by" in (redis_ns.client.hget(policy_key, "note") or b""),
        "the policy to weigh the refusal against the load",
    )
    assert v2 not in registry.rolled_back()
    assert registry.stages().canary == v2


def test_labels_roll_back_a_flipped_canary_and_promote_a_good_one(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], probes, ex
) -> None:
    settings = tuned(
        settings,
        canary_share=0.5,
        rollback_min_messages=100_000,  # judge on labels only here
        rollback_min_labels=15,
        promote_min_labels=30,
    )
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    evidence = EvidenceStore(redis_ns.client, redis_ns.keys)
    fp = ex.fingerprint
    v1 = publish_probe(registry, fp, probe=probes["good"])
    v2 = publish_probe(registry, fp, probe=probes["flipped"], set_live=False)
    scorer = start_scorer(settings, ex, redis_ns, threads, 1)
    start_updater(settings, ex, redis_ns, threads)

    def trial(tag: str, version: int, done: Callable[[], bool], what: str) -> None:
        wait_until(lambda: registry.stages().canary == version, f"v{version} on trial")
        wait_until(lambda: serving(scorer)["canary"] == version, f"the scorer to serve v{version}")
        ids = send_chats(settings, tag, 100)
        verdicts_for(settings, ids)  # decided and cached before the labels come
        produce_raw(
            settings, settings.topic_labels, [(m.encode(), label(m, i)) for i, m in enumerate(ids)]
        )
        wait_until(done, what)

    trial("f", v2, lambda: v2 in registry.rolled_back(), "the flipped canary's rollback")
    event = next(e for _, e in reversed(registry.history(20)) if e.kind == "rolled_back")
    assert event.version == v2 and "F1" in event.reason and "δ=0.05" in event.reason
    assert num(event.details["canary_f1"]) < 0.2 and num(event.details["live_f1"]) > 0.9
    assert registry.stages().live == v1

    v3 = publish_probe(registry, fp, probe=probes["good2"], set_live=False)
    trial("g", v3, lambda: registry.stages().live == v3, "the good canary's promotion")
    event = next(e for _, e in reversed(registry.history(20)) if e.kind == "promoted")
    assert event.version == v3 and event.previous == v1 and "within ε=0.02" in event.reason
    assert num(event.details["canary_labels"]) >= 30 and num(event.details["canary_f1"]) > 0.9
    ev3 = evidence.read("toxicity", v3)
    assert ev3.labels.labeled >= 30 and ev3.baseline_labels.labeled > 0
    assert v3 not in registry.rolled_back() and registry.stages().canary is None
    wait_until(lambda: serving(scorer) == {"live": v3, "canary": None}, "the promotion served")


def test_shadow_mode_never_changes_a_decision(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], probes, ex
) -> None:
    settings = tuned(settings, shadow=True, rollout="manual")
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    evidence = EvidenceStore(redis_ns.client, redis_ns.keys)
    v1 = publish_probe(registry, ex.fingerprint, probe=probes["good"])
    v2 = publish_probe(registry, ex.fingerprint, probe=probes["flipped"], set_live=False)
    Rollout(registry, evidence, actor="test").start_canary(v2, 1.0, reason="all in shadow")
    scorer = start_scorer(settings, ex, redis_ns, threads, 1)
    wait_until(lambda: serving(scorer) == {"live": v1, "canary": v2}, "live and canary served")

    ids = send_chats(settings, "s", 60)
    got = verdicts_for(settings, ids)
    texts = [toy(i)[0] for i in range(60)]
    out = ex.extract(texts, LAYERS)
    live_alone = decide(
        probes["good"].spec, probes["good"].predict_proba_many(out.hidden.float(), out.mask)
    ).flagged.tolist()
    for i, mid in enumerate(ids):
        v = got[mid]
        r = v.results[0]
        assert (r.version, r.canary) == (v1, False)  # live decided every message
        assert r.flagged == live_alone[i] == toy(i)[1]
        assert v.decision == ("flag" if live_alone[i] else "allow")
        assert r.shadow is not None and r.shadow.version == v2
        assert r.shadow.predicted == ["ok" if toy(i)[1] else "toxic"]  # it disagreed, unheard
    ev2 = evidence.read("toxicity", v2)
    assert ev2.messages == 0 and ev2.shadow_messages == 60 and ev2.shadow_agree == 0
    assert ev2.baseline_messages == 60


def test_sticky_split_and_cli_rollback_on_every_scorer(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], probes, ex, tmp_path
) -> None:
    settings = tuned(settings, rollout="manual", stage_check_interval_s=5.0)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    fp = ex.fingerprint
    v1 = publish_probe(registry, fp, probe=probes["good"])
    v2 = publish_probe(registry, fp, probe=probes["good2"], set_live=False)
    v3 = publish_probe(registry, fp, probe=probes["flag_all"], set_live=False)
    scorers = [start_scorer(settings, ex, redis_ns, threads, n) for n in (1, 2)]
    env = settings_env(settings, tmp_path)

    def cli(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "worker.cli", "probe", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def converge(live: int, canary: int | None, what: str) -> float:
        t0 = time.monotonic()
        want = {"live": live, "canary": canary}
        wait_until(lambda: all(serving(s) == want for s in scorers), what, 10)
        return time.monotonic() - t0

    converge(v1, None, "both scorers on v1")
    cli("promote", str(v2), "--reason", "ship it")
    converge(v2, None, "both scorers on v2")
    cli("canary", str(v3), "--share", "0.3")
    converge(v2, v3, "both scorers serving the canary")

    # The split: one version per conversation, exactly the conversations the hash picks.
    ids = send_chats(settings, "m", 240, convs=60)
    got = verdicts_for(settings, ids)
    versions_of: dict[str, set[int]] = defaultdict(set)
    for v in got.values():
        assert v.conversation_id is not None
        versions_of[v.conversation_id].add(v.results[0].version)
    assert all(len(vs) == 1 for vs in versions_of.values())
    on_canary = {c for c, vs in versions_of.items() if vs == {v3}}
    assert on_canary == {c for c in versions_of if sticky_fraction(c, "toxicity") < 0.3}
    assert 0.1 < len(on_canary) / len(versions_of) < 0.5
    assert {w for v in got.values() for w in [v.worker_id]} == {"scorer-1", "scorer-2"}

    out = cli("rollback", "--reason", "v2 misbehaves")
    assert f"v{v1} is live again; v{v2} rolled back" in out
    took = converge(v1, v3, "both scorers back on v1")
    # Idle scorers poll every 200 ms and follow the event stream between polls.
    assert took < 3.0, f"rollback took {took:.2f}s to reach every scorer"
    st = registry.stages()
    assert st.live == v1 and st.pinned and v2 in registry.rolled_back()
    event = registry.history(1)[0][1]
    assert (event.kind, event.version, event.details["restored"]) == ("rolled_back", v2, v1)
    assert event.reason == "v2 misbehaves"

    status = cli("status")
    print(status)
    assert f"live v{v1}, canary v{v3} (30% of conversations), PINNED" in status
    assert all(len(line) <= 80 for line in status.splitlines())
