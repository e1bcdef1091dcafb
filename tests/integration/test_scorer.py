"""The scoring worker against the real broker and Redis, on a tiny random LLM."""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from probes.checkpoint import checkpoint_to_bytes
from probes.probe import build_probe
from schemas import ChatMessage, CheckpointManifest, DeadLetter, ProbeSpec, ReviewRequest, Verdict
from tests.conftest import RedisNamespace
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import spawn, tiny_model_dir, wait_until
from tests.registry_helpers import publish_probe
from worker.embedded import free_port
from worker.kafka.clients import ensure_topics
from worker.llm.extract import Extraction, HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm, settings_env
from worker.scoring.engine import ScoringEngine
from worker.scoring.scorer import Scorer, ScorerMetrics
from worker.scoring.served import ServedProbe
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration


def chat(i: int, text: str | None = None, conv: str | None = None) -> bytes:
    return json.dumps(
        {
            "message_id": f"m-{i}",
            "conversation_id": conv or f"c-{i % 5}",
            "text": text if text is not None else f"hello number {i}, how are you?",
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


def extractor(settings: Settings) -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=8)


class Running:
    """A scorer on a thread; stopped (gracefully) at exit."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.scorer.run()
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.scorer.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "scorer did not stop"
        assert self.error is None, self.error


@pytest.fixture
def scorers(settings: Settings, redis_ns: RedisNamespace) -> Iterator[list[Running]]:
    running: list[Running] = []
    yield running
    for r in running:
        r.stop()


def start(settings: Settings, redis_ns: RedisNamespace, running: list[Running], **kw) -> Scorer:
    scorer = Scorer(settings, extractor(settings), redis_ns.client, metrics_port=0, **kw)
    running.append(Running(scorer))
    return scorer


def verdicts(settings: Settings, n: int, timeout_s: float = 90) -> list[Verdict]:
    records = drain(
        settings, settings.topic_verdicts, lambda rs: len({r.key for r in rs}) >= n, timeout_s
    )
    return [Verdict.decode(r.value) for r in records]


def test_two_scorers_one_verdict_per_message(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    ensure_topics(settings)
    fp = extractor(settings).fingerprint
    version = publish_probe(CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"), fp)
    for _ in range(2):
        start(settings, redis_ns, scorers, worker_id=None)
    n = 120
    produce_raw(settings, settings.topic_chat, [(f"m-{i}".encode(), chat(i)) for i in range(n)])
    got = verdicts(settings, n)
    by_id = {v.message_id: v for v in got}
    assert sorted(by_id) == sorted(f"m-{i}" for i in range(n))
    assert len(got) == n  # no duplicates in a clean run
    assert all(v.results[0].version == version and not v.results[0].canary for v in got)
    assert {v.worker_id for v in got} == {s.scorer.worker_id for s in scorers}
    # Text cache for label joins, namespaced and with a TTL.
    key = redis_ns.keys.text("m-7")
    assert redis_ns.client.get(key) == b"hello number 7, how are you?"
    assert 0 < redis_ns.client.ttl(key) <= settings.text_cache_ttl_s


def test_poison_messages_are_dead_lettered_and_the_rest_scored(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    ensure_topics(settings)
    publish_probe(
        CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"),
        extractor(settings).fingerprint,
    )
    poison = [
        b"not json",
        b"\xff\xfe\xfa",
        b"",
        b"[]",
        b'{"message_id": "x"}',
        chat(9001, "   "),
        chat(9002, "x" * 40_000),
        chat(9003).replace(b'"m-9003"', b'"bad id"'),
        chat(9004).replace(b"{", b'{"surprise": true, ', 1),
        chat(9005, "\x00\x01\x02\x03"),  # valid JSON, nothing the model can read
    ]
    records: list[tuple[bytes | None, bytes]] = []
    for i in range(30):
        records.append((f"m-{i}".encode(), chat(i)))
        if i < len(poison):
            records.append((b"poison", poison[i]))
    start(settings, redis_ns, scorers)
    produce_raw(settings, settings.topic_chat, records)
    got = verdicts(settings, 30)
    assert sorted({v.message_id for v in got}) == sorted(f"m-{i}" for i in range(30))
    dead = drain(settings, settings.topic_dead_letter, lambda rs: len(rs) >= len(poison))
    letters = [DeadLetter.decode(r.value) for r in dead]
    assert len(letters) == len(poison)
    kinds = sorted(d.error_kind for d in letters)
    assert kinds.count("invalid_json") >= 2 and "unscorable" in kinds and "schema" in kinds
    assert all(d.error_message for d in letters)


def test_hot_swap_and_refusal_of_bad_checkpoints(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    settings = settings.model_copy(update={"stage_check_interval_s": 0.5})
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    fp = extractor(settings).fingerprint
    v1 = publish_probe(registry, fp, seed=1)
    scorer = start(settings, redis_ns, scorers)
    produce_raw(settings, settings.topic_chat, [(None, chat(i)) for i in range(10)])
    assert {v.results[0].version for v in verdicts(settings, 10)} == {v1}

    # A checkpoint for another LLM (fingerprint differs) is refused; v1 keeps serving.
    other = fp.model_copy(update={"tokenizer_sha256": hashlib.sha256(b"other").hexdigest()})
    v_bad = publish_probe(registry, other, seed=2)
    wait_until(lambda: v_bad in scorer.watcher.refused["toxicity"], "v_bad refused")
    # A corrupted blob: published fine, then flipped in Redis before any scorer loads it.
    v_corrupt = publish_probe(registry, fp, seed=3, set_live=False)
    redis_ns.client.set(registry.keys.ckpt(registry.probe, v_corrupt), b"garbage")
    registry.promote(v_corrupt)
    wait_until(lambda: v_corrupt in scorer.watcher.refused["toxicity"], "v_corrupt refused")
    produce_raw(settings, settings.topic_chat, [(None, chat(i)) for i in range(10, 20)])
    got = verdicts(settings, 20)
    assert {
        v.results[0].version for v in got if v.message_id in {f"m-{i}" for i in range(10, 20)}
    } == {v1}
    assert scorer.watcher.versions()["toxicity"]["live"] == v1

    # A good version published mid-stream is picked up without a restart.
    v2 = publish_probe(registry, fp, seed=4)
    deadline = time.monotonic() + 20
    while scorer.watcher.versions()["toxicity"]["live"] != v2 and time.monotonic() < deadline:
        produce_raw(settings, settings.topic_chat, [(None, chat(99))])
        time.sleep(0.3)
    produce_raw(settings, settings.topic_chat, [(None, chat(i)) for i in range(20, 30)])
    got = verdicts(settings, 30)
    late = [v for v in got if v.message_id in {f"m-{i}" for i in range(20, 30)}]
    assert late and {v.results[0].version for v in late} == {v2}


def test_int8_checkpoints_round_trip_are_served_and_verified(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    from probes.checkpoint import probe_from_bytes, weight_format
    from probes.probe import build_probe
    from tests.registry_helpers import toxicity_spec

    settings = settings.model_copy(update={"stage_check_interval_s": 0.5})
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    fp = extractor(settings).fingerprint
    probe = build_probe(toxicity_spec(fp.hidden_size), seed=5)
    v8 = publish_probe(registry, fp, probe=probe, weights="int8")
    stored = registry.get(v8)  # the registry's round trip: sha256 verified on read
    assert weight_format(stored.blob) == "int8"
    loaded, _ = probe_from_bytes(stored.blob, stored.manifest_json, fp)
    hidden, mask = torch.randn(2, 3, 5, fp.hidden_size), torch.ones(3, 5, dtype=torch.bool)
    want = probe.predict_proba_many(hidden, mask)
    assert (loaded.predict_proba_many(hidden, mask) - want).abs().max() < 0.02

    scorer = start(settings, redis_ns, scorers)
    produce_raw(settings, settings.topic_chat, [(None, chat(i)) for i in range(10)])
    assert {v.results[0].version for v in verdicts(settings, 10)} == {v8}
    # A corrupted int8 blob is refused like a corrupted fp32 one; v8 keeps serving.
    v_corrupt = publish_probe(registry, fp, seed=6, set_live=False, weights="int8")
    key = registry.keys.ckpt(registry.probe, v_corrupt)
    raw = redis_ns.client.get(key)
    assert isinstance(raw, bytes)
    blob = bytearray(raw)
    blob[-2] ^= 0x01
    redis_ns.client.set(key, bytes(blob))
    registry.promote(v_corrupt)
    wait_until(lambda: v_corrupt in scorer.watcher.refused["toxicity"], "corrupt int8 refused")
    assert scorer.watcher.versions()["toxicity"]["live"] == v8


def test_metrics_and_health_endpoints(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    ensure_topics(settings)
    port = free_port()
    settings = settings.model_copy(update={"metrics_port": port})
    scorer = Scorer(settings, extractor(settings), redis_ns.client)
    url = f"http://127.0.0.1:{port}"
    scorers.append(Running(scorer))
    time.sleep(0.5)
    with pytest.raises(urllib.error.HTTPError) as info:  # no probe published yet
        urllib.request.urlopen(f"{url}/readyz", timeout=5)
    assert info.value.code == 503
    assert urllib.request.urlopen(f"{url}/healthz", timeout=5).status == 200
    publish_probe(
        CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"),
        extractor(settings).fingerprint,
    )
    produce_raw(settings, settings.topic_chat, [(None, chat(i)) for i in range(5)])
    verdicts(settings, 5)
    body = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    assert "probeguard_scorer_messages_total 5.0" in body
    assert 'probeguard_scorer_probe_version{probe="toxicity",stage="live"}' in body
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/readyz", timeout=5).status == 200:
                break
        except urllib.error.HTTPError:
            time.sleep(0.2)
    else:
        pytest.fail("scorer never became ready")


def test_sigkill_mid_stream_loses_nothing_and_sigterm_exits_zero(
    settings: Settings, redis_ns: RedisNamespace, tmp_path: Path
) -> None:
    ensure_topics(settings)
    model_dir, llm = tiny_model_dir(tmp_path)  # saved to disk so a subprocess can load it
    publish_probe(CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"), llm.fingerprint)
    n = 400
    produce_raw(settings, settings.topic_chat, [(f"m-{i}".encode(), chat(i)) for i in range(n)])
    log = tmp_path / "scorer.log"
    env = settings_env(settings, model_dir, batch_size=8)
    proc = spawn("score", env, log)
    try:
        # Kill it once it has produced some verdicts but not all.
        drain(settings, settings.topic_verdicts, lambda rs: len(rs) >= 40, 90)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = spawn("score", env, log)
        got = verdicts(settings, n, timeout_s=180)
        assert {v.message_id for v in got} == {f"m-{i}" for i in range(n)}, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_review_queue_is_rate_limited(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    # Every message is "uncertain" with a band of [0, 1]; only 7 may go to reviewers.
    settings = settings.model_copy(
        update={
            "review_low": 0.0,
            "review_high": 1.0,
            "review_max_per_window": 7,
            "review_window_s": 3600,
        }
    )
    ensure_topics(settings)
    publish_probe(
        CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"),
        extractor(settings).fingerprint,
    )
    start(settings, redis_ns, scorers)
    produce_raw(settings, settings.topic_chat, [(None, chat(i)) for i in range(30)])
    verdicts(settings, 30)
    reviews = drain(settings, settings.topic_review, lambda rs: len(rs) >= 8, 5)
    assert len(reviews) == 7
    req = ReviewRequest.decode(reviews[0].value)
    assert req.reason == "uncertain" and req.text.startswith("hello number")


def _readyz(port: int | None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError:
        return 0, "not listening yet"


def test_a_device_fault_stalls_the_scorer_visibly_and_dead_letters_nothing(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    # Out of device memory says nothing about the messages: they wait (the batch is
    # rewound), /readyz says the scorer cannot progress, and once the device recovers
    # every message is scored. It used to dead-letter them all as "unscorable".
    ensure_topics(settings)
    settings = settings.model_copy(update={"stall_not_ready_s": 0.5})
    publish_probe(
        CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"),
        extractor(settings).fingerprint,
    )
    scorer = Scorer(settings, extractor(settings), redis_ns.client, metrics_port=free_port())
    scorers.append(Running(scorer))
    wait_until(lambda: _readyz(scorer.port)[0] == 200, "the scorer to be ready", 60)
    healthy = scorer.extractor._run
    faults: list[int] = []

    def out_of_memory(*args: object, **kw: object) -> None:
        faults.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    scorer.extractor._run = out_of_memory  # type: ignore[method-assign]
    produce_raw(settings, settings.topic_chat, [(f"m-{i}".encode(), chat(i)) for i in range(6)])
    wait_until(lambda: "stalled" in _readyz(scorer.port)[1], "/readyz to report the stall", 60)
    assert _readyz(scorer.port)[0] == 503
    metrics = scorer.metrics.collector
    retries = metrics.get_sample_value(
        "probeguard_scorer_loop_retries_total", {"reason": "transient"}
    )
    assert retries is not None and retries >= 1
    scorer.extractor._run = healthy  # type: ignore[method-assign]
    got = verdicts(settings, 6)
    assert sorted({v.message_id for v in got}) == [f"m-{i}" for i in range(6)]
    assert faults
    wait_until(lambda: _readyz(scorer.port)[0] == 200, "ready again", 30)
    assert drain(settings, settings.topic_dead_letter, lambda rs: bool(rs), 2) == []


class GatedExtractor(HiddenStateExtractor):
    """Holds each batch at the start of its extraction while ``gate`` is clear."""

    def __init__(self) -> None:
        super().__init__(make_tiny_llm(), max_tokens=64, batch_size=8)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def extract(self, texts: Sequence[str | bytes], layers: Sequence[int]) -> Extraction:
        self.entered.set()
        assert self.gate.wait(60), "the test never released the batch"
        return super().extract(texts, layers)


def test_a_version_published_mid_batch_is_swapped_in_before_that_batch_ends(
    settings: Settings, redis_ns: RedisNamespace, scorers: list[Running]
) -> None:
    # The periodic stage check is far off: only the event stream can bring v2 in time.
    settings = settings.model_copy(update={"stage_check_interval_s": 300.0})
    assert settings.probe_watch == "thread"
    ensure_topics(settings)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    ex = GatedExtractor()
    v1 = publish_probe(registry, ex.fingerprint, seed=1)
    scorer = Scorer(settings, ex, redis_ns.client, metrics_port=0)
    running = Running(scorer)
    scorers.append(running)
    produce_raw(settings, settings.topic_chat, [(b"m-0", chat(0))])
    assert [v.results[0].version for v in verdicts(settings, 1)] == [v1]

    # A batch is in flight (held inside its LLM pass) when v2 is published.
    ex.gate.clear()
    ex.entered.clear()
    produce_raw(settings, settings.topic_chat, [(b"m-1", chat(1))])
    assert ex.entered.wait(60), "the batch never started"
    v2 = publish_probe(registry, ex.fingerprint, seed=2)
    # Served while that batch is still held: no batch boundary was needed for the swap
    # (the old between-batches check, probe_watch=poll, waits for the batch to end).
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == v2, "v2 swapped in", 20)
    assert not ex.gate.is_set()
    ex.gate.set()
    produce_raw(settings, settings.topic_chat, [(b"m-2", chat(2))])
    got = {v.message_id: v.results[0].version for v in verdicts(settings, 3)}
    # The held batch finished on the snapshot it started with; the next one used v2.
    assert got == {"m-0": v1, "m-1": v1, "m-2": v2}

    scorers.remove(running)
    running.stop()
    assert not scorer.watcher.watching
    assert not [t for t in threading.enumerate() if t.name == "probe-watch" and t.is_alive()]


def _engine(settings: Settings, redis_ns: RedisNamespace, labels: list[str]) -> ScoringEngine:
    """An engine serving a random probe over ``labels`` (the last one flags), no Kafka."""
    ex = extractor(settings)
    spec = ProbeSpec(
        name="toxicity",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=ex.hidden_size,
        task="multiclass",
        labels=labels,
        flag_labels=[labels[-1]],
    )
    probe = build_probe(spec, seed=1).eval()
    _, manifest = checkpoint_to_bytes(probe, llm=ex.fingerprint, version=1)
    engine = ScoringEngine(settings, ex, redis_ns.client, worker_id="w", metrics=ScorerMetrics())
    engine.watcher.serve_bootstrap(
        "toxicity", ServedProbe(probe, CheckpointManifest.decode(manifest))
    )
    return engine


def test_raised_limits_apply_to_the_verdicts_and_review_requests_sent(
    settings: Settings, redis_ns: RedisNamespace
) -> None:
    """M1: what the scorer sends is checked against the configured limits, not the
    defaults. A 40,000-character message (allowed by MAX_TEXT_CHARS=100000) picked for
    review, and a probe with 70 labels (MAX_LABELS=100), used to fail the batch: the
    message was dead-lettered as ``processing`` and never got a verdict."""
    settings = settings.model_copy(
        update={
            "max_text_chars": 100_000,
            "max_labels": 100,
            "review_low": 0.0,  # every message is uncertain: all go to review
            "review_high": 1.0,
        }
    )
    engine = _engine(settings, redis_ns, [f"l{i}" for i in range(70)])
    text = "how is everyone today? " * 1800  # 41,400 characters
    msg = ChatMessage.decode(chat(1, text), settings.limits)
    judged = engine.judge([msg])
    assert not judged.errors
    assert len(judged.verdicts[0].results[0].scores) == 70
    ((pos, request),) = judged.reviews
    assert pos == 0 and request.text == text and len(request.scores) == 70
    # What was sent decodes on the other side with the same limits.
    assert ReviewRequest.decode(request.encode(), settings.limits) == request
    assert Verdict.decode(judged.verdicts[0].encode(), settings.limits) == judged.verdicts[0]


def _samples(engine: ScoringEngine) -> float:
    return sum(
        s.value
        for metric in engine.metrics.reviews_dropped.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    )


def test_while_redis_is_away_reviews_pass_a_local_quota_not_dropped(
    settings: Settings, redis_ns: RedisNamespace
) -> None:
    """L1: with the shared breaker open (one slow XREAD in the watcher, one failed evidence
    write), every review candidate used to be dropped for 5-60 s. Each scorer now admits
    up to ``REVIEW_LOCAL_MAX_PER_WINDOW`` per window on its own until Redis answers."""
    settings = settings.model_copy(
        update={
            "review_low": 0.0,  # every message is uncertain: all go to review
            "review_high": 1.0,
            "review_window_s": 3600,
            "review_local_max_per_window": 12,
        }
    )
    engine = _engine(settings, redis_ns, ["ok", "toxic"])
    msgs = [ChatMessage.decode(chat(i), settings.limits) for i in range(10)]
    engine.redis_breaker.trip(TimeoutError("a slow read"))
    judged = engine.judge(msgs)
    assert sorted(pos for pos, _ in judged.reviews) == list(range(10))
    assert _samples(engine) == 0
    # The local quota bounds a flood as the shared budget would: 2 more, then none.
    judged = engine.judge(msgs)
    assert len(judged.reviews) == 2 and _samples(engine) == 8
    # Nothing was counted in Redis while it was away.
    assert not redis_ns.client.keys(f"{redis_ns.keys.prefix}:review_budget:*")
