"""The cascade's exit head: decide easy messages at a shallow layer.

::

    states [B, T, D] at spec.exit.layer + mask [B, T]
        -> exit head (a probe over that one layer)   [B, C] logits
        -> softmax / sigmoid(logits / T + bias)       [B, C] calibrated probabilities
        -> exits:  max flag-label probability < allow_below   (decided: allowed)
                   max flag-label probability >= flag_above   (decided: flagged)

The exit head lives inside the probe (``Probe.exit_head``; its tensors are ``exit_head.*``
of the probe's state dict), so a checkpoint carries it and the updater's Lion steps keep
it current on the same labels (see :class:`probes.learner.Learner`). ``fit`` chooses its
layer, calibration and thresholds by cross-validation (:mod:`probes.offline.exit`).

>>> spec = ProbeSpec(name="tox", token_pool="mean", layer_mix="scalar_mix", layers=[1, 2],
...     hidden_size=8, task="multiclass", labels=["ok", "toxic"], flag_labels=["toxic"],
...     exit=ExitSpec(layer=1, allow_below=0.3))
>>> probe = build_probe(spec, seed=0)
>>> probs = exit_probabilities(probe, torch.randn(3, 5, 8), torch.ones(3, 5, dtype=torch.bool))
>>> probs.shape, exits(spec, probs).shape
(torch.Size([3, 2]), torch.Size([3]))
"""

from __future__ import annotations

import torch
from torch import Tensor

from probes.calibration import calibrated, fit_calibration
from probes.errors import ProbeError
from probes.probe import Probe, build_probe
from schemas import ExitSpec, ProbeSpec

__all__ = [
    "attach_exit",
    "calibrated",
    "exit_probabilities",
    "exits",
    "fit_calibration",
    "flag_risk",
]


@torch.no_grad()
def exit_probabilities(probe: Probe, states: Tensor, mask: Tensor | None = None) -> Tensor:
    """Calibrated probabilities ``[B, C]`` of ``probe``'s exit head for the exit layer's
    states ``[B, T, D]`` + ``mask [B, T]`` (or pooled summaries ``[B, D]``, no mask)."""
    head, spec = probe.exit_head, probe.spec.exit
    if head is None or spec is None:
        raise ProbeError(f"probe {probe.spec.name!r} has no exit head")
    was_training = head.training
    head.eval()
    try:
        return calibrated(probe.spec, head(states[None], mask), spec.temperature, spec.bias)
    finally:
        head.train(was_training)


def flag_risk(spec: ProbeSpec, probs: Tensor) -> Tensor:
    """``[B]``: the highest probability among the flag labels (0 without flag labels)."""
    cols = [spec.labels.index(label) for label in spec.flag_labels]
    if not cols:
        return probs.new_zeros(probs.shape[0])
    return probs[:, cols].max(dim=1).values


def exits(
    spec: ProbeSpec,
    probs: Tensor,
    allow_below: float | None = None,
    flag_above: float | None = None,
    *,
    use_flag_above: bool = False,
) -> Tensor:
    """``[B]`` bool: rows the exit head decides, by the spec's thresholds unless given
    (``allow_below``; ``flag_above`` when ``use_flag_above``, else the spec's)."""
    if spec.exit is None:
        return torch.zeros(probs.shape[0], dtype=torch.bool)
    low = spec.exit.allow_below if allow_below is None else allow_below
    high = flag_above if use_flag_above else spec.exit.flag_above
    risk = flag_risk(spec, probs)
    out = risk < low
    if high is not None:
        out |= risk >= high
    return out


def attach_exit(probe: Probe, exit_probe: Probe, exit_spec: ExitSpec) -> Probe:
    """A copy of ``probe`` with ``exit_probe`` (a probe over ``probe``'s labels and the
    single layer ``exit_spec.layer``) as its exit head, decided by ``exit_spec``."""
    spec = ProbeSpec.model_validate({**probe.spec.model_dump(), "exit": exit_spec.model_dump()})
    view = spec.exit_view()
    if (exit_probe.spec.layers, exit_probe.spec.labels) != (view.layers, view.labels):
        raise ProbeError(
            f"the exit probe reads {exit_probe.spec.layers} for {exit_probe.spec.labels}; "
            f"the exit needs {view.layers} for {view.labels}"
        )
    out = build_probe(spec)
    state = {k: v for k, v in probe.state_dict().items() if not k.startswith("exit_head.")}
    state.update({f"exit_head.{k}": v for k, v in exit_probe.state_dict().items()})
    out.load_state_dict(state)
    out.to(probe.shift.device)
    out.train(probe.training)
    return out
