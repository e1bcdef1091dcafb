"""bench/inline.py on a tiny random chat LLM (an LM head, a chat template) and a random MHA
probe served as v0: every configuration runs, the work is the same everywhere, and the last
line is one JSON object whose overheads follow from its own medians."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from transformers import AutoTokenizer

from probes import save_checkpoint
from probes.probe import build_probe
from schemas import ProbeSpec
from worker.llm.extract import HiddenStateExtractor
from worker.llm.load import load_llm
from worker.llm.tiny import NUM_LAYERS, make_tiny_llm
from worker.settings import Settings

pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[2] / "bench"
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_model(tmp_path: Path) -> Path:
    """The tiny Llama with its own LM head, its tokenizer given a chat template."""
    make_tiny_llm(tmp_path, lm_head="own")
    directory = tmp_path / "tiny-llama-0-own"
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def bench_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(tmp_path / "model-cache"))
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "64")


def run_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_url: str, text_form: str = "raw"
) -> dict[str, Any]:
    """Run the bench on the tiny chat LLM with a random MHA probe trained on ``text_form``;
    its last line, parsed."""
    model = chat_model(tmp_path)
    llm = load_llm(Settings(model=str(model)), lm_head=True)
    spec = ProbeSpec(
        name="toxicity",
        token_pool="mha",
        layer_mix="scalar_mix",
        layers=list(range(1, NUM_LAYERS + 1)),
        hidden_size=llm.hidden_size,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )
    form = HiddenStateExtractor.for_llm(llm, Settings(model=str(model), text_form=text_form))
    save_checkpoint(build_probe(spec, seed=0), tmp_path / "probe", llm=form.fingerprint)
    data = tmp_path / "texts.jsonl"
    rows = [{"text": f"message {i}: " + "words " * (i % 5 + 1)} for i in range(8)]
    rows.insert(2, {"text": "x" * 200})  # longer than the scorer reads whole: skipped
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    spec_ = importlib.util.spec_from_file_location("bench_inline", BENCH / "inline.py")
    assert spec_ is not None and spec_.loader is not None
    bench = importlib.util.module_from_spec(spec_)
    sys.modules[spec_.name] = bench
    spec_.loader.exec_module(bench)
    argv = ["--data", str(data), "--n", "3", "--max-new-tokens", "4", "--stream-every", "2"]
    argv += ["--model", str(model), "--probe", str(tmp_path / "probe"), "--redis-url", redis_url]
    argv += ["--repeats", "2", "--threads", "1", "--text-form", text_form]
    threads = torch.get_num_threads()
    try:
        assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # --threads sets it process-wide
    out: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out


@pytest.mark.usefixtures("bench_env")
def test_in_the_chat_form_the_guards_scores_are_the_separate_scorers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    out = run_bench(tmp_path, capsys, redis_url, text_form="chat")
    assert out["text_form"] == "chat" and out["flag_scores_compared"] == 3
    assert out["max_abs_flag_score_diff"] < 1e-4 and out["same_prompt_decision"] == 3


@pytest.mark.usefixtures("bench_env")
def test_inline_bench_times_every_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    out = run_bench(tmp_path, capsys, redis_url)

    assert out["bench"] == "inline" and out["n"] == 3 and out["max_new_tokens"] == 4
    assert out["repeats"] == 2 and out["threads"] == 1
    assert set(out["configs"]) == set(sys.modules["bench_inline"].CONFIGS)
    assert all(c["median_ms"] > 0 for c in out["configs"].values())
    # The same work in every configuration: forced token counts, the guard's hooks leave
    # the reply unchanged, every prompt got its verdict, the reply its check at token 2 (at
    # token 4, the last, the final verdict reads the same states).
    assert (
        out["tokens_forced"] and out["tokens"]["plain"] == [4] and out["tokens"]["plain_1"] == [1]
    )
    assert out["same_reply_as_plain"] == {"guard_prompt": 3, "guard_stream": 3, "separate": 3}
    assert out["prompts_scored"] == 3 and out["stream_checks"] == [1] and out["errors"] == []
    # The tiny tokenizer's template puts context before the text: scores are comparable
    # but read different states (raw-text probe), so the difference is a number in [0, 1].
    assert out["flag_scores_compared"] == 3
    assert 0 <= out["max_abs_flag_score_diff"] <= 1
    assert 0 <= out["same_prompt_decision"] <= 3
    # Time in judge: none in plain generation, some wherever a probe runs.
    judge = {c: row["judge_ms"] for c, row in out["configs"].items()}
    assert judge["plain"] == judge["plain_1"] == 0
    assert all(judge[c] > 0 for c in ("guard_prompt", "guard_stream", "separate", "separate_1"))
    assert set(out["accounted"]) == set(out["paired"]) >= {"prompt_overhead", "inline_overhead"}
    assert out["accounted"]["prompt_overhead"] > 0
    # The overheads follow from the medians (rounded in the JSON: compared loosely).
    cfg = out["configs"]
    for key, config in (
        ("prompt_overhead", "guard_prompt_1"),
        ("inline_overhead", "guard_prompt"),
        ("separate_overhead", "separate"),
        ("separate_prompt_overhead", "separate_1"),
    ):
        assert out[key] == pytest.approx(cfg[config]["vs_plain"] - 1, abs=2e-4), key
    decode = out["decode_ms_per_token"]
    assert decode == pytest.approx(
        (cfg["plain"]["median_ms"] - cfg["plain_1"]["median_ms"]) / 3, abs=0.02
    )
    stream = (cfg["guard_stream"]["median_ms"] - cfg["guard_prompt"]["median_ms"]) / 4 / decode
    assert out["stream_overhead_per_token"] == pytest.approx(stream, rel=0.05, abs=0.02)
    assert set(out["meets_paired"]) == {"prompt", "stream"}
    assert out["meets"] == {
        "prompt": out["prompt_overhead"] <= 0.10,
        "stream": out["stream_overhead_per_token"] <= 0.05,
    }
    # The run's Redis keys are gone.
    client = redis.Redis.from_url(redis_url)
    assert out["redis_prefix"].startswith("bench-inline-")
    assert not list(client.scan_iter(match=f"{out['redis_prefix']}:*", count=1000))
    client.close()
