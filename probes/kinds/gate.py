"""Scoring gate: a learned softmax over tokens, one gate per layer.

For layer ``l`` and token ``t``: ``a_t = softmax_t(tanh(w_l · h_t + b_l))`` with
padding at ``-inf``, and the summary is ``Σ_t a_t h_t``. ``tanh`` bounds each
score to [-1, 1], so the gate re-weights tokens (up to e² ≈ 7.4× between two
tokens) rather than picking a single one — robust with few labels. ``D + 1``
parameters per layer.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from probes.kinds.base import TokenPoolModule, register_token_pool
from probes.kinds.pooling import per_span, real_spans
from schemas import ProbeSpec

__all__ = ["ScoringGate"]


@register_token_pool("gate")
class ScoringGate(TokenPoolModule):
    """Per-layer attention pooling with a bounded (tanh) score."""

    separable: ClassVar[bool] = False
    token_weights_kind: ClassVar[str] = "gate"

    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()
        L, D = len(spec.layers), spec.hidden_size
        # Scores start near 0 (close to mean pooling) but not at 0, so w gets a gradient.
        self.weight = nn.Parameter(torch.randn(L, D) / math.sqrt(D))  # [L, D]
        self.bias = nn.Parameter(torch.zeros(L))  # [L]

    def _on_raw_states(self, shift: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        """Gate weight ``[L, D]`` and bias ``[L]`` for raw states:
        w · (h - shift) / scale == (w / scale) · h - (w / scale) · shift, one pass over h."""
        w = self.weight / scale
        return w, self.bias - (w * shift).sum(dim=-1)

    def scores(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """Token weights ``[L, B, T]`` (each row sums to 1 over real tokens) for raw states."""
        w, b = self._on_raw_states(shift, scale)
        raw = torch.einsum("lbtd,ld->lbt", hidden, w) + b[:, None, None]
        raw = torch.tanh(raw).masked_fill(~mask[None], float("-inf"))  # [L, B, T]
        return torch.softmax(raw, dim=-1)

    @torch.no_grad()
    def token_weights(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """The gate's softmax over tokens, ``[L, B, T]`` (0 at padding)."""
        hidden = hidden.masked_fill(~mask[None, :, :, None], 0.0)
        return self.scores(hidden, mask, shift, scale)

    def forward(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        # [L, B, T, D], [B, T], [L, D], [L, D]
        spans = real_spans(mask)
        if spans is not None:
            pooled = self._pool_spans(hidden, spans, shift, scale)
        else:
            hidden = hidden.masked_fill(~mask[None, :, :, None], 0.0)  # padding may hold NaN
            a = self.scores(hidden, mask, shift, scale)  # [L, B, T]
            pooled = torch.einsum("lbt,lbtd->lbd", a, hidden)  # [L, B, D], raw states
        # The weights sum to 1, so normalizing the weighted sum equals summing normalized states.
        return (pooled - shift[:, None]) / scale[:, None]

    def _pool_spans(
        self, hidden: Tensor, spans: list[tuple[int, int]], shift: Tensor, scale: Tensor
    ) -> Tensor:
        """The same pooling row by row over each row's real tokens: no padded copy of
        ``hidden`` (~4-6x faster than masking on CPU), padding never read."""
        w, b = self._on_raw_states(shift, scale)

        def attend(x: Tensor) -> Tensor:  # [L, n, D] -> [L, D]
            a = torch.softmax(torch.tanh(torch.bmm(x, w[:, :, None]).squeeze(-1) + b[:, None]), -1)
            return torch.bmm(a[:, None, :], x).squeeze(1)

        return per_span(hidden, spans, attend, empty=0.0)  # no real token: nothing to weigh
