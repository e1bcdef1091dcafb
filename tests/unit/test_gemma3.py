"""Gemma 3 as the second model: ``STATE_DTYPE=auto`` (bfloat16 for Gemma 3, whose states
exceed fp16's range)."""

from __future__ import annotations

import torch

from tests.tiny_llm import make_tiny_gemma3, make_tiny_llm
from worker.learning.online_learner import LearningConfig
from worker.llm.extract import HiddenStateExtractor
from worker.llm.precision import resolve_state_dtype
from worker.settings import Settings

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
