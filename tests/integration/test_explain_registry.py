"""``probeguard explain`` reading the probe from the Redis registry and the text from the
scorers' text cache (a real Redis; the tiny random LLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from probes import build_probe, checkpoint_to_bytes
from schemas import ProbeSpec
from tests.conftest import RedisNamespace
from worker.cli import main
from worker.llm.tiny import make_tiny_llm
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

TEXT = "you are an idiot"


@pytest.fixture
def published(tmp_path: Path, redis_ns: RedisNamespace, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A live version of probe ``toxicity`` for the tiny LLM, and a cached text for ``m-1``."""
    llm = make_tiny_llm(tmp_path, lm_head="own")
    spec = ProbeSpec(
        name="toxicity",
        token_pool="gate",
        layer_mix="scalar_mix",
        layers=[2, 4],
        hidden_size=32,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    version = registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(
        build_probe(spec, seed=0), llm=llm.fingerprint, version=version
    )
    registry.publish(blob, manifest, set_live=True, reason="test")
    redis_ns.client.set(redis_ns.keys.text("m-1"), TEXT.encode())
    monkeypatch.setenv("PROBEGUARD_REDIS_URL", redis_ns.url)
    monkeypatch.setenv("PROBEGUARD_REDIS_PREFIX", redis_ns.prefix)
    monkeypatch.setenv("PROBEGUARD_PROBES", "toxicity")
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PROBEGUARD_MODEL", str(tmp_path / "tiny-llama-0-own"))
    return tmp_path


def test_explains_the_live_version_of_a_cached_message(capsys, published: Path) -> None:
    capsys.readouterr()
    assert main(["explain", "--message-id", "m-1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["source"] == "registry live v1" and r["version"] == 1 and r["text"] == TEXT
    assert [e["layer"] for e in r["layers"]] == [2, 4] and r["lens"]["available"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--message-id", "m-404"], "no cached text for message id 'm-404'"),
        (["--probe", "spam", TEXT], "probe 'spam' has no live version in the registry"),
        (["--stage", "canary", TEXT], "probe 'toxicity' has no canary on trial"),
        (["--version", "9", TEXT], "toxicity has no version 9"),
    ],
)
def test_registry_errors_are_clear(capsys, published: Path, argv: list[str], message: str) -> None:
    capsys.readouterr()
    assert main(["explain", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_the_console_explains_a_cached_probe_without_downloading_it_again(
    published: Path, redis_ns: RedisNamespace
) -> None:
    """L14: each explanation fetched the checkpoint blob from Redis again, even when the
    verified probe was cached (megabytes per click). Versions are immutable: the cache
    is looked up by version before anything is downloaded."""
    from worker.console.explainer import Explainer
    from worker.settings import Settings

    live = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity").stages().live
    assert live is not None
    explainer = Explainer(Settings(), redis_ns.client)
    first = explainer.explain("toxicity", TEXT, lens=False)
    redis_ns.client.delete(redis_ns.keys.ckpt("toxicity", live))  # only the cache has it now
    second = explainer.explain("toxicity", "a different text", lens=False)
    assert second != first and f"v{live}" in str(second.get("where", second))


def test_the_console_explains_in_the_configured_text_form(
    published: Path, redis_ns: RedisNamespace
) -> None:
    """With PROBEGUARD_TEXT_FORM=chat the console's explainer reads chat-form states: a
    probe trained on them explains (the text's tokens and the template's suffix), a raw
    one is refused naming text_form."""
    from worker.console.explainer import Explainer
    from worker.errors import ExplainError
    from worker.llm.chat_form import turn_ids
    from worker.llm.load import load_llm
    from worker.settings import Settings

    settings = Settings(text_form="chat")
    llm = load_llm(settings, lm_head=True)
    fp = llm.fingerprint.model_copy(update={"text_form": turn_ids(llm.tokenizer).key})
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    raw = registry.stages().live
    assert raw is not None
    version = registry.allocate_version()
    probe = build_probe(registry.get(raw).manifest.spec, seed=1)
    registry.publish(*checkpoint_to_bytes(probe, llm=fp, version=version), set_live=True)
    explainer = Explainer(settings, redis_ns.client)
    report = explainer.explain("toxicity", TEXT, lens=False)
    assert report["version"] == version
    assert report["n_tokens"] == len(TEXT) + len("\nassistant: ")
    with pytest.raises(ExplainError, match="text_form"):
        explainer.explain("toxicity", TEXT, version=raw, lens=False)
