"""A custom category from a few labels, through the real broker and Redis on a tiny random
LLM: an operator adds a head to the live multi-head version while an updater holds the
lease; the updater resumes from the new version (Lion momentum of the old rows kept), and
labels naming the new head train it into a published version."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from pydantic import SecretStr

from probes import Probe, build_probe, checkpoint_to_bytes, probe_from_bytes
from schemas import HeadSpec, ProbeSpec
from tests.conftest import RedisNamespace
from tests.integration.test_heads_e2e import RUDE, SPAM
from tests.integration.test_updater import GOOD, extractor, fast
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, wait_until
from worker.cli import main
from worker.errors import RolloutError
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.rollout.heads import add_head_version, parse_head
from worker.rollout.operator import Operator
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore

pytestmark = pytest.mark.integration

KEY = "an-hmac-key-for-this-test-0123456789"


def base_spec(hidden_size: int) -> ProbeSpec:
    return ProbeSpec(
        name="toxicity",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=hidden_size,
        task="multilabel",
        labels=["non-toxic", "toxic", "spam"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
            HeadSpec(name="spam", task="multilabel", labels=["spam"]),
        ],
        flag_labels=["toxic", "spam"],
    )


def jailbreak_labels(n: int, tag: str) -> list[tuple[None, bytes]]:
    """Labels for the new head alone: SPAM texts are its positives, the others negatives."""
    out = []
    for i in range(n):
        positive = i % 2 == 0
        text = SPAM[i // 2 % 4] if positive else [*GOOD, *RUDE][i // 2 % 8]
        text += f" {i}"
        body = {
            "message_id": f"{tag}-{i}",
            "labeler_id": "alice",
            "created_at": "2026-12-01T12:00:00Z",
            "text": text,
            "head": "jailbreak",
            "labels": ["jailbreaking"] if positive else [],
        }
        out.append((None, json.dumps(body).encode()))
    return out


def assigned(updater: Updater) -> bool:
    loop = updater.loop
    return loop is not None and bool(loop.consumer.assignment())


def test_an_added_head_is_picked_up_by_the_running_updater_and_learns(
    settings: Settings,
    redis_ns: RedisNamespace,
    threads: list[Threaded],
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = fast(
        settings, checkpoint_hmac_key=SecretStr(KEY), rollout="manual", learn_steps_per_batch=4
    )
    key = settings.signing_key
    ensure_topics(settings)
    ex = extractor()
    fp = ex.fingerprint
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity", signing_key=key)
    base = build_probe(base_spec(fp.hidden_size), seed=0)
    # A served probe has its input normalization (the tiny LLM's states are small).
    got = ex.extract([*GOOD, *RUDE, *SPAM], base.layers)
    tokens = got.hidden.float()[:, got.mask]  # [L, N_tok, D]
    base.set_input_stats(tokens.mean(dim=1), tokens.std(dim=1).clamp_min(1e-6))
    v1 = registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(
        base, llm=fp, version=v1, signing_key=key, deployment=redis_ns.prefix
    )
    registry.publish(blob, manifest, set_live=True, actor="test")
    # Momentum published with v1 (3 label rows); the grown version keeps it by label.
    # (Small: a large made-up momentum would steer the mix for many steps.)
    momentum = {name: torch.full_like(p, 1e-6) for name, p in base.named_parameters()}
    registry.save_optimizer_state(v1, momentum)

    caplog.set_level(logging.INFO, logger="worker.learning")
    updater = Updater(settings, ex, redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    wait_until(lambda: updater.active and updater.parent == v1, "the updater resumes from v1")
    # Its consumer in the group (one that leaves mid-join stalls the next join on this broker).
    wait_until(lambda: assigned(updater), "the updater's partitions")

    operator = Operator(registry, EvidenceStore(redis_ns.client, redis_ns.keys), actor="alice")
    head, flags = parse_head("jailbreak", "jailbreaking", flag=True)
    added = add_head_version(operator, head, flag_labels=flags)
    v2 = added.version
    assert added.parent == v1 and "updater updater-a holds the lease" in added.message
    m2 = registry.manifest(v2)
    assert m2.parent == v1 and m2.stage == "candidate" and m2.signature is not None
    assert registry.stages().live == v1  # staged by the policy or an operator, like any version
    assert m2.spec.thresholds["jailbreaking"] == 1.0  # silent until calibrated
    assert [h.name for h in m2.spec.heads] == ["toxicity", "spam", "jailbreak"]

    # The running updater notices the version it did not publish and resumes from it.
    wait_until(lambda: updater.parent == v2 and assigned(updater), "the updater resumes from v2")
    restored = [r.getMessage() for r in caplog.records if "restored Lion state" in r.message]
    assert restored and f"of v{v1} ({len(momentum)} tensors) for v{v2}" in restored[-1]
    assert updater.learner is not None
    state = updater.learner.optimizer_state()
    assert torch.equal(state["head.weight"][:3], momentum["head.weight"])
    assert not state["head.weight"][3].any()  # the new head's momentum starts at zero

    produce_raw(settings, settings.topic_labels, jailbreak_labels(96, "j"))

    def learned_all() -> bool:
        newest = registry.latest()
        return newest != v2 and registry.manifest(newest).counters.labels_seen >= 96  # type: ignore[arg-type]

    wait_until(learned_all, "a version trained on all the new head's labels", timeout_s=120)
    v3 = updater.published[-1]
    stored = registry.get(v3)
    trained, m3 = probe_from_bytes(
        stored.blob, stored.manifest_json, fp, signing_key=key, deployment=redis_ns.prefix
    )
    assert (
        m3.parent is not None
        and m3.parent >= v2
        and m3.counters.per_label.get("jailbreaking", 0) > 0
    )
    s2 = registry.get(v2)
    grown = probe_from_bytes(
        s2.blob, s2.manifest_json, fp, signing_key=key, deployment=redis_ns.prefix
    )[0]
    pos = [t + " x" for t in SPAM]
    neg = [t + " x" for t in [*GOOD, *RUDE]]
    cols = m3.spec.head_columns("jailbreak")

    def scores(probe: Probe, texts: list[str]) -> torch.Tensor:
        got = ex.extract(texts, trained.layers)
        return probe.predict_proba_many(got.hidden.float(), got.mask)[:, cols].flatten()

    before = scores(grown, pos).mean() - scores(grown, neg).mean()
    after = scores(trained, pos).mean() - scores(trained, neg).mean()
    assert float(before) == pytest.approx(0.0, abs=1e-6)  # a zero head: 0.5 everywhere
    assert float(after) > 0.05, f"the new head did not learn: margin {float(after):.3f}"
    print(f"jailbreak margin after {m3.counters.labels_seen} labels: {float(after):.3f}")


def test_add_head_refusals_through_the_cli(
    redis_ns: RedisNamespace,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PROBEGUARD_REDIS_URL", redis_ns.url)
    monkeypatch.setenv("PROBEGUARD_REDIS_PREFIX", redis_ns.prefix)
    monkeypatch.setenv("PROBEGUARD_PROBES", "toxicity")
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    operator = Operator(registry, EvidenceStore(redis_ns.client, redis_ns.keys), actor="alice")
    with pytest.raises(RolloutError, match="no live version"):
        add_head_version(operator, parse_head("jb", "jailbreaking")[0])
    with pytest.raises(RolloutError, match="--flag names"):
        parse_head("jb", "jailbreaking", flag="nope")
    fp = extractor().fingerprint
    v = registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(
        build_probe(base_spec(fp.hidden_size), seed=0), llm=fp, version=v
    )
    registry.publish(blob, manifest, set_live=True)
    args = ["probe", "add-head", "toxicity", "spam", "--labels", "x"]
    assert main(args) == 1
    assert "already has a head 'spam'" in capsys.readouterr().err
    assert main(["probe", "add-head", "toxicity", "ads", "--labels", "spam"]) == 1
    assert "already belong" in capsys.readouterr().err
    assert main(["probe", "add-head", "toxicity", "jailbreak", "--labels", "jailbreaking"]) == 0
    out = capsys.readouterr().out
    assert f"v{v + 1} adds head 'jailbreak'" in out and "no updater holds the lease" in out
    assert registry.manifest(v + 1).spec.flag_labels == ["toxic", "spam"]
