"""``docs/quickstart.md`` runs as written: every snippet marked ``<!-- quickstart-test: NAME -->``
is executed (Python in a fresh interpreter, shell with bash) against a real scorer, updater
and ``serve`` on the embedded broker and Redis, and the ``probeguard`` command lines of its
setup blocks must parse with the real CLI.

The page uses the default topic names (``chat.messages``, ...), so this test starts a broker
of its own rather than sharing the session's, where every test has its own topics. The only
things changed in a snippet: ``PROBEGUARD_KAFKA_BOOTSTRAP`` in its environment, and the
address ``localhost:8400`` (``serve``'s default) replaced by the test server's.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from schemas import Verdict
from tests.conftest import RedisNamespace
from tests.kafka_helpers import drain
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe
from worker.cli import build_parser
from worker.embedded import EmbeddedBroker
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.scorer import Scorer
from worker.serve.server import ModerationServer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

PAGE = Path(__file__).parents[2] / "docs" / "quickstart.md"
_MARKED = re.compile(r"<!-- quickstart-test: ([\w-]+) -->\n```(\w+)\n(.*?)\n```", re.S)
_BLOCK = re.compile(r"```(\w+)\n(.*?)\n```", re.S)


def snippets() -> dict[str, tuple[str, str]]:
    """name -> (language, code) of every marked block, in page order."""
    return {name: (lang, code) for name, lang, code in _MARKED.findall(PAGE.read_text())}


@dataclass
class Stack:
    settings: Settings
    updater: Updater
    serve_url: str  # http://127.0.0.1:PORT


@pytest.fixture
def stack(redis_ns: RedisNamespace) -> Iterator[Stack]:
    """What the page's step 1 starts: a broker with the default topics, a scorer and an
    updater (on a tiny random LLM, serving a published probe: the packaged default is for
    the real LLM only)."""
    with EmbeddedBroker() as broker:
        settings = Settings(
            kafka_bootstrap=broker.bootstrap,
            redis_url=redis_ns.url,
            redis_prefix=redis_ns.prefix,
            metrics_port=0,
        )
        ensure_topics(settings)  # as `probeguard up` does
        extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=8)
        registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, settings.probe_names[0])
        publish_probe(registry, extractor.fingerprint)
        scorer = Scorer(settings, extractor, redis_ns.client, worker_id="scorer")
        updater = Updater(settings, extractor, redis_ns.client, worker_id="updater")
        roles = [Threaded(scorer.run, scorer.stop), Threaded(updater.run, updater.stop)]
        server = ModerationServer(
            settings.model_copy(update={"serve_port": 0}), extractor, redis_ns.client, keys=None
        ).start()
        try:
            yield Stack(settings, updater, server.url)
        finally:
            server.stop()
            for role in reversed(roles):
                role.stop()


def run_snippet(name: str, stack: Stack) -> str:
    lang, code = snippets()[name]
    code = code.replace("localhost:8400", stack.serve_url.removeprefix("http://"))
    env = {"PROBEGUARD_KAFKA_BOOTSTRAP": stack.settings.kafka_bootstrap, "PATH": "/usr/bin:/bin"}
    argv = (
        [sys.executable, "-c", code]
        if lang == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_page_marks_the_snippets_it_promises() -> None:
    assert list(snippets()) == [
        "kafka-python",
        "confluent-kafka",
        "curl",
        "curl-perspective",
        "openai",
    ]
    marked = sum(1 for _ in _MARKED.finditer(PAGE.read_text()))
    assert marked == len(snippets()), "two snippets share a name"


def test_the_setup_commands_parse() -> None:
    """Every ``probeguard ...`` line in the page's unmarked shell blocks is a real command
    with real options (the lines a reader runs in other terminals)."""
    lines = []
    for lang, code in _BLOCK.findall(PAGE.read_text()):
        if lang != "bash":
            continue
        for line in code.splitlines():
            command = line.split("#")[0].split("&&")[-1].strip()
            if command.startswith("probeguard "):
                lines.append(command)
    assert len(lines) >= 4, lines  # up, score, train, serve
    for command in lines:
        argv = shlex.split(command)[1:]
        args = build_parser(argv).parse_args(argv)
        assert callable(args.func), command


def test_the_quickstart_snippets_run(stack: Stack) -> None:
    settings, probe = stack.settings, stack.settings.probe_names[0]

    # Kafka apps: each prints its message's verdict, then sends a label.
    for name in ("kafka-python", "confluent-kafka"):
        out = run_snippet(name, stack)
        decision, served, version, *_ = out.split()
        # v1 is the probe published at the start; the first label may already have made v2.
        assert decision in ("allow", "flag") and served == probe, out
        assert re.fullmatch(r"v[1-9]\d*", version), out

    # Over HTTP: OpenAI's answer, and Perspective's with the caller's own message id.
    answer = json.loads(run_snippet("curl", stack))
    assert answer["id"].startswith("modr-") and len(answer["results"]) == 1, answer
    assert re.fullmatch(rf"{probe}@v[1-9]\d*", answer["model"]), answer
    perspective = json.loads(run_snippet("curl-perspective", stack))
    assert "TOXICITY" in perspective["attributeScores"], perspective
    lines = run_snippet("openai", stack).splitlines()
    assert [line.split()[0].rsplit("-", 1)[1] for line in lines] == ["0", "1"], lines
    assert all(line.startswith("modr-") for line in lines), lines

    # Three labels (two chat messages, one `serve` input, none carrying its text) reach the
    # updater, which joins each with the text the scorer or `serve` kept, and learns it.
    def learned() -> int:
        learner = stack.updater.learner
        return learner.counters.labels_seen if learner is not None else 0

    wait_until(lambda: learned() >= 3, "the updater to learn the page's three labels", 120)
    assert learned() == 3
    dead = drain(settings, settings.topic_dead_letter, lambda _: False, timeout_s=2)
    assert dead == [], [d.value for d in dead]
    verdicts = drain(settings, settings.topic_verdicts, lambda _: False, timeout_s=2)
    ids = {Verdict.decode(r.value).message_id for r in verdicts}
    assert len(ids) == 2 and all(i.startswith("msg-") for i in ids), ids  # the two chat messages
