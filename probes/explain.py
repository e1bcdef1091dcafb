"""How a probe's verdict forms: per-layer scores and per-token weights.

Every layer mix is a convex combination of what it would pass on for each layer alone
(``LayerMixModule.solo``), and the head is affine, so the mixed logits are the mix-weighted
sum of per-layer logits::

    z = summarize(hidden, mask)                  [L, B, D]   per-layer summaries
    w = mix.weights(z)                           [L, B]      sums to 1 over layers
    logits_l = head(mix.solo(z)_l)               [L, B, C]   "all the weight on layer l"
    head(mix(z)) == Σ_l w_l · logits_l           [B, C]      the probe's own forward

Per-layer *probabilities* do not mix linearly (softmax/sigmoid), but the logits do.

Token weights say which tokens feed each layer's summary (``TokenPoolModule.token_weights``):
the gate's softmax, MHA attention averaged over heads and queries, ``1/n`` for mean pooling,
the share of dimensions a token wins for max pooling, a one-hot for first/last.

>>> from schemas import ProbeSpec
>>> from probes import build_probe
>>> spec = ProbeSpec(name="tox", token_pool="gate", layer_mix="scalar_mix", layers=[1, 2],
...                  hidden_size=8, task="multiclass", labels=["ok", "toxic"])
>>> probe = build_probe(spec, seed=0).eval()
>>> hidden, mask = torch.randn(2, 1, 5, 8), torch.ones(1, 5, dtype=torch.bool)
>>> parts = layer_breakdown(probe, hidden, mask)
>>> parts.logits.shape, parts.weights.shape
(torch.Size([2, 1, 2]), torch.Size([2, 1]))
>>> torch.allclose(parts.recombined(), probe(hidden, mask), atol=1e-5)
True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from probes.probe import Probe

__all__ = [
    "ClassLayerUse",
    "LayerBreakdown",
    "TokenWeights",
    "class_layer_use_batches",
    "layer_breakdown",
    "token_weights",
]


@dataclass(frozen=True)
class LayerBreakdown:
    """Per-layer scores of one batch; layers in ``probe.layers`` order."""

    layers: tuple[int, ...]
    weights: Tensor  # [L, B] the mix's weight on each layer (input-dependent for "gate")
    logits: Tensor  # [L, B, C] the head on each layer's summary alone
    probs: Tensor  # [L, B, C] softmax/sigmoid of those
    mixed_logits: Tensor  # [B, C] the probe's forward: head(mix(summaries))
    mixed_probs: Tensor  # [B, C]

    def recombined(self) -> Tensor:
        """``Σ_l weights_l · logits_l``, ``[B, C]``: equals ``mixed_logits``."""
        return torch.einsum("lb,lbc->bc", self.weights, self.logits)


@torch.no_grad()
def layer_breakdown(probe: Probe, hidden: Tensor, mask: Tensor | None = None) -> LayerBreakdown:
    """Split ``probe``'s verdict on ``hidden`` into per-layer scores (eval mode, no dropout).

    ``hidden``/``mask`` are what ``probe(hidden, mask)`` takes: ``[L, B, T, D]`` + ``[B, T]``,
    or cached summaries ``[L, B, D]`` for separable probes.
    """
    was_training = probe.training
    probe.eval()
    try:
        z = probe.summarize(hidden, mask)  # [L, B, D]
        weights = probe.mix.weights(z)  # [L, B]
        logits = probe.head(probe.mix.solo(z))  # [L, B, C]
        mixed = probe.head(probe.mix(z))  # [B, C]
    finally:
        probe.train(was_training)
    return LayerBreakdown(
        layers=probe.layers,
        weights=weights,
        logits=logits,
        probs=probe.probabilities(logits),
        mixed_logits=mixed,
        mixed_probs=probe.probabilities(mixed),
    )


@dataclass(frozen=True)
class TokenWeights:
    """Which tokens feed each layer's summary (see ``TokenPoolModule.token_weights``)."""

    kind: str  # "uniform" | "max_share" | "single" | "gate" | "attention"
    weights: Tensor  # [L, B, T], each row sums to 1 over its real tokens, 0 at padding

    @property
    def description(self) -> str:
        return _DESCRIPTIONS.get(self.kind, self.kind)


_DESCRIPTIONS = {  # short enough for one 80-column line after "Top tokens: "
    "uniform": "mean pooling, every token weighs the same (1/n)",
    "max_share": "max pooling, share of dimensions in which each token is the max",
    "single": "first/last pooling reads a single token per layer",
    "gate": "tanh scoring gate, softmax weight of each token",
    "attention": "MHA attention, mean over heads and queries (+ plain mean)",
}


@torch.no_grad()
def token_weights(probe: Probe, hidden: Tensor, mask: Tensor) -> TokenWeights:
    """Token weights ``[L, B, T]`` of ``probe``'s pooling for ``[L, B, T, D]`` + ``[B, T]``."""
    probe._check(hidden, mask)
    hidden = hidden.to(probe.shift.dtype)
    was_training = probe.training
    probe.eval()
    try:
        weights = probe.pool.token_weights(hidden, mask, probe.shift, probe.scale)
    finally:
        probe.train(was_training)
    return TokenWeights(kind=probe.pool.token_weights_kind, weights=weights)


@dataclass(frozen=True)
class ClassLayerUse:
    """Which layers lift each class's logit on that class's rows, over a data set.

    ``gap[c, l]`` = mean over rows of class ``c`` of ``w_l · (logits_l[c] - bias[c])`` minus
    its mean over all rows: layer ``l``'s share of how much higher class ``c``'s logit is on
    its own rows than on average. Summed over layers it is that whole logit gap (the
    breakdown is exact: see :class:`LayerBreakdown`).
    """

    layers: tuple[int, ...]
    labels: tuple[str, ...]
    gap: Tensor  # [C, L]
    rows: Tensor  # [C] rows of each class (positives, for multilabel)

    def shares(self) -> Tensor:
        """``gap`` as each class's row normalized by its total absolute gap, ``[C, L]``."""
        return self.gap / self.gap.abs().sum(dim=1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def class_layer_use_batches(
    probe: Probe, batches: Iterable[tuple[Tensor, Tensor | None, Tensor]]
) -> ClassLayerUse:
    """Per-class, per-layer contributions over ``(hidden, mask, targets)`` batches (what
    ``ProbeDataset.batch`` or the updater's replay buffer give; over a whole dataset:
    :func:`probes.offline.layerwise.class_layer_use`)."""
    C, L = len(probe.labels), len(probe.layers)
    bias = probe.head.bias.detach()  # [C]
    total = torch.zeros(C, L, dtype=torch.float64)
    own = torch.zeros(C, L, dtype=torch.float64)
    rows = torch.zeros(C, dtype=torch.int64)
    n = 0
    for hidden, mask, targets in batches:
        if probe.spec.task == "multilabel":
            hot = targets.nan_to_num(0.0).bool()  # [B, C] (NaN: not annotated)
        else:
            hot = torch.nn.functional.one_hot(targets.long(), C).bool()  # [B, C]
        parts = layer_breakdown(probe, hidden, mask)
        contrib = parts.weights[:, :, None] * (parts.logits - bias)  # [L, B, C]
        contrib = contrib.permute(1, 2, 0).double()  # [B, C, L]
        total += contrib.sum(dim=0)
        own += (contrib * hot[:, :, None]).sum(dim=0)
        rows += hot.sum(dim=0)
        n += len(targets)
    gap = own / rows.clamp_min(1)[:, None] - total / max(1, n)
    gap[rows == 0] = float("nan")
    return ClassLayerUse(layers=probe.layers, labels=probe.labels, gap=gap.float(), rows=rows)
