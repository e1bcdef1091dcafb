"""The updater against the real broker and Redis, on a tiny random LLM."""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from probes import build_probe, save_checkpoint
from probes.checkpoint import probe_from_bytes
from schemas import DeadLetter, HeadCalibration, Verdict
from schemas.messages import DEAD_LETTER_PAYLOAD_BYTES
from tests.conftest import RedisNamespace
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import Threaded, spawn, tiny_model_dir, wait_until
from tests.registry_helpers import toxicity_spec
from worker.kafka.clients import ensure_topics, make_admin
from worker.learning.resume import seed_spec
from worker.learning.updater import Updater
from worker.llm.extract import Extraction, HiddenStateExtractor
from worker.llm.tiny import make_tiny_gemma3, make_tiny_llm, settings_env
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

GOOD = ["what a lovely day", "thanks, that helps", "see you tomorrow", "nice work team"]
BAD = ["XXXX ZZZZ QQQQ!!!", "ZZZZ XXXX #### !!!", "QQQQ #### XXXX ZZZZ", "!!!! XXXX QQQQ"]


def toy(i: int) -> tuple[str, str]:
    """A learnable toy task: the tiny model's hidden states separate these two styles."""
    if i % 2:
        return f"{BAD[i % 4]} {i}", "toxic"
    return f"{GOOD[i % 4]} {i}", "non-toxic"


def label(i: int, with_text: bool = True, prefix: str = "l") -> bytes:
    text, lab = toy(i)
    body = {
        "message_id": f"{prefix}-{i}",
        "label": lab,
        "labeler_id": "alice",
        "created_at": "2026-11-30T12:00:00Z",
    }
    if with_text:
        body["text"] = text
    return json.dumps(body).encode()


def chat(mid: str, text: str) -> bytes:
    return json.dumps(
        {
            "message_id": mid,
            "conversation_id": "c",
            "text": text,
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


def fast(settings: Settings, **kw: object) -> Settings:
    base = {
        "publish_every_labels": 32,
        "publish_every_s": 1.0,
        "stats_warmup": 16,
        "learn_lr": 3e-3,
        "learn_batch_size": 16,
        "lease_ttl_ms": 2000,
        "stage_check_interval_s": 0.5,
        "metrics_port": 0,
    }
    return settings.model_copy(update={**base, **kw})


def extractor() -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=16)


def toy_verdicts(settings: Settings, tag: str, n: int) -> dict[int, Verdict]:
    """Send the toy texts 0..n-1 as chat messages ``{tag}-{i}``; their verdicts by i."""
    produce_raw(
        settings, settings.topic_chat, [(None, chat(f"{tag}-{i}", toy(i)[0])) for i in range(n)]
    )
    records = drain(
        settings,
        settings.topic_verdicts,
        lambda rs: sum(r.key.decode().startswith(tag) for r in rs) >= n,
        60,
    )
    got = [Verdict.decode(r.value) for r in records if r.key.decode().startswith(tag)]
    return {int(v.message_id.split("-")[1]): v for v in got}


def p_correct(settings: Settings, tag: str, n: int) -> float:
    """Send the toy texts as chat messages; mean probability the scorer gives the true label."""
    got = toy_verdicts(settings, tag, n)
    probs = [v.results[0].scores[toy(i)[1]] for i, v in got.items()]
    return sum(probs) / len(probs)


def test_labels_become_versions_that_scorers_serve_and_that_learn(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    settings = fast(settings)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    scorer = Scorer(settings, extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))

    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: registry.stages().live is not None, "a first version")
    first = registry.stages().live
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == first, "scorer swap")
    before = p_correct(settings, "a", 16)

    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32, 320)])
    wait_until(
        lambda: updater.labels_seen >= 320 and updater.unpublished == 0,
        "all labels learned and published",
    )
    last = registry.stages().live
    assert last is not None and first is not None and last > first
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == last, "scorer swap")
    after = p_correct(settings, "b", 16)
    # Later versions are better: the error (1 - mean probability of the true label) at
    # least halves. Not "+0.1": with the watcher thread a scorer swaps within milliseconds,
    # so `before` may already come from the 32-label version (0.90 once, then 1.0 after).
    assert after > before and 1 - after <= 0.5 * (1 - before), (before, after)
    manifest = registry.manifest(last)
    assert manifest.parent is not None and manifest.counters.labels_seen >= 320
    assert manifest.metrics["prequential_n"] > 0 and "prequential_f1" in manifest.metrics
    # The flag threshold was calibrated on the prequential window (plenty of positives).
    assert set(manifest.spec.thresholds) == {"toxic"}
    assert 0.0 <= manifest.spec.thresholds["toxic"] <= 1.0
    assert all(e.actor == "updater-a" for _, e in registry.history(100) if e.kind == "published")
    # Published with its training statistics (drift monitoring), on every layer it reads.
    assert manifest.drift is not None and manifest.drift.examples > 0
    assert len(manifest.drift.layer_mean) == len(manifest.spec.layers)
    assert abs(sum(manifest.drift.score_bins) - 1.0) < 1e-3


def test_a_gemma3_whose_states_exceed_fp16_scores_and_learns(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], tmp_path: Path
) -> None:
    """A tiny Gemma 3, saved as a model directory and loaded as any PROBEGUARD_MODEL is, whose
    residual stream exceeds fp16 as the real one's does: with the default STATE_DTYPE
    (auto) the updater keeps its replay in bf16 and learns from every label (in fp16 each
    would be refused as not finite), and the scorer serves what it publishes."""
    llm = make_tiny_gemma3(tmp_path, wide=True)
    assert llm.model_type == "gemma3_text" and settings.state_dtype == "auto"
    settings = fast(settings)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    updater = Updater(
        settings, HiddenStateExtractor(llm, max_tokens=64), redis_ns.client, worker_id="updater-g"
    )
    threads.append(Threaded(updater.run, updater.stop))
    scorer = Scorer(
        settings, HiddenStateExtractor(llm, max_tokens=64), redis_ns.client, worker_id="scorer-g"
    )
    threads.append(Threaded(scorer.run, scorer.stop))

    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: registry.stages().live is not None, "a first version")
    assert updater.learner is not None and updater.learner.config.state_dtype == "bfloat16"
    first = registry.stages().live
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == first, "scorer swap")
    before = p_correct(settings, "a", 16)

    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32, 192)])
    # labels_seen counts only the labels learned from: refused ones would never reach it.
    wait_until(
        lambda: updater.labels_seen >= 192 and updater.unpublished == 0,
        "all labels learned and published",
    )
    last = registry.stages().live
    assert last is not None and first is not None and last > first
    assert registry.manifest(last).counters.labels_seen >= 192
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == last, "scorer swap")
    got = toy_verdicts(settings, "b", 16)
    assert sorted(got) == list(range(16))
    assert all(v.results[0].version == last for v in got.values())
    after = sum(v.results[0].scores[toy(i)[1]] for i, v in got.items()) / len(got)
    assert after > before and after > 0.75, (before, after)


def test_a_calibrated_seed_is_recalibrated_on_the_window_once_it_holds_the_positives(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], tmp_path: Path
) -> None:
    """A probe `fit` calibrated keeps its calibration (and says how old it is) while the
    prequential window is short of positives, then gets it refitted there, and scorers
    serve the calibrated probabilities."""
    fp = extractor().fingerprint
    spec = toxicity_spec(fp.hidden_size).model_copy(update={"labels": ["non-toxic", "toxic"]})
    seed = build_probe(spec, seed=3)
    seed.set_calibration({"toxicity": HeadCalibration(temperature=5.0, bias=[1.0, -1.0])})
    save_checkpoint(seed, tmp_path / "fit", llm=fp)
    settings = fast(settings, seed_checkpoint=tmp_path / "fit", default_probe=False)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))

    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: registry.stages().live is not None, "a first version")
    first = registry.manifest(registry.stages().live)  # type: ignore[arg-type]
    # At most 16 toxic labels in the window, fewer than CALIBRATE_MIN_POSITIVES (20): the
    # calibration is kept, and the manifest says it is as old as the labels learned since.
    assert first.spec.calibration == seed.spec.calibration
    assert first.metrics["calibration_age/toxicity"] == first.counters.labels_seen > 0

    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32, 128)])
    wait_until(
        lambda: updater.labels_seen >= 128 and updater.unpublished == 0, "all labels published"
    )
    last = registry.manifest(registry.stages().live)  # type: ignore[arg-type]
    cal = last.spec.calibration["toxicity"]
    assert cal.temperature != 5.0 and cal.labels_seen == last.counters.labels_seen
    assert last.metrics["calibration_age/toxicity"] == 0.0
    assert "prequential_ece" in last.metrics and set(last.spec.thresholds) == {"toxic"}

    served = registry.stages().live
    scorer = Scorer(settings, extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == served, "scorer swap")
    stored = registry.get(served)  # type: ignore[arg-type]
    probe, _ = probe_from_bytes(stored.blob, stored.manifest_json, fp)
    ex = extractor().extract([toy(0)[0]], list(probe.layers))
    want = probe.predict_proba_many(ex.hidden.float(), ex.mask)[0]  # calibrated
    result = toy_verdicts(settings, "c", 1)[0].results[0]
    assert result.version == served
    assert result.scores["toxic"] == pytest.approx(float(want[1]), abs=1e-4)


def test_the_updater_publishes_int8_when_configured_and_scorers_serve_it(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    from probes.checkpoint import weight_format

    settings = fast(settings, publish_weights="int8")
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    scorer = Scorer(settings, extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: registry.stages().live is not None, "a first version")
    live = registry.stages().live
    assert live is not None and weight_format(registry.get(live).blob) == "int8"
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == live, "scorer swap")
    assert 0.0 <= p_correct(settings, "q", 4) <= 1.0


def test_unjoinable_and_unknown_labels_are_dead_lettered(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    settings = fast(settings)
    ensure_topics(settings)
    redis_ns.client.set(redis_ns.keys.text("cached-1"), "what a lovely day")
    updater = Updater(settings, extractor(), redis_ns.client)
    threads.append(Threaded(updater.run, updater.stop))
    records = [(None, label(i)) for i in range(20)]
    records.append((None, label(1, with_text=False, prefix="nowhere")))  # no text, none cached
    records.append(
        (
            None,
            json.dumps(
                {
                    "message_id": "cached-1",
                    "label": "non-toxic",
                    "labeler_id": "bob",
                    "created_at": "2026-11-30T12:00:00Z",
                }
            ).encode(),
        )
    )
    # An unknown label on a valid but large text (~360 kB as JSON): its letter is bounded.
    spam = json.dumps(
        {
            "message_id": "x-1",
            "label": "spam",
            "text": "buy now " + "\U0001f4b0" * 30_000,
            "labeler_id": "bob",
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()
    records.append((None, spam))
    produce_raw(settings, settings.topic_labels, records)
    dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= 2, 60)
    letters = {DeadLetter.decode(r.value).error_kind: r.value for r in dead}
    assert sorted(letters) == ["unjoinable", "unknown_label"]
    unknown = DeadLetter.decode(letters["unknown_label"])
    assert unknown.truncated and unknown.payload_size == len(spam)
    assert unknown.payload_sha256 == hashlib.sha256(spam).hexdigest()
    assert base64.b64decode(unknown.payload_b64) == spam[:DEAD_LETTER_PAYLOAD_BYTES]
    assert len(letters["unknown_label"]) < 2 * DEAD_LETTER_PAYLOAD_BYTES
    wait_until(
        lambda: updater.labels_seen >= 21,
        "the joinable labels learned",
    )


def test_sigkill_and_restart_resumes_without_losing_labels(
    settings: Settings, redis_ns: RedisNamespace, tmp_path: Path
) -> None:
    settings = fast(settings)
    ensure_topics(settings)
    model_dir, _ = tiny_model_dir(tmp_path)
    env = settings_env(
        settings,
        model_dir,
        publish_every_labels=32,
        publish_every_s=1,
        stats_warmup=16,
        learn_batch_size=16,
        lease_ttl_ms=2000,
    )
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    log = tmp_path / "updater.log"
    n = 400
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(n)])
    proc = spawn("train", env, log)
    try:
        wait_until(lambda: len(registry.versions()) >= 2, "two versions", 120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = registry.versions()
        proc = spawn("train", env, log)  # waits out the dead holder's lease, then resumes
        wait_until(
            lambda: (
                (latest := registry.latest()) is not None
                and registry.manifest(latest).counters.labels_seen >= n
            ),
            "every label reflected in a published version",
            180,
        )
        versions = registry.versions()
        assert versions == sorted(versions) and versions[: len(killed_at)] == killed_at
        resumed = [registry.manifest(v) for v in versions[len(killed_at) :]]
        assert resumed and resumed[0].parent == killed_at[-1], log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_updaters_one_writer_and_failover(
    settings: Settings, redis_ns: RedisNamespace, tmp_path: Path
) -> None:
    settings = fast(settings)
    ensure_topics(settings)
    model_dir, _ = tiny_model_dir(tmp_path)
    env = settings_env(
        settings,
        model_dir,
        publish_every_labels=16,
        publish_every_s=1,
        stats_warmup=16,
        learn_batch_size=16,
        lease_ttl_ms=2000,
    )
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    procs = {
        name: spawn("train", {**env, "PROBEGUARD_WORKER_ID": name}, tmp_path / f"{name}.log")
        for name in ("upd-a", "upd-b")
    }
    try:
        produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(64)])
        wait_until(lambda: len(registry.versions()) >= 2, "versions", 120)
        holder = registry.history(1)[0][1].actor
        publishers = {e.actor for _, e in registry.history(100) if e.kind == "published"}
        assert publishers == {holder}
        procs[holder].send_signal(signal.SIGKILL)
        procs[holder].wait(10)
        other = next(n for n in procs if n != holder)
        produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(64, 128)])
        wait_until(
            lambda: any(
                e.actor == other for _, e in registry.history(100) if e.kind == "published"
            ),
            "the standby to take over",
            120,
        )
        versions = registry.versions()
        assert versions == sorted(set(versions))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def committed(settings: Settings, group: str) -> int:
    """Offsets committed by ``group`` on the labels topic, summed over partitions."""
    admin = make_admin(settings)
    try:
        offsets = admin.list_group_offsets(group).get(group, {})
    finally:
        admin.close()
    return sum(max(o.offset, 0) for tp, o in offsets.items() if tp.topic == settings.topic_labels)


def test_sigterm_during_warm_up_publishes_nothing_and_commits_nothing(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    # Review C2: a stop during the stats warm-up used to publish a random probe with
    # identity normalization (live at once in auto_live) and commit the warm-up labels
    # unlearned; the next updater resumed from it and never fixed the normalization.
    settings = fast(settings, stats_warmup=24, publish_every_labels=8)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    first = Updater(settings, extractor(), redis_ns.client, worker_id="updater-a")
    running = Threaded(first.run, first.stop)
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(10)])
    wait_until(
        lambda: first.learner is not None and len(first.learner.warmup or []) == 10,
        "ten labels in the warm-up",
    )
    running.stop()  # SIGTERM
    assert registry.versions() == []
    assert registry.stages().live is None
    assert committed(settings, settings.updater_group("toxicity")) == 0
    # The next updater starts from zero again, gets the ten labels again, and completes
    # the warm-up: the normalization is fixed from data.
    second = Updater(settings, extractor(), redis_ns.client, worker_id="updater-b")
    threads.append(Threaded(second.run, second.stop))
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(10, 24)])
    wait_until(lambda: registry.latest() is not None, "a first version")
    latest = registry.latest()
    assert latest is not None
    manifest = registry.manifest(latest)
    assert manifest.counters.labels_seen == 24 and manifest.parent is None
    probe, _ = probe_from_bytes(registry.get(latest).blob, registry.get(latest).manifest_json, None)
    assert not torch.equal(probe.shift, torch.zeros_like(probe.shift))
    assert not torch.equal(probe.scale, torch.ones_like(probe.scale))
    # Now that a version reflects them, the labels are committed.
    wait_until(lambda: committed(settings, settings.updater_group("toxicity")) == 24, "the commit")


def spam_label(i: int, probe: str | None = None, lab: str | None = None) -> bytes:
    body = {
        "message_id": f"s-{i}",
        "label": lab or ("spam" if i % 2 else "ham"),
        "text": f"buy cheap pills now {i}" if i % 2 else f"lunch at noon? {i}",
        "labeler_id": "carol",
        "created_at": "2026-11-30T12:00:00Z",
    }
    if probe is not None:
        body["probe"] = probe
    return json.dumps(body).encode()


def test_two_probes_two_updaters_each_learns_all_of_its_labels(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded], tmp_path: Path
) -> None:
    # Review C3: updaters of different probes shared one consumer group, so Kafka split the
    # label partitions between them and each dead-lettered the other's labels as
    # unknown_label: each probe learned from about half of its labels.
    settings = fast(settings, probes="toxicity,spam", publish_every_labels=1000)
    ensure_topics(settings)
    spam_spec = tmp_path / "spam.json"
    spam_spec.write_text(
        toxicity_spec(extractor().hidden_size, name="spam")
        .model_copy(update={"labels": ["ham", "spam"], "flag_labels": ["spam"]})
        .model_dump_json()
    )
    updaters = {}
    for name, extra in (("toxicity", {}), ("spam", {"seed_spec": spam_spec})):
        s = settings.model_copy(update={"train_probe": name, **extra})
        updaters[name] = Updater(s, extractor(), redis_ns.client, worker_id=f"updater-{name}")
        threads.append(Threaded(updaters[name].run, updaters[name].stop))
    n = 24
    records = [(None, label(i)) for i in range(n)] + [(None, spam_label(i)) for i in range(n)]
    # Addressed labels: "toxic" addressed to spam is spam's unknown label (dead letter),
    # and is not learned by toxicity either.
    records += [(None, spam_label(100 + i, probe="spam", lab="toxic")) for i in range(3)]
    produce_raw(settings, settings.topic_labels, records)
    registries = {n: CheckpointRegistry(redis_ns.client, redis_ns.keys, n) for n in updaters}

    def learned(name: str) -> int:
        latest = registries[name].latest()
        return 0 if latest is None else registries[name].manifest(latest).counters.labels_seen

    wait_until(lambda: learned("toxicity") >= n and learned("spam") >= n, "both probes", 90)
    dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) > 3, 3)
    letters = [DeadLetter.decode(r.value) for r in dead]
    assert sorted(d.error_kind for d in letters) == ["unknown_label"] * 3
    assert learned("toxicity") == n and learned("spam") == n
    assert registries["spam"].manifest(registries["spam"].latest() or 0).counters.per_label == {
        "ham": n // 2,
        "spam": n // 2,
    }


def test_labels_nothing_is_learned_from_are_committed_at_once(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    # Review C7: a batch of only unjoinable labels left nothing to publish, so its offsets
    # waited for the next learnable label and every restart dead-lettered them again.
    settings = fast(settings)
    ensure_topics(settings)
    updater = Updater(settings, extractor(), redis_ns.client)
    threads.append(Threaded(updater.run, updater.stop))
    records = [(None, label(i, with_text=False, prefix="gone")) for i in range(3)]
    produce_raw(settings, settings.topic_labels, records)
    dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= 3, 60)
    assert [DeadLetter.decode(r.value).error_kind for r in dead] == ["unjoinable"] * 3
    wait_until(lambda: committed(settings, settings.updater_group("toxicity")) == 3, "commit")


class Slow(HiddenStateExtractor):
    """An extractor whose every batch takes ``delay_s`` (a big backlog on a slow CPU)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(make_tiny_llm(), max_tokens=64, batch_size=16)
        self.delay_s = delay_s

    def extract(self, texts: Sequence[str | bytes], layers: Sequence[int]) -> Extraction:
        time.sleep(self.delay_s)
        return super().extract(texts, layers)


def test_a_batch_longer_than_the_lease_keeps_the_lease(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    # Review S1: the lease was renewed only between batches; a batch longer than its TTL
    # lost it to the standby, and the two thrashed (and a re-acquired lease with a new
    # token was not treated as a break).
    settings = fast(settings, lease_ttl_ms=1000, publish_every_labels=16)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    a = Updater(settings, Slow(2.0), redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(a.run, a.stop))
    wait_until(lambda: a.active, "updater-a to hold the lease")
    b = Updater(settings, extractor(), redis_ns.client, worker_id="updater-b")
    threads.append(Threaded(b.run, b.stop))
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(48)])
    wait_until(
        lambda: (
            registry.latest() is not None
            and registry.manifest(registry.latest() or 0).counters.labels_seen >= 48
        ),
        "every label in a published version",
        120,
    )
    publishers = {e.actor for _, e in registry.history(100) if e.kind == "published"}
    assert publishers == {"updater-a"}
    assert a.active and not b.active
    assert not a.keeper.lost.is_set()


def test_layers_whose_weight_stays_negligible_are_dropped_and_scorers_serve_it(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    """With PROBEGUARD_LEARN_DROP_LAYER_WEIGHT above every layer's weight (the entropy
    penalty keeps the cold-start mix near uniform, 1/L each), the first publish drops
    every layer but the shallowest: a new version, verified and served like any other,
    whose forward pass stops at that layer; learning goes on from it."""
    settings = fast(settings, learn_drop_layer_weight=0.9, learn_drop_layer_publishes=1)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    ex = extractor()
    updater = Updater(settings, ex, redis_ns.client, worker_id="updater-a")
    threads.append(Threaded(updater.run, updater.stop))
    scorer = Scorer(settings, extractor(), redis_ns.client, worker_id="scorer-1")
    threads.append(Threaded(scorer.run, scorer.stop))
    seed_layers = seed_spec(settings, ex, updater.name).layers
    assert len(seed_layers) > 1

    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32)])
    wait_until(lambda: registry.stages().live is not None, "a first version")
    first = registry.stages().live
    assert first is not None
    manifest = registry.manifest(first)
    assert manifest.spec.layers == seed_layers[:1]
    events = [e for _, e in registry.history(100) if e.kind == "published"]
    assert any("dropped layers" in e.reason for e in events)
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == first, "scorer swap")
    assert scorer.batch_scorer.layers() == tuple(seed_layers[:1])
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(32, 96)])
    wait_until(lambda: (registry.stages().live or 0) > first, "a later version")
    later = registry.manifest(registry.stages().live or 0)
    assert later.spec.layers == seed_layers[:1] and later.parent is not None


def test_the_updater_remembers_only_the_versions_the_registry_keeps(
    settings: Settings, redis_ns: RedisNamespace, threads: list[Threaded]
) -> None:
    """L11: ``Updater.published`` gained one version per publish for the process's life
    (a long-running updater publishing every minute: half a million a year); it keeps
    those still retained, all that the superseded-by-add-head check can meet."""
    settings = fast(settings, keep_versions=2)
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    updater = Updater(settings, extractor(), redis_ns.client, worker_id="updater-keep")
    threads.append(Threaded(updater.run, updater.stop))
    produce_raw(settings, settings.topic_labels, [(None, label(i)) for i in range(192)])
    wait_until(
        lambda: updater.labels_seen >= 192 and updater.unpublished == 0,
        "all labels learned and published",
    )
    latest = registry.latest()
    assert latest is not None and latest >= 4  # several publishes, some pruned
    retained = set(registry.versions())
    assert len(retained) < latest
    assert updater.published and set(updater.published) <= retained
    assert updater.published[-1] == latest
