"""river-style online learning over a probe: ``learn_many`` / ``predict_proba_many`` with Lion.

The updater (streaming) and ``fit`` (offline) both drive a :class:`Learner`:

::

    learner = Learner(probe, lr=3e-4, weight_decay=0.1)
    learner.learn_many(hidden, mask, targets)     # one Lion step, returns the loss
    learner.predict_proba_many(hidden, mask)      # [B, C]

Targets are class indices ``[B]`` (int64) for multiclass probes and 0/1
matrices ``[B, C]`` for multilabel probes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lion_pytorch import Lion
from torch import Tensor

from probes.errors import ProbeError
from probes.probe import Probe

__all__ = ["Learner"]


class Learner:
    """A probe, its Lion optimizer and its (optionally class-weighted) loss."""

    def __init__(
        self,
        probe: Probe,
        *,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        class_weights: Tensor | None = None,
        layer_lr_scale: float = 30.0,
    ) -> None:
        C = len(probe.spec.labels)
        if class_weights is not None and tuple(class_weights.shape) != (C,):
            raise ProbeError(
                f"class_weights has shape {tuple(class_weights.shape)}, expected ({C},)"
            )
        if lr <= 0:
            raise ProbeError(f"learning rate must be positive, got {lr}")
        self.probe = probe
        # Multiclass: per-class weights in the cross-entropy. Multilabel: pos_weight per label.
        self.class_weights = None if class_weights is None else class_weights.float()
        # Layer-mix logits are a handful of scalars that must move by whole units; with
        # Lion's fixed step size they need a larger rate than the weight matrices, and no decay.
        fast_ids = {id(p) for p in probe.mix.layer_weight_parameters()}
        trainable = [p for p in probe.parameters() if p.requires_grad]
        slow = [p for p in trainable if id(p) not in fast_ids]
        fast = [p for p in trainable if id(p) in fast_ids]
        groups: list[dict[str, Any]] = []
        if slow:
            groups.append({"params": slow})
        if fast:
            groups.append({"params": fast, "lr": lr * layer_lr_scale, "weight_decay": 0.0})
        self.optimizer = Lion(groups, lr=lr, betas=betas, weight_decay=weight_decay)
        self.steps = 0
        self.examples = 0

    def _check_targets(self, targets: Tensor, batch: int) -> Tensor:
        C = len(self.probe.spec.labels)
        if self.probe.spec.task == "multiclass":
            if targets.shape != (batch,) or targets.dtype != torch.int64:
                raise ProbeError(
                    f"multiclass targets must be int64 [{batch}], got "
                    f"{targets.dtype} {tuple(targets.shape)}"
                )
            if targets.numel() and (targets.min() < 0 or targets.max() >= C):
                raise ProbeError(f"class index out of range 0..{C - 1}: {targets.tolist()[:10]}")
            return targets
        if tuple(targets.shape) != (batch, C):
            raise ProbeError(
                f"multilabel targets must be [{batch}, {C}], got {tuple(targets.shape)}"
            )
        return targets.float()

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean (class-weighted) cross-entropy or binary cross-entropy of logits ``[B, C]``."""
        targets = self._check_targets(targets, logits.shape[0])
        if self.probe.spec.task == "multiclass":
            return F.cross_entropy(logits, targets, weight=self.class_weights)
        return F.binary_cross_entropy_with_logits(logits, targets, pos_weight=self.class_weights)

    def learn_many(self, hidden: Tensor, mask: Tensor | None, targets: Tensor) -> float:
        """One Lion step on a mini-batch; returns the loss before the step."""
        self.probe.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.probe(hidden, mask), targets)
        if not torch.isfinite(loss):
            raise ProbeError(f"loss is {float(loss)}; refusing to step (check the inputs)")
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        self.examples += int(targets.shape[0])
        return float(loss.detach())

    def predict_proba_many(self, hidden: Tensor, mask: Tensor | None = None) -> Tensor:
        """Probabilities ``[B, C]``; see :meth:`Probe.predict_proba_many`."""
        return self.probe.predict_proba_many(hidden, mask)
