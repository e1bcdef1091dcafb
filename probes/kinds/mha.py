"""Downcast multi-head attention pooling, one attention block per layer.

Per layer: (optional) LayerNorm, project tokens ``D -> d_inner`` for Q, K and V,
split into ``num_heads`` heads, scaled-dot-product self-attention over the real
tokens, masked mean over tokens, project back ``d_inner -> D``. The projected
summary is added to the plain masked mean (a residual), so an untrained block
starts close to mean pooling and learns which token interactions matter.

Parameters per layer: ``4·D·d_inner + 3·d_inner + D`` (+ ``2·D`` with LayerNorm).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from probes.kinds.base import TokenPoolModule, register_token_pool
from probes.kinds.pooling import masked_mean
from schemas import ProbeSpec

__all__ = ["DowncastMHA"]


@register_token_pool("mha")
class DowncastMHA(TokenPoolModule):
    """Attention over tokens in a small inner dimension, pooled and projected back."""

    separable: ClassVar[bool] = False
    token_weights_kind: ClassVar[str] = "attention"

    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()
        L, D, d = len(spec.layers), spec.hidden_size, spec.d_inner
        self.num_heads = spec.num_heads
        self.dropout = spec.dropout
        # Recompute attention in the backward pass instead of storing it (set by the trainer).
        self.gradient_checkpointing = False
        self.layer_norm = spec.layer_norm
        if spec.layer_norm:
            self.norm_weight = nn.Parameter(torch.ones(L, D))  # [L, D]
            self.norm_bias = nn.Parameter(torch.zeros(L, D))  # [L, D]
        self.qkv = nn.Parameter(torch.randn(L, D, 3 * d) / math.sqrt(D))  # [L, D, 3d]
        self.qkv_bias = nn.Parameter(torch.zeros(L, 3 * d))  # [L, 3d]
        # Small output projection: the block starts as a gentle correction to the mean.
        self.out = nn.Parameter(0.1 * torch.randn(L, d, D) / math.sqrt(d))  # [L, d, D]
        self.out_bias = nn.Parameter(torch.zeros(L, D))  # [L, D]

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V split into heads: ``[L, B, T, D]`` (normalized, see :meth:`prepare`)
        -> 3 x ``[L*B, H, T, d/H]``."""
        L, B, T, _ = x.shape
        weight: Tensor = self.qkv  # [L, D, 3d]
        bias: Tensor = self.qkv_bias  # [L, 3d]
        if self.layer_norm:
            # (x̂ ⊙ g + b) W == x̂ (g ⊙ W) + b W: the per-layer affine folds into the projection.
            weight = self.norm_weight[:, :, None] * self.qkv
            bias = self.qkv_bias + torch.einsum("ld,lde->le", self.norm_bias, self.qkv)
        # States prepared in bfloat16 (probes.offline.fit) project in it; the float32 bias
        # brings the product back to float32 for the attention.
        qkv = torch.einsum("lbtd,lde->lbte", x, weight.to(x.dtype)) + bias[:, None, None]
        q, k, v = qkv.chunk(3, dim=-1)  # 3 x [L, B, T, d]
        d, H = q.shape[-1], self.num_heads

        def heads(t: Tensor) -> Tensor:  # [L, B, T, d] -> [L*B, H, T, d/H]
            return t.reshape(L * B, T, H, d // H).transpose(1, 2)

        return heads(q), heads(k), heads(v)

    def _attend(self, x: Tensor, mask: Tensor) -> Tensor:
        L, B, T, _ = x.shape
        q, k, v = self._heads(x)  # [L*B, H, T, d/H] each
        keys = mask.repeat(L, 1)[:, None, None, :]  # [L*B, 1, 1, T], True = attend
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keys, dropout_p=self.dropout if self.training else 0.0
        )  # [L*B, H, T, d/H]
        o = o.transpose(1, 2).reshape(L, B, T, -1)  # [L, B, T, d]
        pooled = masked_mean(o, mask)  # [L, B, d]
        return torch.einsum("lbe,led->lbd", pooled, self.out) + self.out_bias[:, None]

    def _normalize(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        inv = 1.0 / scale  # [L, D]
        x = torch.addcmul((-shift * inv)[:, None, None], hidden, inv[:, None, None])  # one pass
        return x.masked_fill(~mask[None, :, :, None], 0.0)  # padding may hold NaN

    @torch.no_grad()
    def token_weights(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """How much each token feeds the attention summary: ``[L, B, T]``, summing to 1 over
        each row's real tokens (0 at padding).

        The pooled output is the mean over real queries of attention-weighted values, so a
        key token's weight is its attention averaged over the heads and the real queries.
        (The summary also adds the plain mean of all tokens, its residual, which this leaves
        out.)
        """
        L, B, T, _ = hidden.shape
        x, _ = self.prepare(hidden, mask, shift, scale)
        q, k, _ = self._heads(x)  # [L*B, H, T, e]
        keys = mask.repeat(L, 1)[:, None, None, :]  # [L*B, 1, 1, T]
        logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [L*B, H, T, T]
        attn = logits.masked_fill(~keys, float("-inf")).softmax(dim=-1).mean(dim=1)  # [L*B,T,T]
        queries = mask.repeat(L, 1).to(attn.dtype)  # [L*B, T], 1 on real queries
        per_key = torch.einsum("nq,nqt->nt", queries, attn) / queries.sum(1, keepdim=True)
        return per_key.reshape(L, B, T)

    def prepare(
        self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(x, residual)``: the standardized states with padding zeroed and, with
        ``layer_norm``, normalized over ``D`` (the LayerNorm's affine lives in the
        projection) ``[L, B, T, D]``, and the plain masked mean of the standardized states
        ``[L, B, D]``. Neither has a parameter, so a fit computes them once per batch."""
        x = self._normalize(hidden, mask, shift, scale)
        residual = masked_mean(x, mask)  # [L, B, D]
        if self.layer_norm:
            x = F.layer_norm(x, (x.shape[-1],))
        return x, residual

    def forward_prepared(self, parts: tuple[Tensor, ...], mask: Tensor) -> Tensor:
        x, residual = parts
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            delta = checkpoint(self._attend, x, mask, use_reentrant=False)
        else:
            delta = self._attend(x, mask)
        return residual + delta  # [L, B, D]

    def forward(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        # [L, B, T, D], [B, T], [L, D], [L, D]
        return self.forward_prepared(self.prepare(hidden, mask, shift, scale), mask)
