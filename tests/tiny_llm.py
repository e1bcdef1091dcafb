"""The tests' tiny random LLM: it lives in :mod:`worker.llm.tiny`, where the bench scripts
build it too (benches import nothing from ``tests``)."""

from worker.llm.tiny import (
    CHAT_TEMPLATE,
    HIDDEN_SIZE,
    NUM_LAYERS,
    make_tiny_gemma3,
    make_tiny_llm,
    tiny_model,
    tiny_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "HIDDEN_SIZE",
    "NUM_LAYERS",
    "make_tiny_gemma3",
    "make_tiny_llm",
    "tiny_model",
    "tiny_tokenizer",
]
