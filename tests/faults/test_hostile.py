"""Hostile input and bad days: every input accounted for, nothing stalls.

Like test_faults.py, each test owns its broker and Redis and adds a row to the summary
table. Rows about labels count "verdicts" as labels learned (reflected in a published
version) and "dead letters" as labels dead-lettered.
"""

from __future__ import annotations

import base64
import hashlib
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from kafka import KafkaConsumer
from pydantic import SecretStr

from schemas import DeadLetter
from tests.faults.accounting import Row, Tally, record
from tests.faults.conftest import Stack
from tests.faults.test_faults import chats, extractor, labels, registry, roles
from tests.integration.test_updater import chat, committed, fast, spam_label
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, spawn, wait_until
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.embedded import EmbeddedRedis
from worker.kafka.clients import client_config, make_producer
from worker.learning.updater import Updater
from worker.llm.tiny import settings_env
from worker.rollout.changes import Rollout
from worker.scoring.scorer import Scorer
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore
from worker.store.redis import Keys, make_redis

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]


def dead_letters(stack: Stack, n: int, timeout_s: float = 30) -> list[tuple[bytes, DeadLetter]]:
    """The first ``n`` records of the dead-letter topic: raw value and decoded letter."""
    s = stack.settings
    consumer = KafkaConsumer(s.topic_dead_letter, **client_config(s), auto_offset_reset="earliest")
    out: list[tuple[bytes, DeadLetter]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n and time.monotonic() < deadline:
            for rs in consumer.poll(timeout_ms=200).values():
                out += [(r.value, DeadLetter.decode(r.value)) for r in rs]
    finally:
        consumer.close()
    return out


def learned(reg: CheckpointRegistry) -> int:
    latest = reg.latest()
    return 0 if latest is None else reg.manifest(latest).counters.labels_seen


# --- hostile payloads ------------------------------------------------------------------


def test_oversized_and_garbage_payloads_on_every_partition(
    stack: Stack, threads: list[Threaded]
) -> None:
    # The operator's scenario: 900 KB on each partition used to stall it for
    # good (a dead letter over the producer's 1 MiB limit, retried forever).
    s = stack.settings
    scorer = Scorer(s, extractor(), make_redis(s), worker_id="scorer-f")
    publish_probe(registry(s), scorer.extractor.fingerprint)
    threads.append(Threaded(scorer.run, scorer.stop))
    big_text = chat("big", "x" * 900_000)
    garbage = b"\xff" + b"garbage " * 112_500
    records: list[tuple[int, bytes, bytes]] = []
    for p in range(s.topic_partitions):
        records += [(p, f"big-{p}".encode(), big_text), (p, f"junk-{p}".encode(), garbage)]
    ordinary = chats("o", 0, 60)
    producer = make_producer(s, max_request_size=2 * 1024 * 1024)
    try:
        futures = [producer.send(s.topic_chat, key=k, value=v, partition=p) for p, k, v in records]
        futures += [producer.send(s.topic_chat, key=k, value=v) for k, v in ordinary]
        for f in futures:
            f.get(timeout=30)
    finally:
        producer.close()
    keys = {k.decode() for k, _ in ordinary} | {k.decode() for _, k, _ in records}
    with Tally(s) as tally:
        out = tally.settle(keys, timeout_s=120)
    missing = out.missing(keys)
    assert not missing, sorted(missing)[:5]
    letters = dead_letters(stack, len(records))
    assert len(letters) == len(records)
    largest = max(len(raw) for raw, _ in letters)
    assert largest < 100_000
    for _, letter in letters:
        whole = big_text if letter.error_kind == "schema" else garbage
        assert letter.payload_size == len(whole)
        assert letter.payload_sha256 == hashlib.sha256(whole).hexdigest()
        assert whole.startswith(base64.b64decode(letter.payload_b64))
    assert scorer.health.ready_check()[0]
    record(
        Row(
            "900 KB text + 900 KB garbage on every partition",
            len(keys),
            len(out.verdicts),
            len(out.dead),
            len(missing),
            f"letters bounded (largest {largest // 1024} KiB, payload size + sha256 kept)",
        )
    )


def test_nan_scores_in_one_row_cost_that_row(stack: Stack, threads: list[Threaded]) -> None:
    s = stack.settings
    scorer = Scorer(s, extractor(), make_redis(s), worker_id="scorer-f")
    publish_probe(registry(s), scorer.extractor.fingerprint)
    extract = scorer.extractor.extract

    def overflowing(texts: Any, layers: Any) -> Any:
        """Hidden states that are NaN for texts with a marker (an fp16 overflow, say)."""
        ex = extract(texts, layers)
        for row, pos in enumerate(ex.index):
            if "overflow" in texts[pos]:
                ex.hidden[:, row] = float("nan")
        return ex

    scorer.extractor.extract = overflowing  # type: ignore[method-assign]
    threads.append(Threaded(scorer.run, scorer.stop))
    sent = [
        (k, chat(k.decode(), "an overflow here" if i % 20 == 0 else "an ordinary message"))
        for i, (k, _) in enumerate(chats("n", 0, 200))
    ]
    produce_raw(s, s.topic_chat, sent)
    keys = {k.decode() for k, _ in sent}
    with Tally(s) as tally:
        out = tally.settle(keys, timeout_s=120)
    missing = out.missing(keys)
    bad = {f"n-{i}" for i in range(0, 200, 20)}
    assert not missing and set(out.dead) == bad and not bad & set(out.verdicts)
    kinds = {letter.error_kind for _, letter in dead_letters(stack, len(bad))}
    assert kinds == {"unscorable"}
    record(
        Row(
            "NaN scores in one row of a batch",
            len(keys),
            len(out.verdicts),
            len(out.dead),
            len(missing),
            "only the NaN rows dead-lettered (unscorable); their batches scored",
        )
    )


# --- the updater -----------------------------------------------------------------------


def test_sigterm_during_warm_up_publishes_and_commits_nothing(
    stack: Stack, threads: list[Threaded]
) -> None:
    s = fast(stack.settings, stats_warmup=40, publish_every_labels=8)
    reg = registry(s)
    first = Updater(s, extractor(), make_redis(s), worker_id="updater-a")
    running = Threaded(first.run, first.stop)
    produce_raw(s, s.topic_labels, labels(0, 20))
    wait_until(
        lambda: first.learner is not None and len(first.learner.warmup or []) == 20,
        "twenty labels in the warm-up",
    )
    running.stop()  # what SIGTERM does
    assert reg.versions() == [] and committed(s, s.updater_group("toxicity")) == 0
    second = Updater(s, extractor(), make_redis(s), worker_id="updater-b")
    threads.append(Threaded(second.run, second.stop))
    produce_raw(s, s.topic_labels, labels(20, 40))
    wait_until(lambda: learned(reg) >= 40, "the warm-up completed by the next updater")
    latest = reg.latest()
    assert latest is not None
    n = learned(reg)
    record(
        Row(
            "SIGTERM during the updater's stats warm-up",
            40,
            n,
            0,
            40 - n,
            f"nothing published or committed at the stop; v{latest} from all 40 after",
        )
    )


def test_sigstop_of_the_active_updater_past_its_lease(
    stack: Stack, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    s = fast(stack.settings)
    path, _ = model_dir
    reg = registry(s)
    env = settings_env(
        s,
        path,
        publish_every_labels=16,
        publish_every_s=1,
        stats_warmup=16,
        learn_batch_size=16,
        lease_ttl_ms=2000,
    )
    logs = {n: tmp_path / f"{n}.log" for n in ("upd-a", "upd-b")}
    procs = {
        n: spawn("train", {**env, "PROBEGUARD_WORKER_ID": n}, logs[n]) for n in ("upd-a", "upd-b")
    }
    try:
        produce_raw(s, s.topic_labels, labels(0, 48))
        wait_until(lambda: learned(reg) >= 48, "the first labels published", 120)
        holder = reg.history(1)[0][1].actor
        other = next(n for n in procs if n != holder)
        procs[holder].send_signal(signal.SIGSTOP)
        stopped_at = reg.latest()
        produce_raw(s, s.topic_labels, labels(48, 96))
        wait_until(
            lambda: any(e.actor == other for _, e in reg.history(50) if e.kind == "published"),
            "the standby to take over and publish",
            120,
        )
        procs[holder].send_signal(signal.SIGCONT)
        wait_until(
            lambda: "updater_lease lost" in logs[holder].read_text(), "the old holder to see it"
        )
        produce_raw(s, s.topic_labels, labels(96, 112))
        wait_until(lambda: learned(reg) >= 112, "every label in a published version", 120)
        after = [
            e
            for _, e in reg.history(200)
            if e.kind == "published" and e.version is not None and e.version > (stopped_at or 0)
        ]
        assert {e.actor for e in after} == {other}, [(e.version, e.actor) for e in after]
        n = learned(reg)
        record(
            Row(
                "SIGSTOP the active updater past its lease",
                112,
                min(n, 112),
                0,
                max(0, 112 - n),
                f"{other} took over; the resumed {holder} published nothing",
            )
        )
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def test_two_probes_two_updaters_each_learn_all_their_labels(
    stack: Stack, threads: list[Threaded], tmp_path: Path
) -> None:
    s = fast(stack.settings, probes="toxicity,spam", publish_every_labels=1000)
    spec = tmp_path / "spam.json"
    spec.write_text(
        toxicity_spec(extractor().hidden_size, name="spam")
        .model_copy(update={"labels": ["ham", "spam"], "flag_labels": ["spam"]})
        .model_dump_json()
    )
    for name, extra in (("toxicity", {}), ("spam", {"seed_spec": spec})):
        settings = s.model_copy(update={"train_probe": name, **extra})
        u = Updater(settings, extractor(), make_redis(s), worker_id=f"updater-{name}")
        threads.append(Threaded(u.run, u.stop))
    n = 40
    produce_raw(s, s.topic_labels, labels(0, n) + [(None, spam_label(i)) for i in range(n)])
    regs = {
        name: CheckpointRegistry(make_redis(s), Keys(s.redis_prefix), name)
        for name in ("toxicity", "spam")
    }
    wait_until(lambda: all(learned(r) >= n for r in regs.values()), "both probes", 120)
    got = {name: learned(r) for name, r in regs.items()}
    assert got == {"toxicity": n, "spam": n}
    record(
        Row(
            "two probes, two updaters, one label topic",
            2 * n,
            sum(got.values()),
            0,
            2 * n - sum(got.values()),
            "each probe learned 100 % of its labels (own consumer group)",
        )
    )


# --- a full text cache -----------------------------------------------------------------


def test_text_cache_at_maxmemory_leaves_publishing_and_rollback_working(
    stack: Stack, threads: list[Threaded]
) -> None:
    with EmbeddedRedis() as cache:
        client = redis.Redis.from_url(cache.url)
        client.config_set("maxmemory", "2mb")
        client.config_set("maxmemory-policy", "noeviction")  # the worst case: no eviction
        s = fast(stack.settings, text_redis_url=SecretStr(cache.url))
        scorer, updater = roles(s, threads)
        reg = registry(s)
        publish_probe(reg, scorer.extractor.fingerprint)
        sent = [
            (k, chat(k.decode(), f"{k.decode()} " + "long text " * 2000))
            for k, _ in chats("t", 0, 150)
        ]
        produce_raw(s, s.topic_chat, sent)
        keys = {k.decode() for k, _ in sent}
        with Tally(s) as tally:
            out = tally.settle(keys, timeout_s=120)
        missing = out.missing(keys)
        assert not missing
        with pytest.raises(redis.exceptions.ResponseError, match=r"OOM|maxmemory"):
            client.set("probe-the-cache", b"x" * 100_000)
        errors = scorer.metrics.collector.get_sample_value("probeguard_scorer_redis_errors_total")
        assert errors is not None and errors > 0  # the cache writes failed
        # The control plane goes on: publishing (labels carry their text) and a rollback.
        before = reg.stages().live
        produce_raw(s, s.topic_labels, labels(0, 48))
        wait_until(lambda: learned(reg) >= 48 and updater.unpublished == 0, "a publish", 120)
        published = reg.stages().live
        assert published is not None and published != before
        restored = Rollout(
            reg, EvidenceStore(reg.client, reg.keys), actor="operator"
        ).rollback_live(reason="drill")
        wait_until(
            lambda: scorer.watcher.versions()["toxicity"]["live"] == restored, "the rollback"
        )
        assert updater.keeper is not None and not updater.keeper.lost.is_set()
        client.close()
    record(
        Row(
            "text cache Redis at maxmemory (noeviction)",
            len(keys),
            len(out.verdicts),
            len(out.dead),
            len(missing),
            f"cache writes refused; v{published} published, rollback to v{restored} served",
        )
    )
