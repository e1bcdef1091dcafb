"""Layer aggregation: ``[L, B, D]`` per-layer summaries -> ``[B, D]``.

- ``single``: the one layer the spec names (the classic probe baseline).
- ``scalar_mix``: ELMo's ``γ · Σ_l softmax(s)_l · z_l``; one weight per layer,
  the same for every input.
- ``gate``: a learned gate over layers, ``softmax_l(u · z_l + c_l)``, computed per
  input, so the probe can lean on different layers for different messages.

Every mix reports the layer weights it used (``[L, B]``) for monitoring.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from probes.kinds.base import LayerMixModule, register_layer_mix
from schemas import ProbeSpec

__all__ = ["LayerGate", "ScalarMix", "SingleLayer", "spread_layers"]


def spread_layers(num_layers: int, n: int = 6) -> list[int]:
    """``n`` layers spread evenly over a model of ``num_layers`` (index 0, the embeddings,
    excluded; the last layer included): e.g. 30 layers -> ``[5, 10, 15, 20, 25, 30]``."""
    return sorted({max(1, round(num_layers * k / n)) for k in range(1, n + 1)})


@register_layer_mix("single")
class SingleLayer(LayerMixModule):
    """Reads exactly one layer; its weight is always 1."""

    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()

    def weights(self, pooled: Tensor) -> Tensor:  # [1, B, D] -> [1, B]
        return pooled.new_ones(pooled.shape[:2])

    def forward(self, pooled: Tensor) -> Tensor:  # [1, B, D]
        return pooled[0]  # [B, D]


@register_layer_mix("scalar_mix")
class ScalarMix(LayerMixModule):
    """ELMo scalar mix: softmax-normalized layer weights times a learned scale γ."""

    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(len(spec.layers)))  # [L], uniform at start
        self.gamma = nn.Parameter(torch.ones(()))

    def layer_weight_parameters(self) -> list[nn.Parameter]:
        return [self.logits, self.gamma]

    def weights(self, pooled: Tensor) -> Tensor:  # [L, B, D] -> [L, B]
        return torch.softmax(self.logits, dim=0)[:, None].expand(pooled.shape[:2])

    def solo(self, pooled: Tensor) -> Tensor:  # [L, B, D] -> [L, B, D]
        return self.gamma * pooled

    def forward(self, pooled: Tensor) -> Tensor:  # [L, B, D]
        w = torch.softmax(self.logits, dim=0)  # [L]
        return self.gamma * torch.einsum("l,lbd->bd", w, pooled)  # [B, D]


@register_layer_mix("gate")
class LayerGate(LayerMixModule):
    """A per-input softmax gate over layers: ``softmax_l(u · z_l + c_l)``."""

    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()
        D = spec.hidden_size
        self.query = nn.Parameter(torch.randn(D) / (10 * math.sqrt(D)))  # [D], near-uniform
        self.prior = nn.Parameter(torch.zeros(len(spec.layers)))  # [L]

    def layer_weight_parameters(self) -> list[nn.Parameter]:
        return [self.prior]

    def weights(self, pooled: Tensor) -> Tensor:  # [L, B, D] -> [L, B]
        scores = torch.einsum("lbd,d->lb", pooled, self.query) + self.prior[:, None]
        return torch.softmax(scores, dim=0)

    def forward(self, pooled: Tensor) -> Tensor:  # [L, B, D]
        return torch.einsum("lb,lbd->bd", self.weights(pooled), pooled)  # [B, D]
