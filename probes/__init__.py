"""Probe modules and their checkpoint format. Depends on torch, safetensors and schemas only.

Public surface::

    build_probe(spec, seed=None) -> Probe          # spec -> module; probe.spec -> spec
    Probe.forward / predict_proba_many / layers / layer_weights / layer_entropy / num_parameters
    decide(spec, probs) -> Decision                 # thresholds -> predicted labels, flag
    checkpoint_to_bytes / probe_from_bytes          # the two blobs the registry stores
    save_checkpoint / load_checkpoint               # the same on disk
    Learner                                         # learn_many / predict_proba_many (Lion)
    encode_target(s)(spec, label names)             # label names -> targets (fit and online)
    spread_layers(num_layers, n)                    # the default layer choice
"""

from probes.checkpoint import (
    checkpoint_to_bytes,
    load_checkpoint,
    probe_from_bytes,
    save_checkpoint,
)
from probes.decision import Decision, decide
from probes.errors import CacheError, CheckpointError, IncompatibleCheckpoint, ProbeError
from probes.kinds import LAYER_MIXES, TOKEN_POOLS, probe_kinds
from probes.kinds.layer_mix import spread_layers
from probes.learner import Learner
from probes.probe import Probe, build_probe, weight_entropy
from probes.targets import encode_target, encode_targets

__all__ = [
    "LAYER_MIXES",
    "TOKEN_POOLS",
    "CacheError",
    "CheckpointError",
    "Decision",
    "IncompatibleCheckpoint",
    "Learner",
    "Probe",
    "ProbeError",
    "build_probe",
    "checkpoint_to_bytes",
    "decide",
    "encode_target",
    "encode_targets",
    "load_checkpoint",
    "probe_from_bytes",
    "probe_kinds",
    "save_checkpoint",
    "spread_layers",
    "weight_entropy",
]
