"""Gradient checkpointing changes what is kept for backward, never the gradients: every
probe kind, with and without the flag, on the same batch (dropout included: the recompute
replays the forward's random state)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from probes import build_probe, probe_kinds
from probes.probe import Probe
from tests.unit.synthetic import make_spec, random_batch

KINDS = probe_kinds()


def _grads(probe: Probe, hidden: torch.Tensor, mask: torch.Tensor, checkpointing: bool):
    """Gradients of one cross-entropy step, and the bytes autograd saved for backward."""
    probe.pool.gradient_checkpointing = checkpointing
    probe.train().zero_grad(set_to_none=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)  # the same dropout masks in both runs
    y = torch.arange(hidden.shape[1]) % len(probe.labels)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(probe(hidden, mask), y)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in probe.named_parameters() if p.grad is not None}
    return grads, sum(saved.values())


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize(("pool", "mix"), KINDS)
def test_gradients_are_equal_with_and_without_checkpointing(
    pool: str, mix: str, dropout: float
) -> None:
    probe = build_probe(make_spec(pool, mix, dropout=dropout), seed=0)
    hidden, mask = random_batch(len(probe.layers), batch=5, tokens=9, seed=2)
    plain, plain_bytes = _grads(probe, hidden, mask, checkpointing=False)
    ckpt, ckpt_bytes = _grads(probe, hidden, mask, checkpointing=True)
    assert plain.keys() == ckpt.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(ckpt[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    if pool == "mha":  # the kind that supports it keeps less for backward
        assert ckpt_bytes < plain_bytes
    else:  # the others ignore the flag
        assert ckpt_bytes == plain_bytes
