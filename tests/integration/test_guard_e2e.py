"""Issue 25 end to end, through the real broker and Redis on the tiny LLM: a chat app
generates with the inline guard; the prompt's and the reply's verdicts are on the verdicts
topic; labels for both join through the text cache the guard wrote, the updater publishes a
new version from them, and the guard serves that version."""

from __future__ import annotations

import json
from typing import Any

import pytest

from probes.probe import build_probe
from schemas import ReviewRequest, Verdict
from tests.conftest import RedisNamespace
from tests.integration.test_updater import fast, label
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe, toxicity_spec
from tests.unit.guard.test_guard import chat_llm, no_blanks
from worker.guard import Guard
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration


def verdicts(settings: Settings, ids: set[str]) -> dict[str, Verdict]:
    records = drain(
        settings,
        settings.topic_verdicts,
        lambda rs: ids <= {r.key.decode() for r in rs},
        60,
    )
    got = [Verdict.decode(r.value) for r in records if r.key.decode() in ids]
    return {v.message_id: v for v in got}


def human(message_id: str, lab: str) -> bytes:
    """A reviewer's label without text: the updater must join it through the text cache."""
    body = {
        "message_id": message_id,
        "label": lab,
        "labeler_id": "bob",
        "created_at": "2026-12-02T12:00:00Z",
    }
    return json.dumps(body).encode()


def test_guarded_turns_reach_the_topic_their_labels_train_a_version_the_guard_serves(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    # Every message is audited: both turns reach the review queue.
    settings = fast(settings, default_probe=False, guard_on_flag="continue", review_audit_share=1.0)
    ensure_topics(settings)
    llm = chat_llm()
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    spec = toxicity_spec(llm.hidden_size, layers=[1, 3]).model_copy(
        update={"labels": ["non-toxic", "toxic"]}
    )
    first = publish_probe(registry, llm.fingerprint, probe=build_probe(spec, seed=3))
    options: dict[str, Any] = {"max_new_tokens": 6, "do_sample": False}
    options["suppress_tokens"] = no_blanks(llm)
    with Guard(llm, settings, redis_ns.client, worker_id="guard-1") as guard:
        assert guard.wait_ready(30)
        turn = guard.chat(
            [{"role": "user", "content": "XXXX ZZZZ QQQQ!!!"}], message_id="g-1", **options
        )
        assert turn.prompt is not None and turn.reply is not None
        got = verdicts(settings, {"g-1", turn.reply_id})
        assert got["g-1"] == turn.prompt and got[turn.reply_id] == turn.reply
        assert got[turn.reply_id].reply_to == "g-1"
        assert {r.version for v in got.values() for r in v.results} == {first}
        want = {"g-1", turn.reply_id}
        reviews = drain(
            settings, settings.topic_review, lambda rs: want <= {r.key.decode() for r in rs}, 60
        )
        asked = {r.key.decode(): ReviewRequest.decode(r.value) for r in reviews}
        assert asked["g-1"].reply_to is None and asked[turn.reply_id].reply_to == "g-1"
        assert asked[turn.reply_id].text == turn.generated

        updater = Updater(
            settings,
            HiddenStateExtractor(llm, max_tokens=64, batch_size=16),
            redis_ns.client,
            worker_id="updater-g",
        )
        threads.append(Threaded(updater.run, updater.stop))
        labels = [(None, human("g-1", "toxic")), (None, human(turn.reply_id, "non-toxic"))]
        labels += [(None, label(i)) for i in range(62)]
        produce_raw(settings, settings.topic_labels, labels)
        wait_until(
            lambda: updater.labels_seen >= 64 and updater.unpublished == 0, "labels published"
        )
        # Both guard labels were joined (no text of their own) and learned: none was
        # dead-lettered as unjoinable.
        letters = drain(settings, settings.topic_dead_letter, lambda rs: False, 2)
        assert letters == []
        last = registry.stages().live
        assert last is not None and last > first
        wait_until(lambda: guard.engine.watcher.versions()["toxicity"]["live"] == last, "swap")
        again = guard.chat([{"role": "user", "content": "nice work team"}], **options)
        assert again.prompt is not None and again.prompt.results[0].version == last
        assert verdicts(settings, {again.prompt_id})[again.prompt_id].results[0].version == last
