"""Text cleaning, truncation and chunk planning: the parts that need no model."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.errors import ConfigError, ExtractionInputError
from worker.llm.extract import HiddenStateExtractor, clean_text
from worker.llm.text import truncate
from worker.llm.tiny import make_tiny_llm

ALLOWED_CONTROLS = {"\t", "\n", "\r"}


@given(st.text())
def test_clean_text_returns_clean_text_or_a_typed_error(text: str) -> None:
    try:
        cleaned = clean_text(text)
    except ExtractionInputError as exc:
        assert exc.kind in {"empty", "invalid_unicode"}
        return
    assert cleaned.strip()
    assert all(unicodedata.category(c) != "Cc" or c in ALLOWED_CONTROLS for c in cleaned)
    assert cleaned == "".join(
        c for c in text if unicodedata.category(c) != "Cc" or c in ALLOWED_CONTROLS
    )


@given(st.binary())
def test_clean_bytes_decodes_utf8_or_rejects(raw: bytes) -> None:
    try:
        raw.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    try:
        clean_text(raw)
    except ExtractionInputError as exc:
        assert exc.kind == ("empty" if valid else "invalid_utf8")


@pytest.mark.parametrize(
    ("item", "kind"),
    [
        ("", "empty"),
        (" \n\t\r ", "empty"),
        ("\x00\x1b\x7f\x85", "empty"),
        (b"\xc3\x28", "invalid_utf8"),
        ("bad \udcff", "invalid_unicode"),
        (None, "not_text"),
        (3.5, "not_text"),
        (["list"], "not_text"),
    ],
)
def test_clean_text_rejections(item: object, kind: str) -> None:
    with pytest.raises(ExtractionInputError) as info:
        clean_text(item)
    assert info.value.kind == kind
    assert str(info.value).startswith(f"{kind}: ")


def test_clean_text_accepts_bytes_and_keeps_unicode() -> None:
    assert clean_text("héllo\twörld 👋\n".encode()) == "héllo\twörld 👋\n"
    assert clean_text(bytearray(b"ok")) == "ok"
    assert clean_text("a\u200db") == "a\u200db"  # format characters (ZWJ in emoji) stay


def test_clean_text_clips_huge_text_before_checking_it() -> None:
    assert clean_text("ab" * 1000, max_chars=10) == "ababababab"
    assert clean_text("0123456789" * 3, max_chars=6, keep="head_tail") == "012789"
    # A lone surrogate in the part that is clipped away does not matter.
    assert clean_text("fine" + "\ud800" * 10, max_chars=4) == "fine"


@given(
    st.lists(st.integers(), max_size=50),
    st.integers(1, 60),
    st.sampled_from(["head", "head_tail"]),
)
def test_truncate_keeps_head_and_tail(seq: list[int], limit: int, keep: str) -> None:
    out = truncate(seq, limit, keep)  # type: ignore[arg-type]
    assert len(out) == min(len(seq), limit)
    if len(seq) <= limit:
        assert out == seq
    elif keep == "head":
        assert out == seq[:limit]
    else:
        head = (limit + 1) // 2
        assert out[:head] == seq[:head]
        assert out[head:] == seq[len(seq) - (limit - head) :]


@given(
    n=st.integers(1, 300),
    max_tokens=st.integers(2, 40),
    max_chunks=st.integers(1, 6),
    keep=st.sampled_from(["head", "head_tail"]),
)
def test_chunk_plan_properties(n: int, max_tokens: int, max_chunks: int, keep: str) -> None:
    ex = HiddenStateExtractor(
        _LLM,
        max_tokens=max_tokens,
        max_chunks=max_chunks,
        truncation=keep,  # type: ignore[arg-type]
    )
    budget = max_tokens - 1  # <s>
    content = list(range(n))
    chunks = ex._chunks(content)
    sizes = [len(c) for c in chunks]
    assert 1 <= len(chunks) <= max_chunks
    assert max(sizes) <= budget and max(sizes) - min(sizes) <= 1
    assert [t for c in chunks for t in c] == truncate(content, budget * max_chunks, keep)  # type: ignore[arg-type]
    pieces, lengths = ex._plan([content])
    assert lengths == [sum(len(p.ids) for p in pieces)]
    assert all(len(p.ids) <= max_tokens and p.ids[0] == ex._frame.prefix[0] for p in pieces)


_LLM = make_tiny_llm()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},  # no room next to <s>
        {"max_tokens": 4096},  # beyond the tiny model's 512 positions
        {"max_tokens": 16, "truncation": "tail"},
        {"max_tokens": 16, "batch_size": 0},
        {"max_tokens": 16, "max_chunks": 0},
    ],
)
def test_invalid_extractor_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        HiddenStateExtractor(_LLM, **kwargs)  # type: ignore[arg-type]


def test_a_text_is_tokenized_once_for_counting_and_extracting() -> None:
    llm = make_tiny_llm()
    ex = HiddenStateExtractor(llm, max_tokens=32)
    seen: list[str] = []
    tokenizer = llm.tokenizer
    encode = tokenizer.__class__.__call__

    def counting(self: object, texts: list[str], *args: object, **kwargs: object) -> object:
        seen.extend(texts if isinstance(texts, list) else [texts])
        return encode(self, texts, *args, **kwargs)

    texts: list[str | bytes] = ["first text", "second", b"\xff", "third one"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer.__class__, "__call__", counting)
        counts = ex.token_counts(texts)  # the scorer cuts a poll by these
        out = ex.extract(texts, [1])  # then extracts it
        again = ex.token_counts(texts[:2])
    assert sorted(seen) == ["first text", "second", "third one"]  # each once
    assert counts == [len(t) + 1 if isinstance(t, str) else 0 for t in texts]
    assert again == counts[:2]
    assert out.index == [0, 1, 3] and set(out.errors) == {2}
    assert out.mask.sum(1).tolist() == [c for c in counts if c]
