"""A tiny random LLM for tests: built in-process, offline, in well under a second.

The tokenizer is character-level (one token per printable ASCII character, ``<unk>`` for
anything else), so a text's token count is easy to predict: ``len(text)`` content tokens
plus the special tokens of the architecture:

- ``arch="llama"``: a Llama decoder; ``<s>`` before the text; the tokenizer has **no**
  pad token of its own (loading gives it one, as for real decoder LLMs);
- ``arch="bert"``: a BERT encoder; ``[CLS]`` before and ``[SEP]`` after the text.

Example::

    llm = make_tiny_llm()                      # in memory
    llm = make_tiny_llm(tmp_path, arch="bert") # saved to tmp_path and loaded with load_llm
    llm.num_layers, llm.hidden_size            # (4, 32)
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from worker.llm import LoadedLLM, load_llm
from worker.settings import Settings

__all__ = ["HIDDEN_SIZE", "NUM_LAYERS", "make_tiny_llm", "tiny_tokenizer"]

Arch = Literal["llama", "bert"]
HIDDEN_SIZE = 32
NUM_LAYERS = 4
_SPECIALS: dict[Arch, list[str]] = {
    "llama": ["<unk>", "<s>", "</s>"],
    "bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
}


def tiny_tokenizer(arch: Arch = "llama", *, extra_chars: str = "") -> PreTrainedTokenizerFast:
    """Character-level tokenizer; ``extra_chars`` grows the vocabulary (changes its hash)."""
    specials = _SPECIALS[arch]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable + extra_chars))}
    unk = "<unk>" if arch == "llama" else "[UNK]"
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if arch == "llama":
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def tiny_model(arch: Arch = "llama", *, vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised base model (no LM head), seeded: same seed, same weights."""
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    }
    if arch == "llama":
        return LlamaModel(LlamaConfig(**common, num_key_value_heads=2)).eval()
    return BertModel(BertConfig(**common, pad_token_id=0)).eval()


def make_tiny_llm(
    tmp_path: Path | None = None,
    *,
    arch: Arch = "llama",
    padding_side: Literal["right", "left"] = "right",
    seed: int = 0,
) -> LoadedLLM:
    """A frozen tiny LLM; with ``tmp_path`` it is saved there and loaded through ``load_llm``."""
    tokenizer = tiny_tokenizer(arch)
    model = tiny_model(arch, vocab_size=len(tokenizer), seed=seed)
    if tmp_path is None:
        llm = LoadedLLM.from_model(model, tokenizer, model_id=f"tiny-{arch}-{seed}")
    else:
        directory = tmp_path / f"tiny-{arch}-{seed}"
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        llm = load_llm(Settings(model=str(directory), cache_dir=tmp_path / "cache"))
    llm.tokenizer.padding_side = padding_side
    return llm
