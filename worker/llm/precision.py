"""How the frozen LLM computes: the device it runs on, int8 dynamic quantization of its
linear layers, and autocast (bfloat16 where it is native and a gain); and the dtype its
hidden states are stored in (``Settings.state_dtype``).

Quantization changes the states, so the fingerprint records it (a probe trained on
unquantized states is refused on quantized ones and vice versa); autocast keeps them within
bf16 rounding of the plain ones and is not part of the fingerprint.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from schemas import StateDtype
from worker.errors import ConfigError
from worker.llm.model import LoadedLLM
from worker.settings import StateDtypeSetting

__all__ = [
    "DTYPES",
    "QUANTIZATIONS",
    "apply_autocast",
    "cpu_has_native_bf16",
    "quantize_llm",
    "resolve_autocast",
    "resolve_device",
    "resolve_state_dtype",
]

# Settings.llm_quantize -> the fingerprint's quantization tag.
QUANTIZATIONS: dict[str, str] = {"int8": "torch-int8-dynamic"}

# Model types (config.model_type prefixes) whose residual stream exceeds fp16's 65504, so
# that `STATE_DTYPE=auto` stores their states as bfloat16: Gemma 3 (gemma3, gemma3_text),
# measured up to 1.04e5 on ToxicChat texts (bench/quality.md).
WIDE_STATE_MODEL_TYPES = ("gemma3",)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def quantize_llm(llm: LoadedLLM, scheme: str = "int8") -> LoadedLLM:
    """``llm`` with its base model's ``nn.Linear`` layers quantized (in place: use only the
    result), and a fingerprint that says so.

    ``"int8"``: torch dynamic quantization (``quantize_dynamic``): int8 weights, activations
    quantized per call with one scale per tensor, so a text's states depend slightly on the
    texts batched with it. CPU and float32 only (torch has no such kernels elsewhere).
    """
    if scheme not in QUANTIZATIONS:
        raise ConfigError(f"unknown LLM quantization {scheme!r}; one of {sorted(QUANTIZATIONS)}")
    if llm.fingerprint.quantization is not None:
        raise ConfigError(f"the LLM is already quantized ({llm.fingerprint.quantization})")
    if llm.device.type != "cpu" or llm.dtype != torch.float32:
        raise ConfigError(
            f"LLM quantization {scheme!r} (torch dynamic int8) runs on CPU in float32 only; "
            f"this LLM is on {llm.device} in {llm.dtype}: unset PROBEGUARD_LLM_QUANTIZE, or "
            "set PROBEGUARD_DEVICE=cpu and PROBEGUARD_DTYPE=float32"
        )
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, which is no dependency
        # here; its eager dynamic quantization still runs (measured: bench/quantized_llm.py).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantize_dynamic(llm.model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    fingerprint = llm.fingerprint.model_copy(update={"quantization": QUANTIZATIONS[scheme]})
    return replace(llm, fingerprint=fingerprint)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N``, ``mps``, or ``auto`` (CUDA, else MPS, else CPU)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {name!r} requested but MPS is not available")
    return device


def apply_autocast(llm: LoadedLLM, setting: str) -> LoadedLLM:
    """``llm`` set to run under autocast as ``setting`` (``Settings.autocast``) resolves
    (:func:`resolve_autocast`); its base model's linear layers are cast in place to that
    dtype, so use only the result.

    Autocast alone would cast every frozen weight again on every call (its cast cache
    serves only weights that require grad); casting the linear layers once gives the same
    states and drops that cost (a one-message pass on SmolLM2: 77 -> 46 ms).
    """
    dtype = resolve_autocast(setting, llm)
    if dtype is None:
        return llm
    for module in llm.model.modules():
        if isinstance(module, nn.Linear):
            module.to(dtype)
    return replace(llm, autocast=dtype)


def resolve_autocast(setting: str, llm: LoadedLLM) -> torch.dtype | None:
    """The dtype extraction autocasts ``llm``'s forward pass to, or None (``Settings.autocast``).

    ``auto`` picks bfloat16 only where it is both native and a gain: float32 weights, not
    quantized, on CUDA with bf16 support or on a CPU with AMX (elsewhere, AVX512-BF16
    included, CPU bf16 measured slower than float32: :func:`cpu_has_native_bf16`).
    """
    if setting == "off":
        return None
    if setting != "auto":
        if llm.fingerprint.quantization is not None:
            raise ConfigError(
                f"autocast {setting} cannot apply to an LLM quantized "
                f"({llm.fingerprint.quantization}): set PROBEGUARD_AUTOCAST=off"
            )
        if llm.dtype != torch.float32:
            raise ConfigError(
                f"autocast {setting} applies to float32 weights; this LLM is in {llm.dtype}: "
                "set PROBEGUARD_AUTOCAST=off"
            )
        return DTYPES[setting]
    if llm.fingerprint.quantization is not None or llm.dtype != torch.float32:
        return None
    if llm.device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if llm.device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else None
    return None


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU multiplies bfloat16 fast enough to gain over float32: x86 AMX
    (``amx_bf16``). False where ``/proc/cpuinfo`` is missing (e.g. macOS).

    AVX512-BF16 alone does not count: measured with ``bench/forward_options.py`` on 2 cores
    of such a CPU, bf16 autocast ran the default LLM at 0.65x the texts/s of float32
    (oneDNN's bf16 path there costs more than it saves), while on an AMX CPU it ran 2.9x
    (``bench/quantized_llm.py --variant bf16``).
    """
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return "amx_bf16" in flags


def resolve_state_dtype(setting: StateDtypeSetting, model_type: str) -> StateDtype:
    """How the hidden states of a ``model_type`` LLM are stored (``Settings.state_dtype``) in
    caches and the updater's replay: an explicit value as it is; ``auto``: ``bfloat16`` for
    the models in :data:`WIDE_STATE_MODEL_TYPES` (as fp16 their states overflow), else
    ``float16``.

    Example: ``resolve_state_dtype("auto", "gemma3_text") == "bfloat16"``, and
    ``resolve_state_dtype("auto", "llama") == "float16"``.
    """
    if setting != "auto":
        return setting
    return "bfloat16" if model_type.startswith(WIDE_STATE_MODEL_TYPES) else "float16"
