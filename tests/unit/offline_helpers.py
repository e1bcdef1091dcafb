"""Generated labeled files and a tiny-LLM extractor for the offline (cache/fit/eval) tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "log", "sun", "day", "blue", "green"]
TOXIC = ["idiot", "moron", "trash", "stupid", "hate"]


def write_labeled(path: Path, n: int, *, seed: int = 0, multilabel: bool = True) -> Path:
    """``n`` rows: "toxic" texts contain insult words (learnable from characters alone)."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for i in range(n):
            toxic = rng.random() < 0.35
            words = rng.choices(WORDS, k=rng.randint(3, 12))
            cats: list[str] = []
            if toxic:
                for _ in range(rng.randint(1, 3)):
                    words.insert(rng.randrange(len(words) + 1), rng.choice(TOXIC))
                cats = ["insult"] + (["hate"] if "hate" in words else [])
            row: dict[str, str | list[str]] = {
                "id": f"r{seed}-{i}",
                "text": " ".join(words),
                "label": "toxic" if toxic else "ok",
            }
            if multilabel:
                row["labels"] = sorted(cats)
            fh.write(json.dumps(row) + "\n")
    return path


def tiny_extractor(max_tokens: int = 64, batch_size: int = 4) -> HiddenStateExtractor:
    """An in-memory tiny random Llama (4 layers, hidden size 32) behind the real extractor."""
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=max_tokens, batch_size=batch_size)
