"""The updater's layer-collapse alarm gauge, as Prometheus reads it (feature audit row 14)."""

from __future__ import annotations

import pytest

from tests.conftest import RedisNamespace
from tests.integration.test_updater import extractor, fast, label
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, wait_until
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.settings import Settings

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("alarm", "expected"), [(0.0, 0.0), (10.0, 1.0)])
def test_the_collapse_alarm_is_one_when_the_layer_entropy_is_under_the_setting(
    settings: Settings,
    redis_ns: RedisNamespace,
    threads: list[Threaded],
    alarm: float,
    expected: float,
) -> None:
    # A two-layer mix has entropy at most log 2 = 0.69 nats: under 10 always, never under 0.
    settings = fast(settings, entropy_alarm=alarm, default_probe=False)
    ensure_topics(settings)
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: updater.labels_seen >= 32 and updater.unpublished == 0, "a publish")
    value = updater.metrics.collector.get_sample_value("probeguard_updater_layer_collapse_alarm")
    assert value == expected
