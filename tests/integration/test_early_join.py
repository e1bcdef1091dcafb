"""The scorer joins its consumer group while the LLM loads (``probeguard score``), against
the real broker and Redis on the tiny random LLM."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer

from tests.conftest import RedisNamespace
from tests.integration.test_scorer import Running, chat, extractor, verdicts
from tests.kafka_helpers import committed_total, produce_raw
from tests.registry_helpers import publish_probe
from worker.kafka.clients import client_config
from worker.kafka.early_join import EarlyJoin
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration


def test_the_group_is_joined_before_the_scorer_exists_and_nothing_is_read_early(
    settings: Settings, redis_ns: RedisNamespace
) -> None:
    early = EarlyJoin.start(settings, settings.group_scorer, settings.topic_chat)
    # Joined with no scorer and no poll of records: what `probeguard score` overlaps with
    # loading the LLM.
    assert early.joined.wait(60), "the early join did not get partitions"
    n = 40
    produce_raw(settings, settings.topic_chat, [(f"m-{i}".encode(), chat(i)) for i in range(n)])
    time.sleep(1.0)  # a consumer that fetched in the background would have read them now
    assert committed_total(settings, settings.group_scorer, settings.topic_chat) == 0
    publish_probe(
        CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"),
        extractor(settings).fingerprint,
    )
    scorer = Scorer(settings, extractor(settings), redis_ns.client, metrics_port=0, early=early)
    running = Running(scorer)
    try:
        got = verdicts(settings, n)
        assert sorted({v.message_id for v in got}) == sorted(f"m-{i}" for i in range(n))
        loop = scorer.loop
        assert loop is not None and loop.stats.handled == n  # the early consumer, every record
    finally:
        running.stop()
    assert early.take() is None  # taken by the loop, closed with it


def test_a_scorer_with_nothing_to_serve_leaves_the_group_it_joined_early(
    settings: Settings, redis_ns: RedisNamespace
) -> None:
    """Holding partitions without polling would stall them for every other scorer."""
    waiting = settings.model_copy(update={"default_probe": False})
    early = EarlyJoin.start(waiting, waiting.group_scorer, waiting.topic_chat)
    assert early.joined.wait(60)
    scorer = Scorer(waiting, extractor(waiting), redis_ns.client, metrics_port=0, early=early)
    running = Running(scorer)
    deadline = time.monotonic() + 30
    while early.holding and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not early.holding, "the waiting scorer kept the partitions it joined early"
    other = KafkaConsumer(
        **client_config(waiting),
        group_id=waiting.group_scorer,
        enable_auto_commit=False,
        session_timeout_ms=waiting.kafka_session_timeout_ms,
        heartbeat_interval_ms=waiting.kafka_heartbeat_interval_ms,
    )
    other.subscribe([waiting.topic_chat])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(other.assignment()) < waiting.topic_partitions:
            other.poll(timeout_ms=500)
        # The waiting scorer let go: another member holds every partition.
        assert len(other.assignment()) == waiting.topic_partitions
        assert scorer.loop is None
    finally:
        other.close()
        running.stop()


def test_a_member_left_without_partitions_stops_joining_at_once(settings: Settings) -> None:
    """More scorers than partitions: a member in the group with nothing assigned ends its
    early join there instead of polling until its timeout (which would hold up the
    scorer's start), and a member still loading keeps answering the group's rebalances
    (else the newcomer's join would wait for it)."""
    topic = f"{settings.topic_chat}-one"
    one = settings.model_copy(update={"topic_partitions": 1, "topic_chat": topic})
    group = f"{settings.group_scorer}-one"
    first = EarlyJoin.start(one, group, topic)
    assert first.joined.wait(60)
    extra = EarlyJoin(one, group, topic, timeout_s=120)
    started = time.monotonic()
    extra._thread.start()
    mine = extra.take()  # waits for its join; `first` is still "loading" (not taken)
    elapsed = time.monotonic() - started
    theirs = None
    try:
        assert mine is not None
        assert elapsed < 60, f"it polled on until its timeout ({elapsed:.0f} s)"
        theirs = first.take()
    finally:
        for consumer in (mine, theirs):
            if consumer is not None:
                consumer.close()
        first.release()
