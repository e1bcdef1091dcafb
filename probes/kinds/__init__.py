"""The probe kinds: one short file per token pooling or layer mix, lion-pytorch style.

``base`` holds the two registries and the module bases; importing this package
registers every kind (``pooling``: mean, max, first, last; ``gate``: the tanh
scoring gate; ``mha``: downcast multi-head attention; ``layer_mix``: the learned
mixes over layers). :func:`probes.build_probe` looks a spec's names up here.
"""

from probes.kinds import gate, layer_mix, mha, pooling
from probes.kinds.base import (
    LAYER_MIXES,
    TOKEN_POOLS,
    LayerMixModule,
    TokenPoolModule,
    probe_kinds,
    register_layer_mix,
    register_token_pool,
)

__all__ = [
    "LAYER_MIXES",
    "TOKEN_POOLS",
    "LayerMixModule",
    "TokenPoolModule",
    "gate",
    "layer_mix",
    "mha",
    "pooling",
    "probe_kinds",
    "register_layer_mix",
    "register_token_pool",
]
