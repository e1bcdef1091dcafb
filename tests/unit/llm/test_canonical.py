"""Text canonicalization: evasion variants read as the plain text, what people see stays."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from tests.unit.offline_helpers import tiny_extractor
from worker.llm.canonical import _FORMAT, canonical_text

PLAIN = "you are an idiot"
VARIANTS = [
    "you are an i\u200bd\u200bi\u200bo\u200bt",  # zero-width spaces inside the word
    "you are an idi\u00adot",  # soft hyphen
    "you are an \u2060idiot\ufeff",  # word joiner, BOM
    "\u202eyou are an idiot\u202c",  # bidi override
    "ｙｏｕ ａｒｅ ａｎ ｉｄｉｏｔ",  # fullwidth (NFKC)
    "you are an 𝐢𝐝𝐢𝐨𝐭",  # mathematical bold (NFKC)
    "you are an i d i o t",  # spelled out
    "you are an i.d.i.o.t",
    "you are an i-d-i-o-t",
    "you are an i*d*i*o*t",
]


def test_the_format_class_is_every_unicode_format_character() -> None:
    cf = {chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"}
    everything = "".join(chr(c) for c in range(sys.maxunicode + 1))
    assert set(_FORMAT.findall(everything)) == cf


@pytest.mark.parametrize("variant", VARIANTS)
def test_evasion_variants_canonicalize_to_the_plain_text(variant: str) -> None:
    assert canonical_text(variant) == PLAIN


@pytest.mark.parametrize(
    "text",
    [
        "U.S.A. is big",  # three letters: an abbreviation, not a spelled-out word
        "a b c",
        "i d-i o t",  # mixed separators: left alone
        "plain words stay as they are",
        "naïve café",  # NFKC keeps composed letters
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert canonical_text(text) == unicodedata.normalize("NFKC", text)


def test_the_model_reads_every_variant_as_the_plain_text() -> None:
    ex = tiny_extractor()
    plain = ex.token_ids(PLAIN)
    assert all(ex.token_ids(v) == plain for v in VARIANTS)


def test_a_text_of_format_characters_only_is_refused_as_empty() -> None:
    ex = tiny_extractor()
    out = ex.extract(["\u200b\u200d\ufeff", "ok"], layers=[1])
    assert out.index == [1]
    assert out.errors[0].startswith("empty: ")
