"""End to end through the CLI: `cache build` -> `fit` -> `eval` with a tiny random LLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from probes import load_checkpoint
from probes.offline.cache import HiddenStateCache
from tests.unit.offline_helpers import write_labeled
from worker.cli import main
from worker.llm.tiny import make_tiny_llm


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("offline")
    make_tiny_llm(root)  # saved to root/tiny-llama-0
    write_labeled(root / "train.jsonl", 160, seed=1)
    write_labeled(root / "val.jsonl", 60, seed=2)
    return root


@pytest.fixture(autouse=True)
def tiny_model_settings(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROBEGUARD_MODEL", str(workspace / "tiny-llama-0"))
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(workspace / "model-cache"))
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "64")
    monkeypatch.setenv("PROBEGUARD_BATCH_SIZE", "8")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def caches(workspace: Path) -> tuple[Path, Path]:
    for split in ("train", "val"):
        argv = ["cache", "build", "--data", str(workspace / f"{split}.jsonl")]
        argv += ["--out", str(workspace / f"cache-{split}"), "--no-progress", "--shard-rows", "64"]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PROBEGUARD_MODEL", str(workspace / "tiny-llama-0"))
            mp.setenv("PROBEGUARD_CACHE_DIR", str(workspace / "model-cache"))
            mp.setenv("PROBEGUARD_MAX_TOKENS", "64")
            assert main(argv) == 0
    return workspace / "cache-train", workspace / "cache-val"


def test_cache_build_reports_size(capsys, caches) -> None:
    info = run_json(capsys, "cache", "info", str(caches[0]))
    assert info["rows"] == 160 and info["missing_shards"] == []
    assert info["token_layers"] == [1, 2, 3, 4] and info["mb_per_1000_messages"] > 0


@pytest.mark.parametrize(
    ("probe", "mix", "target"),
    [("gate", "scalar_mix", "label"), ("mha", "gate", "label"), ("mean", "scalar_mix", "labels")],
)
def test_fit_then_eval(capsys, caches, workspace, probe, mix, target) -> None:
    ckpt = workspace / f"ckpt-{probe}-{target}"
    fitted = run_json(
        capsys,
        "fit",
        "--cache",
        str(caches[0]),
        "--val-cache",
        str(caches[1]),
        "--pool",
        probe,
        "--layer-mix",
        mix,
        "--target",
        target,
        "--out",
        str(ckpt),
        "--lr",
        "1e-2",
        "--epochs",
        "20",
        "--batch-size",
        "32",
        *(["--grad-checkpointing"] if probe == "mha" else []),
    )
    assert fitted["val_f1"] > 0.75, fitted  # ~0.52 for flagging everything
    assert fitted["parameters"] > 0 and fitted["thresholds"]
    _, manifest = load_checkpoint(ckpt, HiddenStateCache(caches[0]).manifest.llm)
    assert manifest.counters.labels_seen == 160 and manifest.metrics["val_f1"] == fitted["val_f1"]

    png = workspace / f"{probe}-{target}.png"
    on_data = run_json(
        capsys,
        "eval",
        "--checkpoint",
        str(ckpt),
        "--data",
        str(workspace / "val.jsonl"),
        "--png",
        str(png),
    )
    on_cache = run_json(capsys, "eval", "--checkpoint", str(ckpt), "--cache", str(caches[1]))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for report in (on_data, on_cache):
        assert report["n"] == 60
        assert set(report) >= {"f1", "auprc", "accuracy", "per_class", "confusion", "layer_weights"}
        assert abs(sum(report["layer_weights"]) - 1) < 1e-4
    # Same rows, same probe: the fp16 cache and fresh extraction agree closely.
    assert abs(on_cache["auprc"] - fitted["val_auprc"]) < 1e-6
    assert abs(on_data["auprc"] - on_cache["auprc"]) < 0.02
    if target == "label":
        assert sum(map(sum, on_data["confusion"]["matrix"])) == 60


def test_eval_refuses_another_llm(capsys, caches, workspace, monkeypatch) -> None:
    ckpt = workspace / "ckpt-last"
    argv = ["fit", "--cache", str(caches[0]), "--val-cache", str(caches[1]), "--pool", "last"]
    assert main([*argv, "--out", str(ckpt), "--epochs", "1"]) == 0
    other = workspace / "other"
    other.mkdir(exist_ok=True)
    make_tiny_llm(other, seed=1)
    monkeypatch.setenv("PROBEGUARD_MODEL", str(other / "tiny-llama-1"))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ckpt), "--data", str(workspace / "val.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "was trained on another LLM" in err and "source_sha256: checkpoint" in err


def test_fit_old_flag_spellings_still_work_with_a_warning(capsys, caches, workspace) -> None:
    argv = ["fit", "--cache", str(caches[0]), "--probe", "mha", "--heads", "2", "--epochs", "1"]
    assert main([*argv, "--out", str(workspace / "old"), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "--probe is deprecated; use --pool" in err and "--heads is deprecated" in err
    assert json.loads(out.strip().splitlines()[-1])["token_pool"] == "mha"
    spec = json.loads((workspace / "old" / "manifest.json").read_text())["spec"]
    assert spec["num_heads"] == 2
    # Without --pool: the default kind (MHA), selected by cross-validation.
    argv = ["fit", "--cache", str(caches[0]), "--epochs", "2", "--folds", "3"]
    assert main([*argv, "--out", str(workspace / "default"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["token_pool"] == "mha" and summary["selection"] == "3-fold CV"
    assert summary["cv_folds"] == 3 and 0 <= summary["cv_f1_mean"] <= 1


def test_fit_errors_are_clear(capsys, caches, workspace) -> None:
    argv = ["fit", "--cache", str(caches[0]), "--pool", "mean", "--layer-mix", "single"]
    assert main([*argv, "--out", str(workspace / "x")]) == 1
    assert "needs --layers with exactly one layer" in capsys.readouterr().err
    argv = ["fit", "--cache", str(caches[0]), "--pool", "gate", "--layers", "0"]
    assert main([*argv, "--out", str(workspace / "x")]) == 1
    assert "layers [0] are missing" in capsys.readouterr().err
    assert main(["fit", "--cache", str(workspace / "nope"), "--pool", "gate", "--out", "x"]) == 1
    assert "is not a cache" in capsys.readouterr().err


def test_probe_table_bench_runs(capsys, caches) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "bench" / "probe_table.py"
    spec = importlib.util.spec_from_file_location("probe_table", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--train-cache", str(caches[0]), "--val-cache", str(caches[1])]
    assert bench.main([*argv, "--configs", "mean-best,gate", "--epochs", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["config"] for r in summary["results"]] == ["mean-best", "gate"]
    assert len(summary["results"][0]["scan"]) == 5  # hidden states 0..4 of the tiny model


def test_quality_bench_runs_with_a_held_out_split(capsys, workspace) -> None:
    """bench/quality.py builds its caches, cross-validates, scores held-out rows and a peer."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "bench" / "quality.py"
    spec = importlib.util.spec_from_file_location("quality", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--data", str(workspace / "train.jsonl"), "--data", str(workspace / "val.jsonl")]
    argv += ["--cache-root", str(workspace / "bench-caches"), "--kinds", "mean,mha"]
    assert bench.main([*argv, "--peers", "tfidf", "--folds", "3", "--epochs", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert [r["method"] for r in summary["results"]] == ["mean", "mha", "TF-IDF + LR"]
    assert summary["dev_rows"] + summary["test_rows"] == 220
    assert 40 < summary["test_rows"] < 100  # about 30 % held out by id hash
    for r in summary["results"]:
        assert len(r["folds"]) == 3 and 0 <= r["test"]["auprc"] <= 1
        assert 0 <= r["test"]["recall_at_1pct_fpr"] <= 1 and 0 <= r["test"]["ece"] <= 1
    assert all(r["calibration"] for r in summary["results"][:2])  # the probes, as `fit` does
    assert any("R@1%FPR" in line and "ECE" in line for line in out)
    assert any(line.startswith("MiniLM") or line.startswith("mha") for line in out)


def test_fit_prints_folds_and_refuses_a_bad_operating_point(capsys, caches, workspace) -> None:
    argv = ["fit", "--cache", str(caches[0]), "--pool", "mean", "--folds", "2", "--epochs", "2"]
    assert main([*argv, "--out", str(workspace / "cv-text")]) == 0
    out = capsys.readouterr().out
    assert "fold 1:" in out and "fold 2:" in out and "2-fold CV F1" in out
    report = json.loads((workspace / "cv-text" / "fit-report.json").read_text())
    assert len(report["folds"]) == 2 and report["summary"]["operating_point"] == "f1"
    for fold in report["folds"]:  # the field's figures per fold too, not only pooled
        assert 0 <= fold["recall_at_1pct_fpr"] <= 1 and 0 <= fold["ece"] <= 1
    assert "recall at 1 % FPR" in out.split("fold 2:")[1].splitlines()[0]
    with pytest.raises(SystemExit, match="operating point"):
        main([*argv, "--out", str(workspace / "x"), "--operating-point", "precision>1"])
    with pytest.raises(SystemExit, match="pick one"):
        main([*argv, "--val-cache", str(caches[1]), "--out", str(workspace / "x")])


def test_eval_per_layer_control_and_class_layers(capsys, caches, workspace) -> None:
    ckpt = workspace / "ckpt-science"
    argv = ["fit", "--cache", str(caches[0]), "--val-cache", str(caches[1]), "--pool", "mean"]
    argv += ["--out", str(ckpt), "--lr", "1e-2", "--epochs", "5", "--target", "labels"]
    run_json(capsys, *argv)
    plots = workspace / "science"
    report = run_json(
        capsys,
        "eval",
        "--checkpoint",
        str(ckpt),
        "--cache",
        str(caches[1]),
        "--per-layer",
        "--train-cache",
        str(caches[0]),
        "--control",
        "--class-layers",
        "--plot-dir",
        str(plots),
        "--curve-epochs",
        "3",
    )
    rows = report["per_layer"]
    assert [r["layer"] for r in rows] == HiddenStateCache(caches[0]).manifest.summary_layers
    assert all({"f1", "auprc", "control_f1", "selectivity_auprc"} <= set(r) for r in rows)
    assert report["selectivity"]["kind"] == "mean/scalar_mix"
    use = report["class_layers"]
    assert use["labels"] == ["hate", "insult"] and len(use["shares"][0]) == len(use["layers"])
    for name in ("layer-curve.png", "class-layers.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The human-readable form prints the tables.
    capsys.readouterr()
    argv = ["eval", "--checkpoint", str(ckpt), "--cache", str(caches[1]), "--class-layers"]
    assert main(argv) == 0
    assert "per-class layer use" in capsys.readouterr().out


def test_eval_science_flags_need_their_inputs(caches, workspace) -> None:
    ckpt = workspace / "ckpt-science"
    base = ["eval", "--checkpoint", str(ckpt)]
    with pytest.raises(SystemExit, match="need --cache"):
        main([*base, "--data", str(workspace / "val.jsonl"), "--class-layers"])
    with pytest.raises(SystemExit, match="needs --train-cache"):
        main([*base, "--cache", str(caches[1]), "--per-layer"])
    with pytest.raises(SystemExit, match="goes with --per-layer"):
        main([*base, "--cache", str(caches[1]), "--control"])


def test_fit_writes_int8_checkpoints_that_eval_reads(capsys, caches, workspace) -> None:
    from probes.checkpoint import TENSORS_FILE, weight_format

    for weights in ("fp32", "int8"):
        ckpt = workspace / f"ckpt-{weights}"
        argv = ["fit", "--cache", str(caches[0]), "--val-cache", str(caches[1]), "--pool", "max"]
        run_json(capsys, *argv, "--out", str(ckpt), "--epochs", "3", "--weights", weights)
        blob = (ckpt / TENSORS_FILE).read_bytes()
        assert weight_format(blob) == weights
        report = run_json(capsys, "eval", "--checkpoint", str(ckpt), "--cache", str(caches[1]))
        assert report["n"] == 60


def _bench(name: str):
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_caches(caches, workspace) -> list[str]:
    """The fixture caches under the names the bench scripts look for (``cache_dir_for``)."""
    for split, cache in zip(("train", "val"), caches, strict=True):
        link = workspace / f"{workspace.name}-{split}-tiny"
        if not link.exists():
            link.symlink_to(cache)
    data = [str(workspace / "train.jsonl"), str(workspace / "val.jsonl")]
    argv = [x for d in data for x in ("--data", d)]
    return [*argv, "--cache-root", str(workspace), "--model-name", "tiny"]


def test_int8_and_probe_science_benches_run(capsys, caches, workspace) -> None:
    argv = _bench_caches(caches, workspace)
    capsys.readouterr()
    assert _bench("int8_probes").main([*argv, "--kinds", "mean,gate", "--epochs", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["kind"] for r in out["results"]] == ["mean", "gate"]
    assert all(r["int8"]["bytes"] > 0 and "f1_ratio" in r for r in out["results"])
    science = _bench("probe_science")
    figs = workspace / "figs"
    argv += ["--name", "toy", "--out", str(figs), "--kinds", "mean,gate", "--epochs", "2"]
    assert science.main([*argv, "--target", "labels", "--curve-kinds", "mean"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["kind"] for r in out["selectivity"]] == ["mean", "gate"]
    assert len(out["per_layer"]["mean"]) == 5 and (figs / "toy-mean-layers.png").exists()
    assert out["class_layers"]["labels"] == ["hate", "insult"]
    assert (figs / "toy-class-layers.png").exists()


def test_fit_depth_auto_prints_the_table_and_records_the_choice(capsys, caches, workspace) -> None:
    argv = ["fit", "--cache", str(caches[0]), "--pool", "mean", "--folds", "2", "--epochs", "2"]
    argv += ["--depth", "auto", "--depth-candidates", "2,4", "--depth-epsilon", "1"]
    assert main([*argv, "--out", str(workspace / "depth")]) == 0
    out = capsys.readouterr().out
    assert "depth search (2 candidates" in out and "chose depth 2" in out and "<- chosen" in out
    probe, manifest = load_checkpoint(workspace / "depth", None)
    assert probe.layers == (0, 1, 2)  # epsilon 1: the shallowest candidate, layers <= 2
    assert manifest.metrics["depth_chosen"] == 2 and manifest.metrics["depth_epsilon"] == 1
    assert {"depth_2_cv_auprc_mean", "depth_4_cv_auprc_std"} <= set(manifest.metrics)
    report = json.loads((workspace / "depth" / "fit-report.json").read_text())
    assert [r["depth"] for r in report["depth"]] == [2, 4]
    assert report["summary"]["depth_chosen"] == 2 and report["summary"]["layers"] == [0, 1, 2]
    with pytest.raises(SystemExit, match="needs --folds >= 2"):
        main([*argv, "--folds", "0", "--out", str(workspace / "x")])
    with pytest.raises(SystemExit, match="needs --depth auto"):
        main(["fit", "--cache", str(caches[0]), "--depth-candidates", "2", "--out", "x"])
    bad = [*argv[:-6], "--depth", "auto", "--depth-candidates", "5"]
    assert main([*bad, "--out", str(workspace / "x")]) == 1
    assert "[5] are not among the layers [0, 1, 2, 3, 4]" in capsys.readouterr().err


def _multi_head_checkpoint(caches: tuple[Path, Path], out: Path) -> Path:
    """A two-head probe fitted on the train cache: toxicity (ok / toxic, from ``label``)
    and insult (binary, from ``labels``), each row annotating both."""
    from probes import build_probe, save_checkpoint
    from probes.offline.fit import FitConfig, fit
    from probes.offline.multitask import SourceHeads, as_multitask, multitask_targets
    from schemas import HeadSpec, ProbeSpec
    from worker.offline.fit_eval import load_split

    cache = HiddenStateCache(caches[0])
    layers = cache.manifest.summary_layers[-2:]
    spec = ProbeSpec(
        name="moderation",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=layers,
        hidden_size=cache.manifest.llm.hidden_size,
        task="multilabel",
        labels=["ok", "toxic", "insult"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["ok", "toxic"]),
            HeadSpec(name="insult", task="multilabel", labels=["insult"]),
        ],
        flag_labels=["toxic", "insult"],
    )
    source = SourceHeads(
        "toy",
        {
            "toxicity": {"ok": ["ok"], "toxic": ["toxic"]},
            "insult": {"insult": ["insult"], "ok": [], "toxic": []},
        },
    )
    data = load_split(cache, "mean", layers, "label")
    data = as_multitask(data, spec, multitask_targets(spec, source, cache.row_labels()))
    probe = fit(build_probe(spec, seed=0), data, None, FitConfig(max_epochs=5, lr=3e-3)).probe
    save_checkpoint(probe, out, llm=cache.manifest.llm)
    return out


def test_eval_measures_one_head_of_a_multi_head_probe(capsys, caches, workspace) -> None:
    ckpt = _multi_head_checkpoint(caches, workspace / "multi-head")
    argv = ["eval", "--checkpoint", str(ckpt), "--cache", str(caches[1])]
    insult = run_json(capsys, *argv, "--head", "insult")
    assert set(insult["per_class"]) == {"insult"} and insult["n"] == 60
    labels = [json.loads(line) for line in (workspace / "val.jsonl").read_text().splitlines()]
    assert insult["per_class"]["insult"]["support"] == sum("insult" in r["labels"] for r in labels)
    toxicity = run_json(capsys, *argv, "--head", "toxicity")
    assert toxicity["task"] == "multiclass" and set(toxicity["per_class"]) == {"ok", "toxic"}
    # The same through the LLM on the labeled file, and a head the probe lacks.
    on_rows = ["eval", "--checkpoint", str(ckpt), "--data", str(workspace / "val.jsonl")]
    rows = run_json(capsys, *on_rows, "--head", "insult")
    assert rows["per_class"]["insult"]["support"] == insult["per_class"]["insult"]["support"]
    assert main([*argv, "--head", "spam"]) != 0
    assert "no head 'spam'" in capsys.readouterr().err


def test_eval_checkpoint_default_is_the_packaged_default(
    capsys, caches, workspace, monkeypatch
) -> None:
    import hashlib

    import worker.defaults

    root = workspace / "packaged"
    folder = _multi_head_checkpoint(caches, root / "tiny")
    pin = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    monkeypatch.setattr(worker.defaults, "ROOT", root)
    monkeypatch.setattr(worker.defaults, "PINNED", {"tiny": pin})
    argv = ["eval", "--checkpoint", "default", "--cache", str(caches[1])]
    report = run_json(capsys, *argv, "--head", "insult")
    assert report["version"] == 0 and set(report["per_class"]) == {"insult"}
    whole = run_json(capsys, *argv)  # rows name one head each: measured per head
    assert set(whole["heads"]) == {"toxicity", "insult"}
    monkeypatch.setattr(worker.defaults, "PINNED", {})
    assert main(argv) != 0
    assert "not the one this release pins" in capsys.readouterr().err


def test_fit_exit_prints_its_table_and_a_large_epsilon_attaches_an_exit_head(
    capsys, caches, workspace
) -> None:
    argv = ["fit", "--cache", str(caches[0]), "--pool", "mean", "--folds", "2", "--epochs", "2"]
    fast = ["--epochs", "8", "--lr", "0.05", "--exit", "2", "--exit-epsilon", "1"]
    fast += ["--exit-max-missed", "1"]
    assert main([*argv, *fast, "--out", str(workspace / "ex")]) == 0
    out = capsys.readouterr().out
    assert "exit search (mean exit heads): full-depth out-of-fold AUPRC" in out
    assert "<- chosen" in out
    probe, manifest = load_checkpoint(workspace / "ex", None)
    assert probe.spec.exit is not None and probe.spec.exit.layer == 2
    assert probe.exit_head is not None
    assert manifest.metrics["exit_layer"] == 2 and "exit_cv_share" in manifest.metrics
    assert main([*argv, "--exit", "off", "--out", str(workspace / "no")]) == 0
    assert load_checkpoint(workspace / "no", None)[0].spec.exit is None
    with pytest.raises(SystemExit, match="--exit"):
        main([*argv, "--exit", "deep", "--out", str(workspace / "x")])
    with pytest.raises(SystemExit, match="--exit-max-missed is a share"):
        main([*argv, "--exit-max-missed", "5", "--out", str(workspace / "x")])


def test_fit_exit_pool_mha_searches_attention_exit_heads(capsys, caches, workspace) -> None:
    # --exit-pool auto (the default): an MHA probe reads tokens, so its exit heads do too.
    argv = ["fit", "--cache", str(caches[0]), "--folds", "2", "--epochs", "2"]
    argv += ["--exit", "2", "--exit-epsilon", "1", "--exit-max-missed", "1"]
    assert main([*argv, "--out", str(workspace / "mha")]) == 0
    out = capsys.readouterr().out
    assert "exit search (mha exit heads): full-depth out-of-fold AUPRC" in out, out
    # A mean probe's cache rows are pooled summaries: no tokens for an attention exit.
    argv[argv.index("--folds") :] = ["--pool", "mean", "--folds", "2", "--exit-pool", "mha"]
    argv += ["--exit", "2"]
    assert main([*argv, "--out", str(workspace / "no")]) == 1
    assert "trains on token states" in capsys.readouterr().err


def test_fit_calibrates_with_cross_validation_and_eval_reports_recall_at_1pct_fpr_and_ece(
    capsys, caches, workspace
) -> None:
    argv = ["fit", "--cache", str(caches[0]), "--pool", "mean", "--folds", "2", "--epochs", "3"]
    argv += ["--exit", "off"]
    fitted = run_json(capsys, *argv, "--out", str(workspace / "cal"))
    probe, manifest = load_checkpoint(workspace / "cal", None)
    assert set(probe.spec.calibration) == {"mean-scalar-mix"}  # the single head, by name
    cal = probe.spec.calibration["mean-scalar-mix"]
    assert cal.labels_seen == manifest.counters.labels_seen == 160
    assert fitted["calibration"] == {
        "mean-scalar-mix": {"temperature": round(cal.temperature, 4), "bias": cal.bias}
    }
    for key in ("val_recall_at_1pct_fpr", "val_ece", "cv_ece", "cv_ece_uncalibrated"):
        assert 0 <= fitted[key] <= 1 and manifest.metrics[key] == pytest.approx(fitted[key])
    off = run_json(capsys, *argv, "--calibrate", "off", "--out", str(workspace / "uncal"))
    assert off["calibration"] == {} and "cv_ece" not in off
    assert load_checkpoint(workspace / "uncal", None)[0].spec.calibration == {}
    # Same folds and epochs: calibration moves the scores, not their ranking.
    assert fitted["cv_auprc_mean"] == off["cv_auprc_mean"]
    assert fitted["val_auprc"] == pytest.approx(off["val_auprc"], abs=1e-6)

    assert main([*argv, "--out", str(workspace / "cal-text")]) == 0
    out = capsys.readouterr().out
    assert "out of fold recall at 1 % FPR" in out and "calibration (temperature" in out
    assert main(["eval", "--checkpoint", str(workspace / "cal"), "--cache", str(caches[1])]) == 0
    out = capsys.readouterr().out
    assert "recall at 1% FPR" in out and "ECE" in out
    on_cache = run_json(
        capsys, "eval", "--checkpoint", str(workspace / "cal"), "--cache", str(caches[1])
    )
    assert 0 <= on_cache["ece"] <= 1 and 0 <= on_cache["recall_at_1pct_fpr"] <= 1
