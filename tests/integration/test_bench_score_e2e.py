"""bench/score_e2e.py end to end on a tiny random LLM: it fits its probes, runs every
configuration through its own broker and Redis and ends with one JSON line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.unit.offline_helpers import write_labeled
from worker.llm.load import cpu_has_native_bf16
from worker.llm.tiny import make_tiny_llm

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_score_e2e_compares_configurations_with_real_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tiny_llm(tmp_path)
    model = str(tmp_path / "tiny-llama-0")
    monkeypatch.setenv("PROBEGUARD_MODEL", model)
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(tmp_path / "model-cache"))
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "64")
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports bench/quality.py
    train = write_labeled(tmp_path / "train.jsonl", 120, seed=1)
    val = write_labeled(tmp_path / "val.jsonl", 40, seed=2)
    spec = importlib.util.spec_from_file_location("score_e2e", BENCH / "score_e2e.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["score_e2e"] = bench
    spec.loader.exec_module(bench)
    argv = ["--data", str(val), "--train-data", str(train), "--cache-root", str(tmp_path / "c")]
    argv += ["--fit-dir", str(tmp_path / "probes"), "--folds", "2", "--epochs", "2"]
    argv += ["--depth-epsilon", "1", "--model", model, "--paced", "8", "--max-tokens", "64"]
    # The cascade needs an exit head that pays, which random tiny-model data never gives.
    argv += ["--paced-seconds", "0", "--loads", "0.5,0.7", "--configs", "poll,micro,default"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["config"]: r for r in out["results"]}
    assert list(rows) == ["poll", "micro", "default"]
    assert rows["poll"]["latency_target_ms"] == 0 and rows["micro"]["latency_target_ms"] > 0
    # default computes as PROBEGUARD_AUTOCAST's default does here.
    native = "bfloat16" if cpu_has_native_bf16() else None
    assert rows["default"]["autocast"] == native
    for r in rows.values():
        assert r["quality"]["rows"] == 40 and 0 <= r["quality"]["auprc"] <= 1
        assert r["backlog_msg_s"] > 0
        assert [p["load"] for p in r["paced"]] == [0.5, 0.7]
        for p in r["paced"]:
            assert p["messages"] == 8 and p["p99_ms"] > 0 and p["p50_second_half_ms"] > 0
            assert p["mean_micro_batch"] >= 1
    meets = out["meets"]
    assert set(meets) >= {"p99_at_50%", "p99_at_70%", "backlog_vs_poll", "backlog_within_5pct"}
    # No exit head: every verdict at full depth.
    assert rows["default"]["decided_early"] == rows["default"]["decided_early_tokens"] == 0
    assert meets["backlog_vs_poll"] == round(
        rows["default"]["backlog_msg_s"] / rows["poll"]["backlog_msg_s"], 3
    )
