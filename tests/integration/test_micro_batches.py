"""Issue 26: verdicts leave per micro-batch, not per poll (the real broker and Redis, the
tiny LLM). A poll of several messages is cut into micro-batches; each micro-batch's
verdicts are on the topic before the next micro-batch is scored, and the poll's offsets
are committed once, after all of them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schemas import ChatMessage, Verdict
from tests.conftest import RedisNamespace
from tests.integration.test_scorer import Running, chat, extractor
from tests.kafka_helpers import committed_total, drain, produce_raw
from tests.registry_helpers import publish_probe
from worker.kafka.batch_loop import Item, Outgoing, Reject
from worker.kafka.clients import ensure_topics
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration


def test_each_micro_batch_verdicts_are_out_before_the_next_is_scored(
    settings: Settings, redis_ns: RedisNamespace
) -> None:
    ensure_topics(settings)
    fp = extractor(settings).fingerprint
    publish_probe(CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"), fp)
    n = 6
    produce_raw(settings, settings.topic_chat, [(f"m-{i}".encode(), chat(i)) for i in range(n)])
    settings = settings.model_copy(update={"latency_target_ms": 250})
    scorer = Scorer(settings, extractor(settings), redis_ns.client, metrics_port=0)
    # As if a token took a second: every message is a micro-batch of its own at 250 ms.
    scorer.planner.observe(tokens=1, seconds=1.0)
    handled: list[str] = []
    seen_before: list[bool] = []  # per later micro-batch: were the earlier verdicts out?
    polls: list[int] = []
    score = scorer.handle

    def handle(items: list[Item[ChatMessage]]) -> Sequence[Outgoing | Reject]:
        if handled:
            want = {m.encode() for m in handled}
            got = drain(
                settings,
                settings.topic_verdicts,
                lambda rs: want <= {r.key for r in rs},
                timeout_s=15,
            )
            seen_before.append(want <= {r.key for r in got})
        polls.append(scorer.loop.stats.batches if scorer.loop is not None else -1)
        out = score(items)
        handled.extend(i.value.message_id for i in items)
        return out

    scorer.handle = handle  # type: ignore[method-assign]
    running = Running(scorer)
    try:
        records = drain(
            settings,
            settings.topic_verdicts,
            lambda rs: len({r.key for r in rs}) >= n,
            timeout_s=90,
        )
    finally:
        running.stop()
    got = {Verdict.decode(r.value).message_id for r in records}
    assert got == {f"m-{i}" for i in range(n)}
    assert len(handled) == n
    assert len(polls) == n  # one micro-batch per message
    assert polls.count(0) >= 2  # at least two micro-batches of the first poll
    assert seen_before and all(seen_before)
    assert committed_total(settings, settings.group_scorer, settings.topic_chat) == n
    # The histograms behind it: a micro-batch size and a queue time per message.
    m = scorer.metrics
    assert m.queue_seconds._sum.get() >= 0 and _count(m.queue_seconds) == n
    assert _count(m.verdict_seconds) == n
    assert _count(m.batch_size) == n


def _count(histogram: object) -> float:
    samples = {s.name: s.value for s in histogram.collect()[0].samples}  # type: ignore[attr-defined]
    return next(v for k, v in samples.items() if k.endswith("_count"))
