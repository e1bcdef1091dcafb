"""The fault suite's own broker and Redis (it pauses and kills them), and the tiny LLM on disk."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import FAST_GROUPS
from tests.process_helpers import tiny_model_dir
from worker.embedded import EmbeddedBroker, EmbeddedRedis
from worker.kafka.clients import ensure_topics
from worker.settings import Settings


@dataclass
class Stack:
    broker: EmbeddedBroker
    redis: EmbeddedRedis
    settings: Settings


@pytest.fixture
def stack() -> Iterator[Stack]:
    """A broker and a Redis server that only this test uses (so it may pause them)."""
    with EmbeddedBroker() as broker, EmbeddedRedis() as server:
        settings = Settings(
            kafka_bootstrap=broker.bootstrap,
            redis_url=server.url,
            redis_prefix="faults",
            redis_socket_timeout_s=2.0,
            topic_partitions=4,
            stage_check_interval_s=0.5,
            metrics_port=0,
            # The fault tests serve a single-head probe under the name `toxicity` (the
            # default name before the packaged multi-head `moderation`; still accepted).
            probes="toxicity",
            **FAST_GROUPS,  # its own embedded broker: groups form in ~1 s (tests/conftest.py)
        )
        ensure_topics(settings)
        yield Stack(broker, server, settings)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The tiny random LLM saved to disk (subprocess scorers load it) and the loaded copy."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llm"))
