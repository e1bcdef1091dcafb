"""What a text is before the model runs it: cleaned, clipped and tokenized.

1. Cleaning (:func:`clean_text`): ``bytes`` are decoded as strict UTF-8; control
   characters (Unicode ``Cc`` except tab, LF, CR) are removed; a text that is then
   empty or whitespace-only is rejected. Rejections go to ``Extraction.errors``. Then
   the canonical form (:mod:`worker.llm.canonical`: NFKC, format characters removed,
   spelled-out letters joined) is what is tokenized; callers keep the original.
2. Huge texts are first clipped to ``32`` characters per token they can use (head, or
   head and tail), so a megabyte of text never reaches the tokenizer.

What happens to the tokens next (truncation, chunks, the chat form) is
:mod:`worker.llm.extract`'s.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from worker.errors import ConfigError, ExtractionInputError
from worker.llm.canonical import canonical_text

__all__ = [
    "TokenMemo",
    "Truncation",
    "clean_text",
    "special_affixes",
    "tokenize_texts",
    "truncate",
]

log = logging.getLogger(__name__)

Truncation = Literal["head", "head_tail"]
_Seq = TypeVar("_Seq", str, list[int])
# Characters kept per usable token before tokenizing: generous, since only tokens longer
# than this on average (long runs of one character) would lose content to the clip.
_CHARS_PER_TOKEN = 32
# Unicode Cc except \t \n \r.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def clean_text(item: object, *, max_chars: int | None = None, keep: Truncation = "head") -> str:
    """The text to tokenize, or :class:`ExtractionInputError` saying why there is none.

    ``bytes`` must be UTF-8; ``str`` must not hold lone surrogates; control characters
    other than tab, LF and CR are removed; texts over ``max_chars`` keep their head (or
    head and tail); what is left must not be empty or whitespace only.
    """
    if isinstance(item, bytes | bytearray | memoryview):
        try:
            text = bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ExtractionInputError(
                "invalid_utf8", f"byte {exc.start} is not UTF-8 ({exc.reason})"
            ) from exc
    elif isinstance(item, str):
        text = item
    else:
        raise ExtractionInputError("not_text", f"expected str or bytes, got {type(item).__name__}")
    if max_chars is not None and len(text) > max_chars:
        text = truncate(text, max_chars, keep)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ExtractionInputError(
            "invalid_unicode", f"lone surrogate at character {exc.start}"
        ) from exc
    text = _CONTROL_CHARS.sub("", text)
    if not text.strip():
        raise ExtractionInputError("empty", "text is empty or only whitespace/control characters")
    return text


def truncate(seq: _Seq, limit: int, keep: Truncation) -> _Seq:
    """At most ``limit`` items: the head, or the head (rounded up) and the tail."""
    if len(seq) <= limit:
        return seq
    if keep == "head":
        return seq[:limit]
    head = (limit + 1) // 2
    return seq[:head] + seq[len(seq) - (limit - head) :]


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids the tokenizer puts before and after a text (e.g. BOS; CLS ... SEP)."""
    probe = "hello world"
    bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    raise ConfigError(f"cannot tell where {type(tokenizer).__name__} adds special tokens")


def tokenize_texts(
    tokenizer: Any,
    texts: Sequence[str | bytes],
    errors: dict[int, str],
    *,
    max_tokens: int,
    keep: Truncation,
) -> list[tuple[int, list[int]]]:
    """``(input position, content token ids)`` of every text that survives cleaning
    (:func:`clean_text`, then :func:`~worker.llm.canonical.canonical_text`); why each other
    one has none goes to ``errors``. A text is clipped to :data:`_CHARS_PER_TOKEN` characters
    per token of ``max_tokens`` (the content tokens it may keep) before tokenizing."""
    char_limit = max_tokens * _CHARS_PER_TOKEN
    cleaned: list[tuple[int, str]] = []
    for pos, item in enumerate(texts):
        try:
            text = canonical_text(clean_text(item, max_chars=char_limit, keep=keep))
            if not text.strip():
                raise ExtractionInputError("empty", "text is only format characters")
            cleaned.append((pos, text))
        except ExtractionInputError as exc:
            errors[pos] = str(exc)
    if not cleaned:
        return []
    try:
        ids = _encode(tokenizer, [text for _, text in cleaned])
    except Exception as exc:  # find the one text the tokenizer chokes on
        log.warning("batch tokenization failed (%s); tokenizing texts one by one", exc)
        ids = []
        for pos, text in cleaned:
            try:
                ids.append(_encode(tokenizer, [text])[0])
            except Exception as item_exc:
                errors[pos] = str(ExtractionInputError("failed", f"tokenizer: {item_exc}"))
                ids.append([])
    out = []
    for (pos, _), content in zip(cleaned, ids, strict=True):
        if content:
            out.append((pos, content))
        elif pos not in errors:
            errors[pos] = str(ExtractionInputError("empty", "text yields no tokens"))
    return out


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    enc = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)
    return [list(ids) for ids in enc["input_ids"]]


class TokenMemo:
    """:func:`tokenize_texts` that remembers the outcomes (ids, or why none) of the last
    ``size`` texts: the scorer counts a poll's tokens to cut it, then extracts the same
    texts, and each text is cleaned and tokenized once. One per tokenizer and limits;
    safe to share between threads."""

    def __init__(self, tokenizer: Any, *, max_tokens: int, keep: Truncation, size: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.keep: Truncation = keep
        self.size = size
        # text -> its content ids, or why it has none; insertion-ordered (oldest first)
        self._known: dict[str | bytes, list[int] | str] = {}
        self._lock = threading.Lock()

    def __call__(
        self, texts: Sequence[str | bytes], errors: dict[int, str]
    ) -> list[tuple[int, list[int]]]:
        """As :func:`tokenize_texts`: ``(input position, content ids)`` of every text that
        has some, and why each other one has none in ``errors``."""
        known: dict[int, list[int] | str] = {}
        with self._lock:
            for pos, item in enumerate(texts):
                if isinstance(item, str | bytes) and (hit := self._known.get(item)) is not None:
                    known[pos] = hit
        todo = [pos for pos in range(len(texts)) if pos not in known]
        fresh: dict[int, str] = {}
        found = tokenize_texts(
            self.tokenizer,
            [texts[pos] for pos in todo],
            fresh,
            max_tokens=self.max_tokens,
            keep=self.keep,
        )
        outcome: dict[int, list[int] | str] = {todo[i]: ids for i, ids in found}
        outcome.update({todo[i]: why for i, why in fresh.items()})
        with self._lock:
            for pos, result in outcome.items():
                item = texts[pos]
                if isinstance(item, str | bytes):
                    self._known[item] = result
            while len(self._known) > self.size:
                del self._known[next(iter(self._known))]  # the oldest first
        outcome.update(known)
        out: list[tuple[int, list[int]]] = []
        for pos in sorted(outcome):
            result = outcome[pos]
            if isinstance(result, str):
                errors[pos] = result
            else:
                out.append((pos, result))
        return out
