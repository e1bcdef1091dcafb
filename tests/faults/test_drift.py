"""A shifted stream raises the drift gauges over the ProbeguardInputDrift thresholds of
deploy/alerts.yml; a stream from the training distribution does not.

A real scorer (on a thread, the tiny random LLM) behind the suite's own broker and Redis
serves a probe whose checkpoint carries the drift statistics of its training texts (chat
lines from a small vocabulary), exactly as `probeguard fit` writes them. First 300 more chat
lines from the same generator, then 300 hex strings (another generator altogether).
"""

from __future__ import annotations

import random

import pytest

from probes.checkpoint import checkpoint_to_bytes
from probes.drift import probe_reference
from probes.probe import build_probe
from schemas import DriftSnapshot
from tests.faults.accounting import Row, Tally, record
from tests.faults.conftest import Stack
from tests.faults.test_faults import alive, extractor, registry
from tests.integration.test_updater import chat
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import toxicity_spec
from tests.unit.prometheus_helpers import drift_thresholds
from worker.scoring.scorer import Scorer
from worker.store.redis import make_redis

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

WORDS = [
    "hello",
    "everyone",
    "how",
    "is",
    "the",
    "game",
    "going",
    "today",
    "i",
    "think",
    "we",
    "should",
    "meet",
    "later",
    "thanks",
    "for",
    "the",
    "help",
    "what",
    "time",
    "is",
    "it",
    "see",
    "you",
    "all",
    "soon",
    "nice",
    "work",
]
N = 300


def chat_lines(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def hex_strings(rng: random.Random, n: int) -> list[str]:
    return [
        "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(16, 40)))
        for _ in range(n)
    ]


def test_a_shifted_stream_raises_the_drift_alert_and_an_unshifted_one_does_not(
    stack: Stack, threads: list[Threaded]
) -> None:
    shift_limit, psi_limit = drift_thresholds()
    s = stack.settings.model_copy(update={"drift_window": 200, "drift_min_messages": 100})
    scorer = Scorer(s, extractor(), make_redis(s), worker_id="scorer-drift")
    ex = scorer.extractor
    spec = toxicity_spec(ex.hidden_size, layers=[1, 2, 3, 4])
    probe = build_probe(spec, seed=1)
    # Train-time statistics: the normalization and the drift reference of the training texts.
    train = ex.extract(chat_lines(random.Random(0), 400), tuple(spec.layers))
    hidden, mask = train.hidden.float(), train.mask  # [L, B, T, D], [B, T]
    tokens = hidden[:, mask]  # [L, N_tok, D]
    probe.set_input_stats(tokens.mean(dim=1), tokens.std(dim=1).clamp_min(1e-6))
    drift = probe_reference(probe, [(hidden, mask, None)])
    reg = registry(s)
    version = reg.allocate_version()
    blob, manifest = checkpoint_to_bytes(probe, llm=ex.fingerprint, version=version, drift=drift)
    reg.publish(blob, manifest, set_live=True)
    threads.append(Threaded(scorer.run, scorer.stop))
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == version, "v live")
    labels = {"probe": "toxicity", "version": str(version)}

    def gauges() -> tuple[float, float, float]:
        value = scorer.metrics.collector.get_sample_value
        shifts = [
            value("probeguard_scorer_drift_mean_shift", {**labels, "layer": str(layer)})
            for layer in spec.layers
        ]
        psi = value("probeguard_scorer_drift_score_psi", labels)
        n = value("probeguard_scorer_drift_window_messages", labels)
        assert psi is not None and n is not None and None not in shifts, "no drift gauges"
        return max(abs(x) for x in shifts if x is not None), psi, n

    def stream(prefix: str, texts: list[str]) -> tuple[int, int, int, int]:
        batch = [(f"{prefix}-{i}".encode(), chat(f"{prefix}-{i}", t)) for i, t in enumerate(texts)]
        keys = {k.decode() for k, _ in batch}
        with Tally(s) as tally:
            produce_raw(s, s.topic_chat, batch)
            out = tally.settle(keys, timeout_s=180)
        missing = out.missing(keys)
        assert not missing, f"{len(missing)} missing"
        verdicts = sum(out.verdicts[k] for k in keys)  # the topic holds earlier streams too
        dead = sum(out.dead[k] for k in keys)
        assert verdicts == len(keys) and dead == 0  # exactly one verdict each
        return len(keys), verdicts, dead, len(missing)

    same = stream("same", chat_lines(random.Random(5), N))
    same_shift, same_psi, same_n = gauges()
    assert same_n == 200  # the window is full: the gauges read 200 training-like messages
    assert same_shift < shift_limit and same_psi < psi_limit, (same_shift, same_psi)

    shifted = stream("hex", hex_strings(random.Random(6), N))
    hex_shift, hex_psi, hex_n = gauges()
    assert hex_n == 200
    assert hex_shift > shift_limit, (hex_shift, hex_psi)  # the hidden states moved ...
    assert hex_shift > 3 * same_shift + shift_limit  # ... by far more than noise
    # The console adds up the scorers' windows from Redis: this one shared its own.
    stored = reg.client.hgetall(scorer.engine.keys.drift("toxicity", version))
    assert stored, "no drift window in Redis"
    snap = DriftSnapshot.decode(stored[b"scorer-drift"])
    assert 0 < snap.messages <= 200 and len(snap.layer_sum) == len(spec.layers)
    alive(threads)
    for label, counts, numbers in (
        ("an unshifted", same, f"largest shift {same_shift:.2f} SD, PSI {same_psi:.3f}: quiet"),
        ("a shifted", shifted, f"largest shift {hex_shift:.2f} SD, PSI {hex_psi:.3f}: alert"),
    ):
        record(
            Row(
                f"{label} stream (drift alert: shift > {shift_limit:g} SD or PSI > {psi_limit:g})",
                *counts,
                note=numbers,
            )
        )
