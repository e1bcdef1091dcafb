"""bench/score_e2e.py end to end on a tiny random LLM: it fits its probes, runs every
configuration through its own broker and Redis and ends with one JSON line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.tiny_llm import make_tiny_llm
from tests.unit.offline_helpers import write_labeled
from worker.llm.load import cpu_has_native_bf16

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
    argv += ["--paced-seconds", "0"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["config"]: r for r in out["results"]}
    assert list(rows) == ["old", "new", "default", "depth"]
    assert rows["old"]["batch_size"] == 16 and rows["old"]["batch_tokens"] == 0
    assert rows["new"]["batch_size"] == 64 and rows["new"]["batch_tokens"] == 4096
    # old and new compute in float32; default as PROBEGUARD_AUTOCAST's default does here.
    assert rows["old"]["autocast"] is None and rows["new"]["autocast"] is None
    native = "bfloat16" if cpu_has_native_bf16() else None
    assert rows["default"]["autocast"] == rows["depth"]["autocast"] == native
    assert out["judged"] == "default"
    # epsilon 1: the shallowest candidate; the full-depth probe reads every cached layer.
    assert max(rows["depth"]["layers"]) < max(rows["new"]["layers"])
    old_rate = rows["old"]["paced"]["offered_msg_s"]
    for r in rows.values():
        assert r["quality"]["rows"] == 40 and 0 <= r["quality"]["auprc"] <= 1
        assert r["backlog_msg_s"] > 0 and r["paced"]["p99_ms"] > 0
        assert r["paced"]["messages"] == 8 and r["paced"]["p50_second_half_ms"] > 0
        assert r["paced"]["mean_poll"] >= 1
        # Every configuration but old also streams at old's paced rate.
        same = r["same_rate"]
        assert not same if r is rows["old"] else same["offered_msg_s"] == old_rate
    # Batching does not change what the same probe decides.
    assert rows["old"]["quality"] == rows["new"]["quality"]
    assert set(out["probes_cv"]) == {"full", "depth"} and "backlog_speedup" in out["meets"]
    # --untrained: no fitting, random probes of the same shapes, no quality figures.
    argv = ["--data", str(val), "--fit-dir", str(tmp_path / "untrained"), "--untrained", "2"]
    argv += ["--configs", "new,depth", "--model", model, "--paced", "0", "--max-tokens", "64"]
    argv += ["--paced-seconds", "0"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not out["trained_probes"] and out["meets"]["cv_auprc_loss"] is None
    assert [max(r["layers"]) for r in out["results"]] == [4, 2]
    assert all(r["quality"] is None for r in out["results"])
