"""Shared fixtures: a real Kafka-protocol broker and a real Redis server, namespaced per test.

- Kafka: ``PROBEGUARD_TEST_KAFKA_BOOTSTRAP`` when set (e.g. an Apache Kafka in
  CI), else the embedded tansu broker, started once per session.
- Redis: ``PROBEGUARD_TEST_REDIS_URL`` when set, else the machine's Redis at
  127.0.0.1:6379 when it answers, else an embedded redis-server. Every test
  gets its own key prefix and all keys under it are deleted afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hypothesis  # noqa: F401  (imported early: see below)
import pytest
import redis

# The LLM's autocast default ("auto") depends on the CPU (bfloat16 where it is native):
# tests run float32 everywhere, so exact-equality checks hold on any machine, and the
# autocast tests (tests/unit/llm/test_autocast.py) ask for it explicitly. Worker processes that
# tests start inherit this.
os.environ["PROBEGUARD_AUTOCAST"] = "off"

from tests.process_helpers import Threaded
from worker.embedded import EmbeddedBroker, EmbeddedRedis
from worker.kafka.clients import ensure_topics
from worker.settings import Settings
from worker.store.redis import Keys

# hypothesis is imported here, at collection, on purpose: imported late (its pytest plugin
# does so at the terminal summary) after the Kafka client threads have run, CPython
# 3.11.7's parser can fail with "AST constructor recursion depth mismatch".


# Group timing on the embedded broker: tansu forms a group in about half the session
# timeout, so the settings' 6000/1000 (Apache Kafka's smallest session by default) cost
# every test ~3 s per join and ~5 s per rebalance; 2000/500 forms one in ~1 s and
# rebalances in ~2 s (measured). No test depends on the length: the ones about evictions
# wait for them with deadlines far longer. An external broker
# (``PROBEGUARD_TEST_KAFKA_BOOTSTRAP``, e.g. Apache Kafka, which refuses sessions under its
# group.min.session.timeout.ms) keeps the settings' defaults.
FAST_GROUPS: dict[str, Any] = {"kafka_session_timeout_ms": 2000, "kafka_heartbeat_interval_ms": 500}


def group_timing() -> dict[str, Any]:
    """The group timing for the tests' broker: :data:`FAST_GROUPS` on the embedded one."""
    return {} if os.environ.get("PROBEGUARD_TEST_KAFKA_BOOTSTRAP") else dict(FAST_GROUPS)


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    external = os.environ.get("PROBEGUARD_TEST_KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    with EmbeddedBroker() as broker:
        yield broker.bootstrap


def _redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1) as r:
            return bool(r.ping())
    except (redis.RedisError, OSError):
        return False


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    external = os.environ.get("PROBEGUARD_TEST_REDIS_URL")
    if external:
        yield external
        return
    machine = "redis://127.0.0.1:6379/0"
    if _redis_answers(machine):
        yield machine
        return
    with EmbeddedRedis() as server:
        yield server.url


@dataclass
class RedisNamespace:
    url: str
    prefix: str
    client: redis.Redis
    keys: Keys


@pytest.fixture
def redis_ns(redis_url: str) -> Iterator[RedisNamespace]:
    """A Redis client and a key prefix that only this test uses; cleaned up after."""
    prefix = _unique("pgtest")
    client = redis.Redis.from_url(redis_url, protocol=2)
    try:
        yield RedisNamespace(url=redis_url, prefix=prefix, client=client, keys=Keys(prefix))
    finally:
        batch = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if batch:
            client.delete(*batch)
        client.close()


@pytest.fixture
def group_id() -> str:
    """A consumer group id no other test uses."""
    return _unique("pgtest-group")


@pytest.fixture
def settings(kafka_bootstrap: str, redis_ns: RedisNamespace) -> Settings:
    """Settings pointing at the test broker and this test's Redis namespace, with
    topic names of its own so tests never read each other's messages."""
    suffix = uuid.uuid4().hex[:8]
    return Settings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_ns.url,
        redis_prefix=redis_ns.prefix,
        topic_chat=f"chat-{suffix}",
        topic_labels=f"labels-{suffix}",
        topic_verdicts=f"verdicts-{suffix}",
        topic_review=f"review-{suffix}",
        topic_dead_letter=f"dlq-{suffix}",
        group_scorer=f"scorer-{suffix}",
        group_updater=f"updater-{suffix}",
        topic_partitions=4,
        # Most tests serve a single-head probe under the name `toxicity` (the default
        # name before the packaged multi-head `moderation`; still accepted).
        probes="toxicity",
        **group_timing(),
    )


@pytest.fixture
def topic_factory(kafka_bootstrap: str) -> Callable[..., str]:
    """Create a fresh topic: ``topic_factory("chat", partitions=4) -> "chat-<random>"``."""
    base = Settings(kafka_bootstrap=kafka_bootstrap)

    def make(name: str = "topic", partitions: int = 4) -> str:
        topic = _unique(name)
        created = ensure_topics(base, [topic], partitions=partitions)
        assert created == [topic], f"topic {topic} was not created"
        return topic

    return make


@pytest.fixture
def threads() -> Iterator[list[Threaded]]:
    """Roles started on threads by a test; stopped (newest first) after it."""
    running: list[Threaded] = []
    yield running
    for t in reversed(running):
        t.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist each worker hands its fault rows to the controller."""
    from tests.faults.accounting import ROWS

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fault_rows"] = [dataclasses.asdict(r) for r in ROWS]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (a worker per core), one torch thread per worker and per process
    a test starts, unless the caller set ``OMP_NUM_THREADS``: torch's default of a thread
    per core in every worker oversubscribes the cores and its threads spin (a default-build
    test took 94 s in CI beside the other worker, 13 s alone)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if hasattr(config, "workerinput") and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The controller side of :func:`pytest_sessionfinish` (an xdist hook, so optional)."""
    from tests.faults.accounting import ROWS, Row

    ROWS.extend(Row(**r) for r in getattr(node, "workeroutput", {}).get("fault_rows", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault suite's table: where every input of each fault test ended up (every
    xdist worker's rows, sorted by fault)."""
    from tests.faults.accounting import ROWS, table

    if ROWS and not hasattr(terminalreporter.config, "workeroutput"):
        terminalreporter.section("fault suite summary")
        terminalreporter.write_line(table(sorted(ROWS, key=lambda r: r.fault)))
