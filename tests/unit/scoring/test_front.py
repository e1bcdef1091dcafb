"""The front door that ``serve`` and the inline guard share (:mod:`worker.scoring.front`),
on the tiny LLM and the real Redis (no broker: nothing is sent)."""

from __future__ import annotations

import threading
import time

import pytest

from probes.probe import build_probe
from schemas import ChatMessage, utcnow
from tests.conftest import RedisNamespace
from tests.registry_helpers import publish_probe, toxicity_spec
from tests.unit.guard.test_guard import guard_settings
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.engine import Judged, Retain
from worker.scoring.front import FrontDoor, FrontSettings
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry


def test_each_role_gives_its_own_switches() -> None:
    s = Settings(serve_verdicts=True, serve_review=False, guard_verdicts=False, guard_review=True)
    assert FrontSettings.serve(s) == FrontSettings("serve", verdicts=True, review=False)
    assert FrontSettings.guard(s) == FrontSettings("guard", verdicts=False, review=True)


@pytest.mark.parametrize("review", [True, False])
def test_review_requests_are_asked_for_only_when_the_role_sends_them(
    redis_ns: RedisNamespace, review: bool
) -> None:
    llm = make_tiny_llm()
    settings = guard_settings(
        redis_ns,
        probe_watch="poll",  # the door watches on a thread all the same
        review_audit_share=1.0,  # every message is audited
        guard_review=review,  # (no verdicts: with no broker the outbox stays off)
    )
    extractor = HiddenStateExtractor.for_llm(llm, settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    spec = toxicity_spec(llm.hidden_size, layers=[1, 3])
    publish_probe(registry, extractor.fingerprint, probe=build_probe(spec, seed=1))
    door = FrontDoor(settings, extractor, redis_ns.client, FrontSettings.guard(settings))
    assert door.engine.threaded and door.engine.worker_id.startswith("guard-")
    assert door.outbox.enabled == review  # not started here: there is no broker
    door.engine.watcher.refresh(force=True)
    assert door.ready()
    message = ChatMessage(message_id="m", conversation_id="c", text="hi", created_at=utcnow())
    judged = door.judge([message], [Retain.ALL])
    assert [r.message_id for _, r in judged.reviews] == (["m"] if review else [])
    assert door.judge([message], [Retain.ALL], review=False).reviews == []


def test_start_and_stop_take_the_threads_with_them(redis_ns: RedisNamespace) -> None:
    llm = make_tiny_llm()
    settings = guard_settings(redis_ns)
    door = FrontDoor(
        settings,
        HiddenStateExtractor.for_llm(llm, settings),
        redis_ns.client,
        FrontSettings.guard(settings),
        worker_id="g",
    )
    before = {t.name for t in threading.enumerate()}
    door.start()
    assert "guard-probes" in {t.name for t in threading.enumerate()} - before
    assert not door.ready()  # nothing published, no packaged default
    door.send(Judged(verdicts={}, errors={}))  # an outbox that sends nothing takes nothing
    assert not door.outbox.enabled and door.outbox._queue.empty()
    door.stop()
    assert door.stop_event.is_set()
    deadline = time.monotonic() + 10
    while "guard-probes" in {t.name for t in threading.enumerate()}:
        assert time.monotonic() < deadline, "the waiting thread outlived stop"
        time.sleep(0.05)
