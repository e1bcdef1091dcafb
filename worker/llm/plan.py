"""How a call's texts are cut into forward passes (the extractor's micro-batches, and the
scorer's planner cutting a backlog the same way).

Each text's ids become one piece, or one per chunk of a long text (:func:`chunk`), each
in its :class:`~worker.llm.chat_form.Frame` (:func:`plan_pieces`). The pieces of all
texts are sorted by length (longest first) and cut into micro-batches of at most
``batch_size`` pieces and at most ``batch_tokens`` padded tokens (pieces × the longest
piece in the micro-batch), so short texts are not padded to long ones and a long text
runs alone rather than inflating a batch of short ones; a piece shorter than
``batch_min_fill`` × the micro-batch's longest starts a new one, so padding never
outweighs a row's own tokens that much (chat lengths are skewed: a batch of 8 ToxicChat
texts padded to its longest held 3.7× its real tokens).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.llm.text import Truncation, truncate

if TYPE_CHECKING:
    from worker.llm.chat_form import Frame
    from worker.settings import LLMSettings

__all__ = [
    "CUDA_BATCH_TOKENS",
    "Batching",
    "Padding",
    "Piece",
    "chunk",
    "length_batches",
    "plan_pieces",
    "span_mask",
    "token_buckets",
]

# Padded tokens per forward pass on CUDA unless BATCH_TOKENS is set: 256 texts of 256
# tokens, one pass per scoring call. The forward there is launch-bound up to ~64 texts
# (issue 44, one H200: 1 x 32 tokens 25.2 ms, 64 x 64 tokens 21.8 ms), so the CPU's
# length-sorted 4096-token passes ran a 64-message call as several passes of the same cost.
CUDA_BATCH_TOKENS = 65536


@dataclass(frozen=True)
class Batching:
    """How a call's texts are cut into forward passes (see the module docstring)."""

    batch_size: int  # pieces per pass at most
    batch_tokens: int | None  # padded tokens per pass at most (None: no budget)
    min_fill: float  # a piece shorter than this share of its pass's longest starts another
    buckets: tuple[int, ...] | None = None  # widths a pass is padded up to (None: its longest)

    @classmethod
    def for_device(cls, settings: LLMSettings, device: torch.device) -> Batching:
        """The settings' batching for an LLM on ``device``: as set on the CPU (length-sorted
        token budgets, measured there: ``bench/batching.py``); on CUDA, what the settings
        leave at its default is one pass per call, up to :data:`CUDA_BATCH_TOKENS` padded
        tokens and no split by length, since a pass costs about the same whatever its rows;
        and its width padded up to one of a few sizes (:func:`token_buckets`), so that the
        passes repeat a few shapes (what CUDA graphs and compiled kernels are made for).
        """
        tokens, fill = settings.batch_tokens or None, settings.batch_min_fill
        if device.type != "cuda":
            return cls(settings.batch_size, tokens, fill)
        chosen = settings.model_fields_set
        tokens = tokens if "batch_tokens" in chosen else CUDA_BATCH_TOKENS
        fill = fill if "batch_min_fill" in chosen else 0.0
        return cls(settings.batch_size, tokens, fill, token_buckets(settings.max_tokens))


def token_buckets(max_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Pass widths: powers of two from ``smallest`` below ``max_tokens``, then it.

    >>> token_buckets(256)
    (16, 32, 64, 128, 256)
    >>> token_buckets(300)
    (16, 32, 64, 128, 256, 300)
    """
    sizes = []
    width = smallest
    while width < max_tokens:
        sizes.append(width)
        width *= 2
    return (*sizes, max_tokens)


def length_batches(
    lengths: Sequence[int],
    budget: int | None,
    max_items: int | None = None,
    min_fill: float = 0.0,
) -> list[list[int]]:
    """Indices of ``lengths`` longest first (equal lengths keep their order), cut into
    batches: one closes at ``max_items``, when one more would pad it past ``budget``
    tokens (its width is its first, longest item), or before an item shorter than
    ``min_fill`` × that width.

    >>> length_batches([6, 100, 40, 90, 10], budget=None, min_fill=0.5)
    [[1, 3], [2], [4, 0]]
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        current = batches[-1] if batches else None
        if (
            current is None
            or (max_items is not None and len(current) >= max_items)
            or (budget is not None and lengths[current[0]] * (len(current) + 1) > budget)
            or lengths[i] < min_fill * lengths[current[0]]
        ):
            batches.append([i])
        else:
            current.append(i)
    return batches


@dataclass(frozen=True)
class Padding:
    """How a micro-batch's pieces are padded into one input: with ``pad_id``, on the left
    or the right, up to its longest piece or the next of ``buckets`` (positions come from
    the attention mask, so the states do not change)."""

    pad_id: int
    left: bool
    buckets: tuple[int, ...] | None = None

    def width(self, longest: int) -> int:
        """The input's width for a longest piece of ``longest`` ids.

        >>> Padding(0, left=False, buckets=(16, 32)).width(20), Padding(0, left=True).width(20)
        (32, 20)
        """
        return next((w for w in self.buckets or () if w >= longest), longest)


@dataclass(frozen=True, slots=True)
class Piece:
    """One model input: a whole text, or one chunk of a long text."""

    row: int  # output row
    offset: int  # where its output tokens start among the row's tokens
    ids: list[int]  # what the model runs: context, special tokens and the text's tokens
    skip: int = 0  # leading ids run but not output (the chat form's context)
    chunks: int = 1  # pieces of its row: 1, the piece is the whole row


def plan_pieces(
    contents: list[list[int]], frame: Frame, chunks: Callable[[list[int]], list[list[int]]]
) -> tuple[list[Piece], list[int]]:
    """The pieces to run for each row's content ids (cut by ``chunks``, each put in
    ``frame``), and each row's output token count (the frame's context left out)."""
    pieces: list[Piece] = []
    lengths: list[int] = []
    for row, content in enumerate(contents):
        offset = 0
        parts = chunks(content)
        for part in parts:
            ids = frame.ids(part)
            skip, end = frame.span(len(part))  # end: all of ids
            pieces.append(Piece(row, offset, ids, skip, len(parts)))
            offset += end - skip
        lengths.append(offset)
    return pieces, lengths


def chunk(content: list[int], budget: int, max_chunks: int, keep: Truncation) -> list[list[int]]:
    """``content`` whole when it fits ``budget`` ids, else truncated to ``max_chunks``
    budgets and cut into near-equal chunks of at most ``budget`` ids."""
    if len(content) <= budget:
        return [content]
    content = truncate(content, budget * max_chunks, keep)
    n = math.ceil(len(content) / budget)
    size, extra = divmod(len(content), n)  # near-equal: the first `extra` get one more
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [content[a:b] for a, b in itertools.pairwise(bounds)]


def span_mask(starts: Sequence[int], lengths: Sequence[int], width: int) -> torch.Tensor:
    """``[len(starts), width]`` bool: row ``i`` True on ``starts[i] .. + lengths[i]``."""
    cols = torch.arange(width)  # [width]
    lo = torch.tensor(starts, dtype=torch.long)[:, None]  # [n, 1]
    hi = lo + torch.tensor(lengths, dtype=torch.long)[:, None]
    return (cols >= lo) & (cols < hi)
