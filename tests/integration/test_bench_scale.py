"""bench/scale.py at its smallest: two scorer processes on 8 partitions, a short backlog and
one step of a rolling restart; ends with one JSON line whose counts add up."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_GROUPS

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.timeout(1200)  # three scorer processes start, each importing torch
def test_scale_counts_round_trips_and_survives_a_rolling_restart(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bench runs its own embedded broker; its settings (and so its scorer processes)
    # take the suite's group timing from the environment: groups form and rebalance in
    # ~1-2 s instead of ~3-5 s (tests/conftest.py). The counts asserted do not depend on it.
    for name, value in FAST_GROUPS.items():
        monkeypatch.setenv(f"PROBEGUARD_{name.upper()}", str(value))
    spec = importlib.util.spec_from_file_location("scale", BENCH / "scale.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["scale"] = bench
    spec.loader.exec_module(bench)
    argv = ["--scorers", "2", "--partitions", "8", "--messages", "120", "--idle-s", "2"]
    argv += ["--stream-rate", "16", "--restart-steps", "1"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (r,) = out["results"]
    assert r["scorers"] == 2 and r["partitions"] == 8
    backlog, restart = r["backlog"], r["restart"]
    # Everything sent (8 warm-up, the backlog, the stream) has its verdict.
    assert r["sent"] == 8 + 120 + restart["stream_messages"] and restart["stream_messages"] > 0
    assert r["lost"] == 0 and r["duplicated"] >= 0
    assert backlog["msg_s"] > 0 and 1 <= backlog["mean_batch"] <= 64
    # Each batch writes the text cache and the evidence (a round trip each, at least), and
    # two SETs per message (text, decided record); the broker sees polls, produces, commits.
    assert backlog["redis_round_trips"]["per_batch"] >= 2
    assert backlog["redis_command_mix_per_msg"]["set"] >= 2
    assert {"Fetch", "Produce", "OffsetCommit"} <= set(backlog["broker_by_api_per_msg"])
    assert backlog["redis_memory_bytes_per_msg"] > backlog["mean_text_bytes"]
    assert backlog["scorer_cpu_ms_per_msg"] > 0 and backlog["scorer_rss_mb"]["max"] > 0
    # Idle scorers still heartbeat the group and block on the registry's event stream.
    idle = r["idle"]
    assert idle["broker_by_api_per_scorer_s"]["Heartbeat"] > 0
    assert idle["redis_round_trips_per_scorer_s"] > 0
    # One step; every partition answers again after the SIGTERM.
    assert restart["replaced"] == 1 and len(restart["steps"]) == 1
    assert all(s["resume_s"] > 0 and s["ready_s"] > 0 for s in restart["steps"])
