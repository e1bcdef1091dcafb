"""The frozen LLM in memory: the base model, its tokenizer (pad token set), the layer stack
extraction hooks into, and the fingerprint that names it (:class:`LoadedLLM`).

:mod:`worker.llm.source` finds one, :mod:`worker.llm.load` loads it; :mod:`worker.llm.precision`
sets how it computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from schemas import LLMFingerprint
from worker.errors import ModelLoadError
from worker.llm.fingerprint import state_dict_sha256, tokenizer_sha256

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["LoadedLLM", "find_layer_stack"]


@dataclass(frozen=True, eq=False)
class LoadedLLM:
    """A frozen model (``eval()``, no gradients), its tokenizer (pad token set) and identity.

    ``layer_stack`` holds the ``num_layers`` transformer blocks in order; hidden-state index
    ``i`` (1 <= i < num_layers) is the output of ``layer_stack[i - 1]``.

    ``model`` is always the base model. ``lm_head`` is the output embedding (hidden state ->
    vocabulary logits), present only when it was asked for and the weights have one;
    otherwise ``lm_head_missing`` says why there is none.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: LLMFingerprint
    layer_stack: nn.ModuleList
    lm_head: nn.Module | None = None
    lm_head_missing: str | None = None  # set whenever lm_head is None
    # The whole causal LM (base model + head) that generates text, kept with the head: the
    # inline guard (worker.guard) generates with it. None whenever lm_head is None.
    causal: PreTrainedModel | None = None
    # Extraction runs the model under torch.autocast in this dtype (None: as loaded). Not
    # part of the fingerprint: the states stay within bf16 rounding of the plain ones.
    autocast: torch.dtype | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_stack)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def model_type(self) -> str:
        """The architecture as its config names it (``"llama"``, ``"gemma3_text"``, ...)."""
        return str(getattr(self.model.config, "model_type", ""))

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_id: str,
        source_sha256: str | None = None,
        lm_head_missing: str | None = None,
    ) -> LoadedLLM:
        """Freeze an in-process model and fingerprint it.

        Without ``source_sha256`` the weights are hashed from the state dict (fine for tiny
        test models; loaded models pass the hash of their files instead).

        A model with an LM head (``*ForCausalLM``) is split: the base model serves
        extraction, the head is kept as ``lm_head`` (and the base alone is fingerprinted).
        ``lm_head_missing`` overrides why a model without a usable head has none.
        """
        model.eval()
        model.requires_grad_(False)
        _ensure_pad_token(tokenizer)
        head = model.get_output_embeddings()
        causal = None
        if head is not None and model.base_model is not model:
            causal, model = model, model.base_model  # type: ignore[assignment]
        else:
            head = None
        stack = find_layer_stack(model)
        fingerprint = LLMFingerprint(
            model_id=model_id,
            source_sha256=source_sha256 or state_dict_sha256(model),
            num_layers=len(stack),
            hidden_size=int(model.config.hidden_size),
            tokenizer_sha256=tokenizer_sha256(tokenizer),
        )
        lm_head = head if isinstance(head, nn.Module) else None
        if lm_head is None:
            lm_head_missing = lm_head_missing or "the model was loaded without its LM head"
        return cls(
            model=model,
            tokenizer=tokenizer,
            fingerprint=fingerprint,
            layer_stack=stack,
            lm_head=lm_head,
            lm_head_missing=None if lm_head is not None else lm_head_missing,
            causal=causal if lm_head is not None else None,
        )


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a tokenizer without a pad token one it already has (no new embedding row).

    Padded positions are masked out and zeroed, so which token pads does not change any
    real token's hidden state; eos, then unk, then bos, then id 0 is used.
    """
    if tokenizer.pad_token is not None:
        return
    for candidate in (tokenizer.eos_token, tokenizer.unk_token, tokenizer.bos_token):
        if candidate is not None:
            tokenizer.pad_token = candidate
            return
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)


def find_layer_stack(model: nn.Module) -> nn.ModuleList:
    """The ``ModuleList`` of the model's ``num_hidden_layers`` transformer blocks."""
    expected = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == expected and expected:
            return module
    raise ModelLoadError(
        f"cannot find the {expected} transformer blocks of {type(model).__name__}: "
        "only decoder LLMs and BERT-style encoders with one layer list are supported"
    )
