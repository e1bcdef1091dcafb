"""The one canonical form of a text before any role tokenizes it (fit's caches, the scorer,
``serve``, the guard's fallback pass, ``explain``): what the model reads, never what people
see (the stored and displayed text stays the original, escaped where it is shown).

1. Unicode NFKC: compatibility forms fold to their plain letters, so fullwidth ``ｉｄｉｏｔ``,
   mathematical ``𝐢𝐝𝐢𝐨𝐭`` or ligatures read as ``idiot`` (homoglyphs from NFKC's own
   table; look-alikes from other scripts, e.g. Cyrillic ``а``, are letters of their own and
   stay).
2. Format characters (Unicode ``Cf``: zero-width space, joiners, soft hyphen, bidi
   controls, the BOM, invisible operators) are removed: they change the tokens without
   changing what a reader sees. Emoji joined by ZWJ read as their parts.
3. Letters spelled out one by one (``i d i o t``, ``i.d.i.o.t``, ``i-d-i-o-t``: at least
   four single letters, each separated by one space, dot, hyphen, underscore or asterisk)
   are joined into the word they spell.

>>> canonical_text("you are an i\\u200bd\\u200bi\\u200bo\\u200bt")
'you are an idiot'
>>> canonical_text("ｙｏｕ ａｒｅ")
'you are'
>>> canonical_text("what an i d i o t")
'what an idiot'
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["canonical_text"]

# Unicode Cf (Python 3.11's tables), written out so importing costs nothing; a test checks it
# against unicodedata.
_FORMAT = re.compile(
    r"[\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u180e\u200b-\u200f"
    r"\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
    r"\U00013430-\U00013438\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001"
    r"\U000e0020-\U000e007f]"
)
# Four or more single letters, each followed by the same kind of one-character separator.
_SPELLED = re.compile(r"(?<![^\W\d_])(?:[^\W\d_]([ .\-_*])){3,}[^\W\d_](?![^\W\d_])")


def _join(match: re.Match[str]) -> str:
    run = match.group(0)
    return run[::2] if all(c == match.group(1) for c in run[1::2]) else run


def canonical_text(text: str) -> str:
    """NFKC, format characters removed, spelled-out letters joined (module docstring)."""
    text = _FORMAT.sub("", unicodedata.normalize("NFKC", text))
    return _SPELLED.sub(_join, text)
