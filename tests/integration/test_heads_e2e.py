"""Day one and multi-head probes through the real broker and Redis, on a tiny random LLM:
a scorer with nothing published serves the packaged default at once, and labels for two
heads train a multi-head version whose verdicts carry both heads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import worker.defaults
from probes import CheckpointError, build_probe, save_checkpoint
from schemas import HeadSpec, ProbeSpec, Verdict
from tests.conftest import RedisNamespace
from tests.integration.test_updater import GOOD, extractor, fast
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import Threaded, wait_until
from worker.kafka.clients import ensure_topics
from worker.learning.resume import starting_point
from worker.learning.updater import Updater
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

SPAM = ["BUY NOW cheap pills", "CLICK HERE free money", "WIN A PRIZE now", "cheap VIAGRA deal"]
RUDE = ["XXXX ZZZZ QQQQ!!!", "ZZZZ XXXX #### !!!", "QQQQ #### XXXX ZZZZ", "!!!! XXXX QQQQ"]


@pytest.fixture
def packaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A packaged default for the tiny LLM (two heads), pinned like a release's."""
    fp = extractor().fingerprint
    spec = ProbeSpec(
        name="moderation",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=fp.hidden_size,
        task="multilabel",
        labels=["non-toxic", "toxic", "spam"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
            HeadSpec(name="spam", task="multilabel", labels=["spam"]),
        ],
        flag_labels=["toxic", "spam"],
    )
    folder = tmp_path / "tiny"
    save_checkpoint(build_probe(spec, seed=0), folder, llm=fp)
    pin = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    monkeypatch.setattr(worker.defaults, "ROOT", tmp_path)
    monkeypatch.setattr(worker.defaults, "PINNED", {"tiny": pin})
    return folder


def chats(settings: Settings, tag: str, texts: list[str]) -> list[Verdict]:
    records = [
        (
            f"{tag}-{i}".encode(),
            json.dumps(
                {
                    "message_id": f"{tag}-{i}",
                    "conversation_id": "c",
                    "text": text,
                    "created_at": "2026-12-01T12:00:00Z",
                }
            ).encode(),
        )
        for i, text in enumerate(texts)
    ]
    produce_raw(settings, settings.topic_chat, records)
    got = drain(
        settings,
        settings.topic_verdicts,
        lambda rs: sum(r.key.decode().startswith(tag) for r in rs) >= len(texts),
        60,
    )
    return [Verdict.decode(r.value) for r in got if r.key.decode().startswith(tag)]


def test_with_nothing_published_the_scorer_serves_the_packaged_default_at_once(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], packaged: Path
) -> None:
    ensure_topics(settings)
    scorer = Scorer(fast(settings), extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    verdicts = chats(settings, "d", ["hello there", "BUY NOW cheap pills"])
    for v in verdicts:
        (result,) = v.results
        assert result.probe == "toxicity" and result.version == 0
        assert set(result.scores) == {"non-toxic", "toxic", "spam"}
        assert result.heads is not None and set(result.heads) == {"toxicity", "spam"}
        assert len(result.heads["toxicity"].predicted) == 1  # one class of a multiclass head
    ready, why = scorer._ready()
    assert ready and "the packaged default tiny" in why


def test_a_packaged_default_that_is_not_the_pinned_one_is_refused(packaged: Path) -> None:
    manifest = json.loads((packaged / "manifest.json").read_text())
    manifest["spec"]["flag_labels"] = []  # a changed file: its sha256 is not the pinned one
    (packaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not the one this release pins"):
        worker.defaults.find_default(extractor().fingerprint, "toxicity")
    # A role logs it and does without (the scorer waits, the updater starts from zero).
    assert worker.defaults.serving_default(extractor().fingerprint, "toxicity") is None


def test_labels_for_two_heads_publish_a_version_whose_verdicts_carry_both(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], packaged: Path
) -> None:
    settings = fast(settings, flag_heads="spam")
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    scorer = Scorer(settings, extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    labels = []
    for i in range(96):
        kind = i % 3
        text = [GOOD, RUDE, SPAM][kind][i % 4] + f" {i}"
        body: dict[str, object] = {
            "message_id": f"l-{i}",
            "labeler_id": "alice",
            "created_at": "2026-12-01T12:00:00Z",
            "text": text,
        }
        if i % 2:  # the toxicity head, as a single-head deployment labels (no head named)
            body["label"] = "toxic" if kind == 1 else "non-toxic"
        else:  # the spam head alone: [] is a negative for spam, and says nothing of toxicity
            body |= {"head": "spam", "labels": ["spam"] if kind == 2 else []}
        labels.append((None, json.dumps(body).encode()))
    produce_raw(settings, settings.topic_labels, labels)
    wait_until(lambda: registry.stages().live is not None, "a first version")
    live = registry.stages().live
    assert live is not None
    manifest = registry.manifest(live)
    assert [h.name for h in manifest.spec.heads] == ["toxicity", "spam"]
    # The first version was fine-tuned from the packaged default (no parent), not from zero.
    first = registry.manifest(min(registry.versions()))
    assert first.parent is None and [h.name for h in first.spec.heads] == ["toxicity", "spam"]
    assert first.spec.token_pool == "mha"  # given an attention pool to learn (DEFAULT_ATTENTION)
    # The updater goes on learning: a later version may be live by the time we look.
    wait_until(lambda: (scorer.watcher.versions()["toxicity"]["live"] or 0) >= live, "scorer swap")
    verdicts = chats(settings, "v", ["what a lovely day", "CLICK HERE free money"])
    for v in verdicts:
        (result,) = v.results
        assert result.version >= live and result.heads is not None
        assert set(result.heads) == {"toxicity", "spam"}
        # The deployment's policy: only the spam head flags.
        assert result.flagged == result.heads["spam"].flagged
        assert not result.heads["toxicity"].flagged  # it predicts, it does not flag
        assert len(result.heads["toxicity"].predicted) == 1


def test_an_updater_starts_from_the_packaged_default_given_an_attention_pool(
    settings: Settings, redis_ns: RedisNamespace, packaged: Path
) -> None:
    """It scores exactly as the default the scorers serve until it learns; with
    PROBEGUARD_DEFAULT_ATTENTION=false it is the default's mean pool as shipped."""
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    fp = extractor().fingerprint
    default = worker.defaults.find_default(fp, "toxicity")
    assert default is not None and default.probe.spec.token_pool == "mean"
    start = starting_point(settings, registry, extractor())
    assert start.probe.spec.token_pool == "mha" and start.version is None
    assert start.source.endswith("given an attention pool") and not start.fresh
    ex = extractor().extract([GOOD[0], "you absolute clown", "BUY NOW cheap pills"], [1, 2])
    torch.testing.assert_close(
        start.probe.eval().predict_proba_many(ex.hidden, ex.mask),
        default.probe.eval().predict_proba_many(ex.hidden, ex.mask),
        rtol=0,
        atol=1e-6,
    )
    kept = starting_point(fast(settings, default_attention=False), registry, extractor())
    assert kept.probe.spec.token_pool == "mean"
    frozen = starting_point(fast(settings, learn_freeze_shared=True), registry, extractor())
    assert frozen.probe.spec.token_pool == "mean"  # a frozen block would never learn


def test_an_offline_checkpoint_is_served_and_learned_from_when_nothing_is_published(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], tmp_path: Path
) -> None:
    """The offline -> online hand-off: the scorer serves PROBEGUARD_BOOTSTRAP_CHECKPOINT at
    once (v0) and the updater starts from PROBEGUARD_SEED_CHECKPOINT, not from zero."""
    from probes import load_checkpoint
    from tests.registry_helpers import toxicity_spec

    fp = extractor().fingerprint
    offline = tmp_path / "offline-fit"
    spec = toxicity_spec(fp.hidden_size)
    save_checkpoint(build_probe(spec, seed=3), offline, llm=fp)
    seeded, _ = load_checkpoint(offline, fp)
    settings = fast(
        settings, bootstrap_checkpoint=offline, seed_checkpoint=offline, default_probe=False
    )
    ensure_topics(settings)
    scorer = Scorer(settings, extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    (first,) = chats(settings, "b", ["hello there"])
    assert first.results[0].version == 0 and first.results[0].heads is None
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    wait_until(lambda: updater.learner is not None, "the updater's resume")
    assert updater.learner is not None
    for name, tensor in seeded.state_dict().items():  # it starts from the seed's weights
        assert torch.equal(updater.learner.probe.state_dict()[name], tensor), name
