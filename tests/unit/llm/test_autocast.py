"""Mixed-precision extraction (PROBEGUARD_AUTOCAST), on the tiny random model: bfloat16
matmuls keep the states close to float32 and independent of batch mates, the fingerprint
is unchanged (a float32-trained probe serves on them), and ``auto`` picks it only where
the hardware runs it natively."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from worker.errors import ConfigError
from worker.llm import precision as precision_module
from worker.llm.extract import HiddenStateExtractor
from worker.llm.load import (
    apply_autocast,
    cpu_has_native_bf16,
    load_llm,
    quantize_llm,
    resolve_autocast,
)
from worker.llm.tiny import make_tiny_llm
from worker.settings import Settings

TEXTS = [
    "hello there, how are you?",
    "you are a terrible person and everyone knows it",
    "ok",
    "a somewhat longer message that pads the others in its batch quite a lot",
]
LAYERS = [0, 1, 2, 4]


def real_states(ex: HiddenStateExtractor, texts: list[str]) -> list[torch.Tensor]:
    out = ex.extract(texts, LAYERS)
    return [out.hidden[:, row][:, out.mask[row]] for row in range(len(texts))]  # [L, n, D]


def test_autocast_states_are_float32_close_to_plain_and_not_identical() -> None:
    plain = make_tiny_llm()
    mixed = replace(plain, autocast=torch.bfloat16)
    a = real_states(HiddenStateExtractor(plain, max_tokens=64), TEXTS)
    b = real_states(HiddenStateExtractor(mixed, max_tokens=64), TEXTS)
    for x, y in zip(a, b, strict=True):
        assert y.dtype == torch.float32  # the residual stream stays in the weights' dtype
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)  # [L, n]
        assert cos.min() > 0.999
    assert any(not torch.equal(x, y) for x, y in zip(a, b, strict=True))  # really bf16
    assert mixed.fingerprint == plain.fingerprint  # the same probes serve on both


def test_autocast_states_do_not_depend_on_batch_mates() -> None:
    ex = HiddenStateExtractor(replace(make_tiny_llm(), autocast=torch.bfloat16), max_tokens=64)
    batched = real_states(ex, TEXTS)
    for text, together in zip(TEXTS, batched, strict=True):
        (alone,) = real_states(ex, [text])
        # bf16 rounding of the matmuls: a different padded width may round differently,
        # but nothing in the pass reads the other texts (as int8 dynamic scales would).
        scale = alone.abs().amax(dim=-1, keepdim=True)
        assert ((alone - together).abs() / scale).max() < 0.05


def test_resolve_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_tiny_llm()
    assert resolve_autocast("off", llm) is None
    assert resolve_autocast("bfloat16", llm) is torch.bfloat16
    assert resolve_autocast("float16", llm) is torch.float16
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: True)
    assert resolve_autocast("auto", llm) is torch.bfloat16
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: False)
    assert resolve_autocast("auto", llm) is None  # emulated bf16 can be slower than fp32
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: True)
    quantized = quantize_llm(make_tiny_llm(), "int8")
    assert resolve_autocast("auto", quantized) is None
    with pytest.raises(ConfigError, match="PROBEGUARD_AUTOCAST=off"):
        resolve_autocast("bfloat16", quantized)
    half = make_tiny_llm()
    half.model.to(torch.bfloat16)  # type: ignore[arg-type]
    assert resolve_autocast("auto", half) is None  # weights already in bf16
    with pytest.raises(ConfigError, match="applies to float32 weights"):
        resolve_autocast("float16", half)


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ("fpu sse2 avx2 avx512f avx512bw", False),
        ("fpu avx512f avx512_bf16 avx512_vnni", False),  # measured slower than float32
        ("fpu avx512f amx_bf16 amx_tile", True),
        ("fp asimd bf16", False),  # arm's flag has another name: off unless asked for
    ],
)
def test_cpu_has_native_bf16_reads_the_flags(tmp_path: Path, flags: str, native: bool) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert cpu_has_native_bf16(info) is native
    assert cpu_has_native_bf16(tmp_path / "missing") is False


def test_load_llm_applies_the_setting(tmp_path: Path) -> None:
    make_tiny_llm(tmp_path)
    directory, cache = str(tmp_path / "tiny-llama-0"), tmp_path / "c"
    plain = load_llm(Settings(model=directory, cache_dir=cache, autocast="off"))
    mixed = load_llm(Settings(model=directory, cache_dir=cache, autocast="bfloat16"))
    assert plain.autocast is None and mixed.autocast is torch.bfloat16
    assert mixed.fingerprint == plain.fingerprint


def test_settings_refuse_autocast_where_it_cannot_apply() -> None:
    assert Settings(llm_quantize="int8", autocast="auto").autocast == "auto"
    assert Settings(llm_quantize="int8", autocast="off").autocast == "off"
    with pytest.raises(ValidationError, match="PROBEGUARD_AUTOCAST=auto or off"):
        Settings(llm_quantize="int8", autocast="bfloat16")
    with pytest.raises(ValidationError, match="already computes in bfloat16"):
        Settings(dtype="bfloat16", autocast="bfloat16")
    assert Settings(dtype="bfloat16", autocast="auto").autocast == "auto"  # resolves off
    with pytest.raises(ValidationError):
        Settings(autocast="float64")


def test_apply_autocast_casts_the_linear_layers_once_with_the_same_states() -> None:
    """Autocast casts a frozen float32 weight on every call; pre-cast linear layers skip
    that and give exactly the states autocast alone gives."""
    alone = replace(make_tiny_llm(), autocast=torch.bfloat16)
    cast = apply_autocast(make_tiny_llm(), "bfloat16")
    assert cast.autocast is torch.bfloat16
    linears = [m for m in cast.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert all(
        m.weight.dtype == torch.float32
        for m in alone.model.modules()
        if hasattr(m, "weight") and isinstance(m, torch.nn.Linear)
    )
    a = HiddenStateExtractor(alone, max_tokens=64).extract(TEXTS, LAYERS).hidden
    b = HiddenStateExtractor(cast, max_tokens=64).extract(TEXTS, LAYERS).hidden
    assert b.dtype == torch.float32 and torch.equal(a, b)
    plain = make_tiny_llm()
    assert apply_autocast(plain, "off") is plain
