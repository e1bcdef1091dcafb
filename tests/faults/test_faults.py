"""Fault injection: kills, a paused broker, a paused Redis, bad checkpoints, fuzzed payloads.

Each test owns its broker and Redis (see conftest) and accounts for every input: a verdict
or a dead letter, none missing. Each adds a row to the summary table printed at the end
of the run (tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import operator
import signal
import subprocess
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from schemas import CheckpointManifest
from tests.faults.accounting import Outcome, Row, Tally, record
from tests.faults.conftest import Stack
from tests.integration.test_updater import chat, committed, fast, label
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, spawn, wait_until
from tests.registry_helpers import publish_probe
from worker.embedded import free_port
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm, settings_env
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import Keys, make_redis

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

# The broker's pause outlasts every timeout the roles have for it four times over: the
# group session (2 s on the suite's broker, tests/faults/conftest.py) and the updater's
# lease (2 s); it stays under a Kafka request's timeout (30 s), as the 15 s it was before
# the group session came down from 6 s. Redis's pause stays 15 s: the scorer must score
# during it, which takes its breakers tripping first (at 8 s it had scored nothing yet).
BROKER_OUTAGE_S = 8.0
REDIS_OUTAGE_S = 15.0


def extractor() -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=16)


def registry(settings: Settings) -> CheckpointRegistry:
    return CheckpointRegistry(make_redis(settings), Keys(settings.redis_prefix), "toxicity")


def chats(prefix: str, start: int, stop: int) -> list[tuple[bytes, bytes]]:
    return [
        (f"{prefix}-{i}".encode(), chat(f"{prefix}-{i}", f"message {i}: how is everyone today?"))
        for i in range(start, stop)
    ]


def labels(start: int, stop: int) -> list[tuple[bytes | None, bytes]]:
    return [(None, label(i)) for i in range(start, stop)]


def alive(roles: list[Threaded]) -> None:
    for r in roles:
        assert r.thread.is_alive() and r.error is None, f"a role died: {r.error!r}"


def roles(settings: Settings, threads: list[Threaded]) -> tuple[Scorer, Updater]:
    """An updater and a scorer on threads (their own Redis clients, with short timeouts)."""
    updater = Updater(settings, extractor(), make_redis(settings), worker_id="updater-f")
    threads.append(Threaded(updater.run, updater.stop))
    scorer = Scorer(settings, extractor(), make_redis(settings), worker_id="scorer-f")
    threads.append(Threaded(scorer.run, scorer.stop))
    return scorer, updater


def learned_and_published(updater: Updater, n: int) -> bool:
    return updater.labels_seen >= n and updater.unpublished == 0


# --- SIGKILL --------------------------------------------------------------------------


def test_sigkill_a_scorer_mid_batch_twice_during_a_2000_message_stream(
    stack: Stack, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    s = stack.settings
    path, llm = model_dir
    publish_probe(registry(s), llm.fingerprint)
    n, poison_every = 2000, 50
    records = [
        (k, b"{not json" if i % poison_every == 0 else v)
        for i, (k, v) in enumerate(chats("m", 0, n))
    ]
    keys = {k.decode() for k, _ in records}
    # A backlog, so the scorers are never idle: each kill lands inside a batch (scoring,
    # producing or committing it).
    produce_raw(s, s.topic_chat, records)
    env = settings_env(s, path, batch_size=16)
    logs = [tmp_path / "scorer-a.log", tmp_path / "scorer-b.log"]
    procs = [spawn("score", env, logs[0]), spawn("score", env, logs[1])]
    try:
        with Tally(s) as tally:
            for victim, after in ((0, 300), (1, 1000)):
                tally.wait(partial(_scored_at_least, after), 240, f"{after}")
                procs[victim].send_signal(signal.SIGKILL)  # mid-batch: it is busy scoring
                procs[victim].wait(10)
                procs[victim] = spawn("score", env, logs[victim])
            out = tally.settle(keys, timeout_s=300)
        missing = out.missing(keys)
        tails = "\n".join(p.read_text()[-1500:] for p in logs)
        assert not missing, f"{len(missing)} missing, e.g. {sorted(missing)[:5]}\n{tails}"
        poison = {f"m-{i}" for i in range(0, n, poison_every)}
        assert set(out.dead) == poison and not poison & set(out.verdicts)
        redelivered = sum(out.verdicts.values()) - len(out.verdicts)
        record(
            Row(
                "SIGKILL a scorer mid-batch, twice (2 scorers)",
                n,
                len(out.verdicts),
                len(out.dead),
                len(missing),
                f"{redelivered} verdicts redelivered after the kills (at-least-once)",
            )
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def _terminate(*procs: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the roles still running (None: never started) and wait for each."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def _evidence(s: Settings, fields: tuple[str, ...]) -> dict[int, int]:
    """Per version, the sum of ``fields`` of its evidence hash."""
    client, keys = make_redis(s), Keys(s.redis_prefix)
    pattern = keys.evidence("toxicity", 0)[:-1] + "*"
    out = {}
    for key in client.scan_iter(match=pattern):
        raw = client.hgetall(key)
        out[int(key.decode().rsplit(":", 1)[1])] = sum(int(raw.get(f.encode(), 0)) for f in fields)
    return out


def _label(i: int) -> bytes:
    """A label of ``l-{i}`` in the published probe's own labels (``ok``, ``toxic``)."""
    return json.dumps(
        {
            "message_id": f"l-{i}",
            "label": "toxic" if i % 3 == 0 else "ok",
            "labeler_id": "alice",
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


def test_sigkill_between_produce_and_commit_counts_evidence_and_label_credit_exactly(
    stack: Stack, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """Issue 27: a scorer killed after its batch's verdicts were acknowledged and before
    its offsets were committed; then an updater killed the same way after crediting labels
    and publishing. Their records come again to the next owner, and every count is exact."""
    s = stack.settings
    path, llm = model_dir
    v1 = publish_probe(registry(s), llm.fingerprint)
    n, n_labels = 400, 120
    records = chats("l", 0, n)  # the labels below (ids l-0 ...) join these messages
    keys = {k.decode() for k, _ in records}
    produce_raw(s, s.topic_chat, records)
    env = settings_env(s, path, batch_size=16, default_probe="false")
    log = tmp_path / "scorer.log"
    victim = spawn("score", {**env, "FAULT_DIE_AT_COMMIT": "3"}, log, "tests.faults.die_at_commit")
    scorer: subprocess.Popen[bytes] | None = None
    try:
        with Tally(s) as tally:
            assert victim.wait(240) == -signal.SIGKILL, log.read_text()[-2000:]
            scorer = spawn("score", env, log)
            out = tally.settle(keys, timeout_s=240)
        missing = out.missing(keys)
        assert not missing and not out.dead, log.read_text()[-2000:]
        redelivered = sum(out.verdicts.values()) - len(out.verdicts)
        assert redelivered > 0  # the killed batch's verdicts went out twice
        assert set().union(*out.verdict_versions.values()) == {v1}
        counted = _evidence(s, ("n",))
        assert sum(counted.values()) == len(out.verdicts) == n, counted
    finally:
        _terminate(victim, scorer)
    record(
        Row(
            "SIGKILL a scorer between produce and commit",
            n,
            len(out.verdicts),
            len(out.dead),
            len(missing),
            f"{redelivered} verdicts redelivered; evidence n over versions = "
            f"{sum(counted.values())} = distinct messages, exactly",
        )
    )

    # The labels: an updater killed at its first commit, after crediting and publishing.
    produce_raw(s, s.topic_labels, [(None, _label(i)) for i in range(n_labels)])
    env = settings_env(
        s, path, publish_every_labels=32, publish_every_s=1.0, lease_ttl_ms=2000, stats_warmup=16
    )
    log = tmp_path / "updater.log"
    victim = spawn("train", {**env, "FAULT_DIE_AT_COMMIT": "1"}, log, "tests.faults.die_at_commit")
    updater: subprocess.Popen[bytes] | None = None
    try:
        assert victim.wait(240) == -signal.SIGKILL, log.read_text()[-2000:]
        credited_before = sum(_evidence(s, ("tp", "fp", "fn", "tn")).values())
        updater = spawn("train", env, log)
        # Each partition's labels come in offset order, the redelivered ones first: once
        # the last label is credited, every redelivered one has been handled too.
        wait_until(
            lambda: sum(_evidence(s, ("tp", "fp", "fn", "tn")).values()) >= n_labels,
            "the next updater to credit every label",
            240,
        )
        # Every label handled: the updater commits a batch's offsets after crediting it,
        # so once all are committed, a label credited twice would be counted by now.
        wait_until(
            lambda: committed(s, s.updater_group("toxicity")) >= n_labels,
            "the next updater to commit every label",
            120,
        )
        credited = _evidence(s, ("tp", "fp", "fn", "tn"))
        assert credited == {**{v: 0 for v in credited}, v1: n_labels}, credited
        assert credited_before > 0  # the redelivery must not credit these again
    finally:
        _terminate(victim, updater)
    record(
        Row(
            "SIGKILL the updater between crediting labels and commit",
            n_labels,
            0,
            0,
            0,
            f"{credited_before} credited before the kill, all {n_labels} redelivered; "
            f"label credit over versions = {sum(credited.values())} = labels, exactly",
        )
    )


def _health(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0  # not listening (yet, or any more)


def test_a_sticky_device_fault_fails_liveness_and_the_restarted_pod_scores_everything(
    stack: Stack, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """Issue 27 (review M4): a scorer whose device failed for good (every forward pass an
    illegal memory access) dead-letters nothing and fails /healthz after
    ``device_faults_to_restart`` attempts; the orchestrator's restart (here: SIGKILL and a
    new process, as a failed liveness probe does) scores every message exactly once."""
    s = stack.settings
    path, llm = model_dir
    publish_probe(registry(s), llm.fingerprint)
    n = 200
    records = chats("d", 0, n)
    keys = {k.decode() for k, _ in records}
    produce_raw(s, s.topic_chat, records)
    port = free_port()
    env = settings_env(s, path, batch_size=16, default_probe="false", device_faults_to_restart=3)
    log = tmp_path / "scorer.log"
    broken = spawn(
        "score", {**env, "PROBEGUARD_METRICS_PORT": str(port)}, log, "tests.faults.device_fault"
    )
    scorer: subprocess.Popen[bytes] | None = None
    try:
        with Tally(s) as tally:
            wait_until(lambda: _health(port, "/healthz") == 503, "/healthz to fail", 180)
            assert _health(port, "/readyz") == 503
            assert broken.poll() is None  # alive, but asking to be restarted
            tally.poll()
            assert not tally.outcome.verdicts and not tally.outcome.dead  # nothing lost
            broken.kill()
            broken.wait(30)
            scorer = spawn("score", env, log)
            out = tally.settle(keys, timeout_s=240)
        missing = out.missing(keys)
        assert not missing and not out.dead, log.read_text()[-2000:]
        assert sum(out.verdicts.values()) == len(out.verdicts) == n  # each exactly once
        assert sum(_evidence(s, ("n",)).values()) == n
    finally:
        _terminate(broken, scorer)
    record(
        Row(
            "sticky device fault: /healthz fails, the pod restarts",
            n,
            len(out.verdicts),
            len(out.dead),
            len(missing),
            "0 verdicts and 0 dead letters while the device failed; after the restart "
            f"each message scored once, evidence n = {n}",
        )
    )


# --- outages --------------------------------------------------------------------------


def test_broker_paused_for_8s_everything_recovers_without_restart(
    stack: Stack, threads: list[Threaded]
) -> None:
    s = fast(stack.settings)
    _, updater = roles(s, threads)
    reg = registry(s)
    produce_raw(s, s.topic_labels, labels(0, 64))
    wait_until(lambda: reg.stages().live is not None, "a first version")
    backlog = chats("b", 0, 1000)
    produce_raw(s, s.topic_chat, backlog)
    with Tally(s) as tally:
        tally.wait(lambda o: len(o.verdicts) >= 100, 120, "scoring under way")
        stack.broker.signal(signal.SIGSTOP)
        time.sleep(BROKER_OUTAGE_S)
        stack.broker.signal(signal.SIGCONT)
        alive(threads)
        after = chats("b", 1000, 1200)
        produce_raw(s, s.topic_chat, after)
        produce_raw(s, s.topic_labels, labels(64, 128))
        keys = {k.decode() for k, _ in backlog + after}
        out = tally.settle(keys, timeout_s=240)
    wait_until(lambda: learned_and_published(updater, 128), "labels after the outage", 120)
    alive(threads)
    missing = out.missing(keys)
    assert not missing, f"{len(missing)} missing, e.g. {sorted(missing)[:5]}"
    latest = reg.latest()
    assert latest is not None
    assert reg.manifest(latest).counters.labels_seen >= 128
    record(
        Row(
            f"broker SIGSTOP {BROKER_OUTAGE_S:.0f} s (scorer + updater)",
            len(keys),
            len(out.verdicts),
            len(out.dead),
            len(missing),
            f"128 labels learned, v{latest} published after resume; no restart",
        )
    )


def test_redis_paused_for_15s_scoring_goes_on_and_the_updater_catches_up(
    stack: Stack, threads: list[Threaded]
) -> None:
    s = fast(stack.settings)
    scorer, updater = roles(s, threads)
    produce_raw(s, s.topic_labels, labels(0, 64))
    reg = registry(s)
    wait_until(lambda: learned_and_published(updater, 64), "a version with the first labels")
    live = reg.stages().live
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == live, "scorer on it")
    # The outage hits a steady group. (Mid-rebalance, each Redis call that blocks the
    # polling thread also holds up the join, which kafka-python drives from poll.)
    wait_until(lambda: scorer.health.ready_check()[0], "the scorer to hold its partitions")
    published_before = reg.latest()

    during = chats("r", 0, 300)
    with Tally(s) as tally:
        stack.redis.signal(signal.SIGSTOP)
        paused_at = time.monotonic()
        try:
            produce_raw(s, s.topic_chat, during)
            produce_raw(s, s.topic_labels, labels(64, 128))
            keys = {k.decode() for k, _ in during}
            while time.monotonic() - paused_at < REDIS_OUTAGE_S:
                tally.poll()
            scored_in_outage = len(set(tally.outcome.verdicts) & keys)
            versions_in_outage = set().union(*tally.outcome.verdict_versions.values())
        finally:
            stack.redis.signal(signal.SIGCONT)
        out = tally.settle(keys, timeout_s=180)
    # Scoring went on with the last good probe while Redis was away.
    assert scored_in_outage > 0 and versions_in_outage == {live}
    # The updater could not publish then, and catches up once Redis is back.
    wait_until(lambda: learned_and_published(updater, 128), "labels from the outage", 120)
    latest = reg.latest()
    assert latest is not None and published_before is not None and latest > published_before
    assert reg.manifest(latest).counters.labels_seen >= 128
    alive(threads)
    missing = out.missing(keys)
    assert not missing, f"{len(missing)} missing, e.g. {sorted(missing)[:5]}"
    record(
        Row(
            f"Redis SIGSTOP {REDIS_OUTAGE_S:.0f} s (scorer + updater)",
            len(keys),
            len(out.verdicts),
            len(out.dead),
            len(missing),
            f"{scored_in_outage} scored during the outage on v{live}; "
            f"labels published as v{latest} after",
        )
    )


# Past every client timeout of the processes below (Redis socket 1 s, lease TTL 2 s) six
# times over, and under the scorer's stall_not_ready_s (30 s), which would make it report
# not ready; /readyz is read in its last 5 s, past both timeouts.
LONG_OUTAGE_S = 12.0


def _get(port: int, path: str) -> tuple[int, str]:
    """Status and body of ``/healthz`` or ``/readyz`` (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def test_redis_paused_past_every_timeout_no_role_dies_and_both_recover(
    stack: Stack, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """A Redis frozen for longer than every client timeout (socket, lease TTL) once killed
    ``probeguard train`` with an unhandled TimeoutError; the roles run as processes here,
    as in production, and must outlive it, say so on /readyz, and recover by themselves."""
    s = stack.settings
    path, _ = model_dir
    reg = registry(s)
    ports = {"updater": free_port(), "scorer": free_port()}
    timeouts = {"redis_socket_timeout_s": 1.0, "lease_ttl_ms": 2000}
    learn = {"publish_every_labels": 32, "publish_every_s": 1.0, "stats_warmup": 16}
    learn |= {"learn_lr": 3e-3, "learn_batch_size": 16, "stage_check_interval_s": 0.5}
    logs = {role: tmp_path / f"{role}.log" for role in ports}
    procs = {
        role: spawn(
            "train" if role == "updater" else "score",
            settings_env(s, path, metrics_port=ports[role], **timeouts, **learn),
            logs[role],
        )
        for role in ports
    }

    def tails() -> str:
        return "\n".join(f"--- {r}\n{p.read_text()[-3000:]}" for r, p in logs.items())

    def both_alive() -> None:
        dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
        assert not dead, f"a role died: {dead}\n{tails()}"

    try:
        produce_raw(s, s.topic_labels, labels(0, 64))
        wait_until(lambda: reg.stages().live is not None, "a first version", 120)
        before = reg.latest()
        warm = chats("w", 0, 20)
        produce_raw(s, s.topic_chat, warm)
        with Tally(s) as tally:
            tally.wait(lambda o: len(o.verdicts) >= len(warm), 120, "the scorer to score")
            wait_until(lambda: _get(ports["scorer"], "/readyz")[0] == 200, "scorer ready", 60)

            during = chats("r", 0, 300)
            stack.redis.signal(signal.SIGSTOP)
            paused_at = time.monotonic()
            try:
                produce_raw(s, s.topic_chat, during)
                produce_raw(s, s.topic_labels, labels(64, 128))
                readyz: dict[str, tuple[int, str]] = {}
                while time.monotonic() - paused_at < LONG_OUTAGE_S:
                    tally.poll()
                    if time.monotonic() - paused_at > LONG_OUTAGE_S - 5 and not readyz:
                        readyz = {r: _get(port, "/readyz") for r, port in ports.items()}
                both_alive()
            finally:
                stack.redis.signal(signal.SIGCONT)
            # Degraded, and said so: the updater cannot publish (not ready), the scorer
            # scores on with its last good probes (ready, with a note).
            assert readyz["updater"][0] == 503 and "Redis" in readyz["updater"][1], readyz
            assert readyz["scorer"][0] == 200 and "Redis" in readyz["scorer"][1], readyz

            after = chats("a", 0, 100)
            produce_raw(s, s.topic_chat, after)
            produce_raw(s, s.topic_labels, labels(128, 160))
            keys = {k.decode() for k, _ in warm + during + after}
            out = tally.settle(keys, timeout_s=240)
        wait_until(lambda: learned(reg) >= 160, "the labels given after the pause", 240)
        latest = reg.latest()
        assert latest is not None and before is not None and latest > before
        both_alive()
        for role, port in ports.items():
            assert _get(port, "/healthz")[0] == 200, role
            wait_until(partial(_ready, port), f"{role} ready again", 120)
        # The scorer is back on Redis (its breakers back off up to 60 s; the text cache's
        # learns of it on the next batch): serving what the updater published after the
        # pause, and no longer degraded.
        deadline, n = time.monotonic() + 120, 0
        while f"'live': {reg.latest()}," not in (body := _get(ports["scorer"], "/readyz")[1]) or (
            "degraded" in body
        ):
            assert time.monotonic() < deadline, f"the scorer has not recovered: {body}"
            produce_raw(s, s.topic_chat, chats("z", n, n + 5))
            n += 5
            time.sleep(2)
        missing = out.missing(keys)
        assert not missing, f"{len(missing)} missing, e.g. {sorted(missing)[:5]}"
        assert not out.dead
        record(
            Row(
                f"Redis SIGSTOP {LONG_OUTAGE_S:.0f} s, past every timeout (processes)",
                len(keys),
                len(out.verdicts),
                len(out.dead),
                len(missing),
                f"both alive; 160 labels learned, v{latest} published after the pause",
            )
        )
    except BaseException:
        print(tails())
        raise
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def _ready(port: int) -> bool:
    return _get(port, "/readyz")[0] == 200


def learned(reg: CheckpointRegistry) -> int:
    """Labels the newest published version has learned from (0 before the first)."""
    latest = reg.latest()
    return 0 if latest is None else reg.manifest(latest).counters.labels_seen


# --- bad checkpoints ------------------------------------------------------------------


def test_bad_checkpoints_are_refused_counted_and_scoring_continues(
    stack: Stack, threads: list[Threaded]
) -> None:
    s = stack.settings
    reg = registry(s)
    scorer = Scorer(s, extractor(), make_redis(s), worker_id="scorer-f")
    threads.append(Threaded(scorer.run, scorer.stop))
    fp = scorer.extractor.fingerprint
    good = publish_probe(reg, fp, seed=1)
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] == good, "the good one")

    def corrupted_blob() -> int:
        v = publish_probe(reg, fp, seed=2, set_live=False)
        reg.client.set(reg.keys.ckpt(reg.probe, v), b"\x00garbage\x00")
        return v

    def wrong_hash() -> int:
        v = publish_probe(reg, fp, seed=3, set_live=False)
        m = CheckpointManifest.decode(reg.get(v).manifest_json)
        bad = m.model_copy(update={"tensors_sha256": hashlib.sha256(b"other").hexdigest()})
        reg.client.set(reg.keys.manifest(reg.probe, v), bad.encode())
        return v

    def other_model() -> int:
        other = fp.model_copy(update={"model_id": "someone/else"})
        return publish_probe(reg, other, seed=4, set_live=False)

    sent: list[tuple[bytes, bytes]] = []
    for n, make in enumerate((corrupted_blob, wrong_hash, other_model)):
        batch = chats("k", 100 * n, 100 * (n + 1))
        produce_raw(s, s.topic_chat, batch)
        sent += batch
        bad = make()
        reg.promote(bad)
        refused_now = scorer.watcher.refused["toxicity"]
        wait_until(partial(operator.contains, refused_now, bad), f"v{bad} refused")
    refused = scorer.metrics.collector.get_sample_value(
        "probeguard_scorer_checkpoints_refused_total", {"probe": "toxicity"}
    )
    assert refused == 3
    tail = chats("k", 300, 400)
    produce_raw(s, s.topic_chat, tail)
    keys = {k.decode() for k, _ in sent + tail}
    with Tally(s) as tally:
        out = tally.settle(keys, timeout_s=120)
    missing = out.missing(keys)
    assert not missing
    assert set().union(*out.verdict_versions.values()) == {good}
    assert scorer.watcher.versions()["toxicity"]["live"] == good
    alive(threads)
    record(
        Row(
            "corrupted blob, wrong sha256, other LLM pushed live",
            len(keys),
            len(out.verdicts),
            len(out.dead),
            len(missing),
            f"3 refused and counted; all verdicts from v{good}",
        )
    )


# --- fuzzing --------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=10,
)


def _payloads(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Garbage, random JSON, and near-misses of a valid payload (one field changed, one
    dropped, one added)."""
    fields = sorted(valid)
    changed = st.tuples(st.sampled_from(fields), _json).map(lambda kv: {**valid, kv[0]: kv[1]})
    dropped = st.sampled_from(fields).map(lambda k: {f: v for f, v in valid.items() if f != k})
    added = st.tuples(st.text(min_size=1, max_size=10), _json).map(
        lambda kv: {**valid, kv[0]: kv[1]}
    )
    as_json = st.one_of(_json, changed, dropped, added).map(lambda o: json.dumps(o).encode())
    return st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode), as_json)


def _generate(strategy: st.SearchStrategy[bytes], n: int) -> list[bytes]:
    out: list[bytes] = []

    @hsettings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(payload: bytes) -> None:
        out.append(payload)

    collect()
    return out


def test_fuzzed_payloads_on_every_input_topic_are_dead_lettered_never_a_crash(
    stack: Stack, threads: list[Threaded]
) -> None:
    # Generate first: hypothesis warns when other threads (the Kafka clients') touch the
    # global `random` module while it draws.
    base_chat = json.loads(chat("fz-chat", "a perfectly ordinary message"))
    base_label = json.loads(label(1, prefix="fz-label"))
    chat_in = _generate(_payloads(base_chat), 1000)
    label_in = _generate(_payloads(base_label), 1000)
    assert len(chat_in) >= 1000 and len(label_in) >= 1000
    s = fast(stack.settings)
    reg = registry(s)
    scorer, updater = roles(s, threads)
    publish_probe(reg, scorer.extractor.fingerprint)
    wait_until(lambda: scorer.watcher.versions()["toxicity"]["live"] is not None, "a probe")
    wait_until(lambda: updater.learner is not None, "the updater to resume")
    seen_before = updater.labels_seen
    produce_raw(s, s.topic_chat, [(f"fz-c-{i}".encode(), p) for i, p in enumerate(chat_in)])
    produce_raw(s, s.topic_labels, [(f"fz-l-{i}".encode(), p) for i, p in enumerate(label_in)])
    sentinel = chats("after", 0, 10)
    produce_raw(s, s.topic_chat, sentinel)

    def duplicates() -> int:
        """Labels dropped as a labeler's second label of a message (counted, not learned:
        near-misses of one valid label often keep its message and labeler)."""
        return int(
            sum(
                sample.value
                for metric in updater.metrics.collector.collect()
                for sample in metric.samples
                if sample.name == "probeguard_updater_labels_dropped_total"
                and sample.labels.get("reason") == "duplicate"
            )
        )

    def accounted(o: Any) -> bool:
        chat_out = sum(c for k, c in o.verdicts.items() if not k.startswith("after-"))
        chat_out += o.dead_by_topic[s.topic_chat]
        label_out = o.dead_by_topic[s.topic_labels] + updater.labels_seen - seen_before
        return chat_out >= len(chat_in) and label_out + duplicates() >= len(label_in)

    with Tally(s) as tally:
        out = tally.wait(accounted, 300, "an outcome for every fuzzed payload")
        tally.settle({f"after-{i}" for i in range(10)}, timeout_s=60)
    alive(threads)
    assert {f"after-{i}" for i in range(10)} <= set(out.verdicts)  # still scoring after
    chat_verdicts = sum(c for k, c in out.verdicts.items() if not k.startswith("after-"))
    learned = updater.labels_seen - seen_before + duplicates()
    for topic, n_in, accepted in (
        (s.topic_chat, len(chat_in), chat_verdicts),
        (s.topic_labels, len(label_in), learned),
    ):
        dead = out.dead_by_topic[topic]
        assert dead + accepted == n_in, (topic, dead, accepted, n_in)
        record(
            Row(
                f"hypothesis fuzz on {topic}",
                n_in,
                accepted,
                dead,
                n_in - dead - accepted,
                "accepted = valid by chance (verdicts; labels learned, or dropped as a "
                "labeler's repeat of a message); no crash",
            )
        )


def _scored_at_least(n: int, o: Outcome) -> bool:
    return sum(o.verdicts.values()) >= n
