"""Parameter-free token poolings: masked mean, masked max, first and last real token.

Every pooling maps hidden states ``[L, B, T, D]`` and a mask ``[B, T]`` (True on
real tokens) to one vector per layer and example, ``[L, B, D]``. Padded positions
may hold anything (even NaN): they never reach the result. "First" and "last"
are read from the mask, so left and right padding give the same answer.

These four are *separable*: their output is a per-layer summary a cache can
store once, and any affine per-dimension normalization commutes with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from probes.kinds.base import TokenPoolModule, register_token_pool
from schemas import ProbeSpec

__all__ = [
    "SUMMARIES",
    "FirstPool",
    "LastPool",
    "MaxPool",
    "MeanPool",
    "first_token",
    "last_token",
    "masked_max",
    "masked_mean",
    "per_span",
    "real_spans",
    "real_token_index",
]


def real_spans(mask: Tensor) -> list[tuple[int, int]] | None:
    """``[start, end)`` of each row's real tokens when they are one contiguous run (right or
    left padding, the extractor's layouts); None when any row has holes.

    Pooling over these spans reads only real tokens: no ``[L, B, T, D]`` temporary, and
    whatever the padding holds (even NaN) is never touched.
    """
    if mask.dim() != 2 or mask.shape[1] == 0:
        return None
    counts = mask.sum(dim=1)  # [B]
    first = mask.to(torch.int8).argmax(dim=1)  # [B]; 0 for an empty row
    positions = torch.arange(mask.shape[1], device=mask.device)[None, :]
    run = (positions >= first[:, None]) & (positions < (first + counts)[:, None])
    if not bool((run == mask).all()):
        return None
    return [(f, f + n) for f, n in zip(first.tolist(), counts.tolist(), strict=True)]


def per_span(
    hidden: Tensor,
    spans: list[tuple[int, int]],
    reduce: Callable[[Tensor], Tensor],
    *,
    empty: float,
) -> Tensor:
    """``reduce`` (``[L, n, D]`` -> ``[L, D]``) over each row's real tokens:
    ``[L, B, T, D]`` -> ``[L, B, D]``; a row without real tokens gets ``empty``."""
    L, _, _, D = hidden.shape
    rows = [
        reduce(hidden[:, b, s:e])
        if e > s
        else torch.full((L, D), empty, dtype=hidden.dtype, device=hidden.device)
        for b, (s, e) in enumerate(spans)
    ]
    return torch.stack(rows, dim=1)


def _tracks_grad(hidden: Tensor) -> bool:
    return hidden.requires_grad and torch.is_grad_enabled()


def masked_mean(hidden: Tensor, mask: Tensor) -> Tensor:
    """Mean over real tokens: ``[L, B, T, D]``, ``[B, T]`` -> ``[L, B, D]``.

    Without gradients it reads each row's real span (no temporary); with them it masks the
    whole tensor, since the backward pass of per-row slices writes a full-size gradient per
    row (quadratic in the batch: most of an MHA training step's time before this)."""
    spans = None if _tracks_grad(hidden) else real_spans(mask)
    if spans is not None:
        return per_span(hidden, spans, lambda x: x.mean(dim=1), empty=0.0)
    keep = mask[None, :, :, None]  # [1, B, T, 1]
    total = hidden.masked_fill(~keep, 0.0).sum(dim=2)  # [L, B, D]
    count = mask.sum(dim=1).clamp(min=1).to(hidden.dtype)  # [B]
    return total / count[None, :, None]


def real_token_index(mask: Tensor, which: str) -> Tensor:
    """Position of the first or last real token of each row: ``[B, T]`` -> ``[B]``."""
    T = mask.shape[1]
    if which == "first":
        return mask.to(torch.int8).argmax(dim=1)  # argmax returns the first maximum
    return (T - 1) - mask.flip(1).to(torch.int8).argmax(dim=1)


def _take(hidden: Tensor, index: Tensor) -> Tensor:
    """``hidden[:, b, index[b], :]`` for every b: ``[L, B, T, D]``, ``[B]`` -> ``[L, B, D]``."""
    L, B, _, D = hidden.shape
    idx = index.view(1, B, 1, 1).expand(L, B, 1, D)
    return hidden.gather(2, idx).squeeze(2)


def masked_max(hidden: Tensor, mask: Tensor) -> Tensor:
    """Per-dimension maximum over real tokens: ``[L, B, T, D]``, ``[B, T]`` -> ``[L, B, D]``."""
    spans = real_spans(mask)
    if spans is not None:
        return per_span(hidden, spans, lambda x: x.amax(dim=1), empty=float("-inf"))
    return hidden.masked_fill(~mask[None, :, :, None], float("-inf")).amax(dim=2)


def first_token(hidden: Tensor, mask: Tensor) -> Tensor:
    """The first real token of each row: ``[L, B, T, D]``, ``[B, T]`` -> ``[L, B, D]``."""
    return _take(hidden, real_token_index(mask, "first"))


def last_token(hidden: Tensor, mask: Tensor) -> Tensor:
    """The last real token of each row: ``[L, B, T, D]``, ``[B, T]`` -> ``[L, B, D]``."""
    return _take(hidden, real_token_index(mask, "last"))


# The separable poolings by name: what a cache can store as per-layer summaries.
SUMMARIES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mean": masked_mean,
    "max": masked_max,
    "first": first_token,
    "last": last_token,
}


class _Pool(TokenPoolModule):
    """A separable pooling: summarize the raw states, then normalize the summary."""

    separable: ClassVar[bool] = True
    kind: ClassVar[str]

    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()

    def forward(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        # [L, B, T, D], [B, T], [L, D], [L, D]. Equal to pooling normalized states,
        # because the normalization is affine per dimension (and scale > 0 for max).
        return (SUMMARIES[self.kind](hidden, mask) - shift[:, None]) / scale[:, None]  # [L, B, D]

    @torch.no_grad()
    def token_weights(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        # [L, B, T]; shift and scale do not move any of these weights.
        L, _, T, _ = hidden.shape
        if self.kind == "mean":
            return (mask / mask.sum(dim=1, keepdim=True)).to(hidden.dtype).expand(L, -1, -1)
        if self.kind in ("first", "last"):
            index = real_token_index(mask, self.kind)  # [B]
            one_hot = torch.nn.functional.one_hot(index, T).to(hidden.dtype)  # [B, T]
            return one_hot.expand(L, -1, -1)
        # max: the share of dimensions in which each token holds the maximum.
        winners = hidden.masked_fill(~mask[None, :, :, None], float("-inf")).argmax(dim=2)
        counts = torch.zeros(hidden.shape[:3], dtype=hidden.dtype, device=hidden.device)
        ones = torch.ones(winners.shape, dtype=hidden.dtype, device=hidden.device)
        return counts.scatter_add_(2, winners, ones) / hidden.shape[-1]  # [L, B, T]


@register_token_pool("mean")
class MeanPool(_Pool):
    """Average of the real tokens of each layer."""

    kind = "mean"
    token_weights_kind = "uniform"


@register_token_pool("max")
class MaxPool(_Pool):
    """Per-dimension maximum over the real tokens of each layer."""

    kind = "max"
    token_weights_kind = "max_share"


@register_token_pool("first")
class FirstPool(_Pool):
    """The first real token (a BOS or chat-template token, when the tokenizer adds one)."""

    kind = "first"
    token_weights_kind = "single"


@register_token_pool("last")
class LastPool(_Pool):
    """The last real token: in a causal LM the only one that has seen the whole text."""

    kind = "last"
    token_weights_kind = "single"
