"""Registries of token poolings and layer mixes, keyed by their ``ProbeSpec`` names.

A module registers itself with a decorator; :func:`probes.build_probe` looks
the spec's ``token_pool`` and ``layer_mix`` up here. The contract test runs
over every registered pair, so a new kind is tested the moment it registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from torch import Tensor, nn

__all__ = [
    "LAYER_MIXES",
    "TOKEN_POOLS",
    "LayerMixModule",
    "Prepared",
    "TokenPoolModule",
    "probe_kinds",
    "register_layer_mix",
    "register_token_pool",
]


@dataclass(frozen=True, eq=False)
class Prepared:
    """A padded token batch after its pooling's parameter-free passes (standardize, mask,
    normalize, ...), made by :meth:`probes.Probe.prepare` under one normalization.

    Training reads the same batches in every epoch and fold, with the normalization fixed
    for the whole fit, so those passes are done once instead of at every step. ``shift``
    and ``scale`` are the normalization they were done under: a probe refuses the batch
    once its own differ.
    """

    parts: tuple[Tensor, ...]  # what the pooling's prepare() returned
    mask: Tensor  # [B, T]
    shift: Tensor  # [L, D]
    scale: Tensor  # [L, D]


class TokenPoolModule(nn.Module):
    """Base of token poolings: ``[L, B, T, D]`` + mask ``[B, T]`` -> ``[L, B, D]``.

    ``forward(hidden, mask, shift, scale)`` returns summaries of the normalized
    states ``(hidden - shift) / scale`` (``shift``, ``scale``: ``[L, D]``). The
    pooling applies the normalization itself, so it can fold it into cheaper
    operations than a pass over every token. Subclasses take the ``ProbeSpec``
    as their only constructor argument.
    """

    # True when the output is a fixed per-layer summary a cache can store.
    separable: ClassVar[bool] = False
    # Recompute activations in the backward pass instead of storing them (if supported).
    gradient_checkpointing: bool = False
    # What token_weights() measures: "uniform", "max_share", "single", "gate", "attention".
    token_weights_kind: ClassVar[str] = "none"

    def forward(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        raise NotImplementedError

    def prepare(
        self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor
    ) -> tuple[Tensor, ...] | None:
        """The parameter-free first passes of :meth:`forward` (arguments as for it), for
        :meth:`forward_prepared` to finish; None (the default) when the pooling has none
        worth keeping."""
        return None

    def forward_prepared(self, parts: tuple[Tensor, ...], mask: Tensor) -> Tensor:
        """:meth:`forward` from what :meth:`prepare` returned: ``[L, B, D]``."""
        raise NotImplementedError

    def token_weights(self, hidden: Tensor, mask: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """How much each token feeds the summary, for explanations: ``[L, B, T]``, each row
        summing to 1 over its real tokens, 0 at padding (arguments as for ``forward``)."""
        raise NotImplementedError


class LayerMixModule(nn.Module):
    """Base of layer mixes: ``[L, B, D]`` -> ``[B, D]``, with the weights used, ``[L, B]``."""

    def layer_weight_parameters(self) -> list[nn.Parameter]:
        """Scalars that set the layer weights directly (mix logits, priors, scale).

        Lion moves every parameter by ``lr`` per step whatever its gradient, so
        these few scalars, which need to travel several units, get a larger
        learning rate than the weight matrices (see ``Learner``).
        """
        return []

    def weights(self, pooled: Tensor) -> Tensor:
        raise NotImplementedError

    def solo(self, pooled: Tensor) -> Tensor:
        """``[L, B, D]`` -> ``[L, B, D]``: what the mix would pass on for each layer if it put
        all of its weight on that layer. Mixes are convex combinations of these:
        ``forward(z) == Σ_l weights(z)[l] * solo(z)[l]``, which is what lets
        :mod:`probes.explain` split a verdict into per-layer scores.
        """
        return pooled

    def forward(self, pooled: Tensor) -> Tensor:
        raise NotImplementedError


TOKEN_POOLS: dict[str, type[TokenPoolModule]] = {}
LAYER_MIXES: dict[str, type[LayerMixModule]] = {}

P = TypeVar("P", bound=type[TokenPoolModule])
M = TypeVar("M", bound=type[LayerMixModule])


def register_token_pool(name: str) -> Callable[[P], P]:
    """Class decorator: make a token pooling available as ``ProbeSpec.token_pool == name``."""

    def deco(cls: P) -> P:
        if name in TOKEN_POOLS:
            raise ValueError(f"token pool {name!r} is already registered")
        TOKEN_POOLS[name] = cls
        return cls

    return deco


def register_layer_mix(name: str) -> Callable[[M], M]:
    """Class decorator: make a layer mix available as ``ProbeSpec.layer_mix == name``."""

    def deco(cls: M) -> M:
        if name in LAYER_MIXES:
            raise ValueError(f"layer mix {name!r} is already registered")
        LAYER_MIXES[name] = cls
        return cls

    return deco


def probe_kinds() -> list[tuple[str, str]]:
    """Every registered ``(token_pool, layer_mix)`` pair, in a stable order."""
    return [(p, m) for p in sorted(TOKEN_POOLS) for m in sorted(LAYER_MIXES)]
