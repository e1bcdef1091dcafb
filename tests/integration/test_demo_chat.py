"""``probeguard demo --chat`` on the tiny LLM through the test broker and Redis: scripted
turns are answered and judged inline, a ``/label`` line trains a version the guard swaps to,
and hostile text never reaches the terminal raw."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from probes.checkpoint import save_checkpoint
from probes.probe import build_probe
from tests.conftest import RedisNamespace
from tests.process_helpers import wait_until
from tests.registry_helpers import toxicity_spec
from tests.unit.guard.test_guard import chat_llm, no_blanks
from worker.demo.chat import PROBE, ChatOptions, run_chat, shown
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import Keys

pytestmark = pytest.mark.integration


def test_a_scripted_chat_is_judged_inline_and_its_labels_make_a_version(
    settings: Settings, redis_ns: RedisNamespace, tmp_path: Path
) -> None:
    llm = chat_llm()
    spec = toxicity_spec(llm.hidden_size, layers=[1, 3], name=PROBE).model_copy(
        update={"labels": ["non-toxic", "toxic"]}
    )
    seed = tmp_path / "seed"
    save_checkpoint(build_probe(spec, seed=4), seed, llm=llm.fingerprint)
    settings = settings.model_copy(
        update={
            "bootstrap_checkpoint": seed,
            "seed_checkpoint": seed,
            "default_probe": False,
            "guard_on_flag": "continue",
            "publish_every_labels": 2,
            "stats_warmup": 1,
        }
    )
    blanks = {"suppress_tokens": no_blanks(llm)}
    opts = ChatOptions(max_new_tokens=4, tag=redis_ns.prefix, generate=blanks)  # keys cleaned
    registry = CheckpointRegistry(redis_ns.client, Keys(opts.tag), PROBE)
    out: list[str] = []
    hostile = "look \x1b[2J\u202ehere"

    def script() -> Iterator[str]:
        yield from ["what a lovely day", "/label non-toxic", hostile, "/label toxic"]
        yield from ["/label-reply non-toxic", "/label bogus label!"]
        # The updater publishes v1 from the labels; the guard swaps to it.
        wait_until(lambda: registry.stages().live is not None, "a version from the labels")
        yield from [f"turn {i}" for i in range(8)]

    session = run_chat(settings, llm, script(), opts, write=out.append)
    text = "".join(out)
    assert len(session.turns) == 10 and session.labels == 3
    assert all(t.prompt is not None for t in session.turns)
    assert "\x1b" not in text and "\u202e" not in text
    assert shown(hostile) in text and "\\u001b[2J" in text
    assert "not a label" in text
    assert session.versions[0] == 0 and session.versions[-1] >= 1, session.versions
    assert all(t.reply is not None for t in session.turns)
