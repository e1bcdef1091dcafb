"""river-style online learning over a probe: ``learn_many`` / ``predict_proba_many`` with Lion.

The updater (streaming) and ``fit`` (offline) both drive a :class:`Learner`:

::

    learner = Learner(probe, lr=3e-4, weight_decay=0.1)
    learner.learn_many(hidden, mask, targets)     # one Lion step, returns the loss
    learner.predict_proba_many(hidden, mask)      # [B, C]

Targets are class indices ``[B]`` (int64) for multiclass probes and 0/1
matrices ``[B, C]`` for multilabel probes, where ``NaN`` marks a cell no one annotated
(a multi-head probe's rows label only some heads): it adds nothing to the loss.

``freeze_shared=True`` steps only the linear head (every head's rows; a row no label
annotates gets no gradient): the token pooling and layer mix stay as they are.

Why the layer mix needs a counterweight: Lion moves every parameter by ``lr · sign(m)``,
whatever the gradient's size. A layer whose mix weight is nearly 0 still gets a gradient of
one sign, only a tiny one, so its logit keeps falling at full speed and the mix ends on one
layer (entropy near 0) after enough steps, even when the other layers still carry signal;
an updater taking several steps per small batch of labels gets there within a few hundred
labels. ``mix_entropy`` adds ``λ · (log L - H(w))`` to the loss, where ``w`` is the batch's
mean layer weights. Its gradient on a layer's logit is ``λ · w_l · (log w_l + H)``, which
outgrows the data's ``w_l · (∂loss/∂w_l - mean)`` as ``w_l`` shrinks (``log w_l`` diverges),
so the sign flips before the weight vanishes: a floor that the data can only lower as far as
the evidence for it is strong.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lion_pytorch import Lion
from torch import Tensor

from probes.errors import ProbeError
from probes.heads import remap_label_rows
from probes.probe import Prepared, Probe, multiclass_columns

__all__ = ["Learner"]

log = logging.getLogger(__name__)


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
        mix_entropy: float = 0.0,
        freeze_shared: bool = False,
    ) -> None:
        C = len(probe.spec.labels)
        if class_weights is not None and tuple(class_weights.shape) != (C,):
            raise ProbeError(
                f"class_weights has shape {tuple(class_weights.shape)}, expected ({C},)"
            )
        if lr <= 0:
            raise ProbeError(f"learning rate must be positive, got {lr}")
        if mix_entropy < 0:
            raise ProbeError(f"mix_entropy must be >= 0, got {mix_entropy}")
        self.probe = probe
        # freeze_shared: only the linear head learns; the pooling and layer mix every head
        # shares stay as they are (a new head from few labels cannot move the others' input).
        self.freeze_shared = freeze_shared
        self.mix_entropy = 0.0 if freeze_shared else mix_entropy
        # Multiclass: per-class weights in the cross-entropy. Multilabel: pos_weight per label.
        self.class_weights = None if class_weights is None else class_weights.float()
        # Layer-mix logits are a handful of scalars that must move by whole units; with
        # Lion's fixed step size they need a larger rate than the weight matrices, and no decay.
        fast_ids = {id(p) for p in probe.mix.layer_weight_parameters()}
        params = probe.head.parameters() if freeze_shared else probe.parameters()
        trainable = [p for p in params if p.requires_grad]
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
        # Label columns whose rows of the linear head(s) no step moves (heads held by
        # worker.learning.anchor: they learn nothing of their own, the shared part keeps
        # their scores). Lion's sign steps would otherwise move them at full size on the
        # smallest gradient, decay and momentum included.
        self.held_rows: list[int] = []

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
        total, weight = self._loss_parts(logits, targets)
        return total / weight

    def _loss_parts(
        self, logits: Tensor, targets: Tensor, *, weighted: bool = True
    ) -> tuple[Tensor, Tensor]:
        """``(summed loss, its normalizer)``: the mean loss is their ratio, and a batch cut
        into chunks has the mean ``Σ sums / Σ normalizers`` of the whole batch.
        ``weighted``: with the class weights (if any); the exit head learns without them,
        so its probabilities keep the data's base rate (it decides by their value)."""
        targets = self._check_targets(targets, logits.shape[0])
        class_weights = self.class_weights if weighted else None
        if self.probe.spec.task == "multiclass":
            rows = F.cross_entropy(logits, targets, weight=class_weights, reduction="none")
            if class_weights is None:
                return rows.sum(), logits.new_tensor(float(len(rows)))
            return rows.sum(), class_weights[targets].sum()
        known = ~targets.isnan()  # [B, C]
        # Less the targets' own entropy: zero for a label (0 or 1), and for a soft target
        # (an anchored head's own opinion, worker.learning.anchor) the loss reads as the
        # divergence from it, zero where the head agrees, with the same gradient.
        soft = targets.nan_to_num(0.0)
        cells = F.binary_cross_entropy_with_logits(
            logits, soft, pos_weight=class_weights, reduction="none"
        ) + (torch.special.xlogy(soft, soft) + torch.special.xlogy(1 - soft, 1 - soft))
        for cols in multiclass_columns(self.probe.spec):  # softmax heads: cross-entropy
            known[:, cols] = False
            rows = ~targets[:, cols].isnan().any(dim=1)  # [B] rows annotating this head
            # Class probabilities: one-hot for a label, soft for an anchored head's own
            # opinion (worker.learning.anchor); one-hot gives the class index's loss.
            probs = targets[:, cols].nan_to_num(0.0)  # [B, k]
            ce = F.cross_entropy(logits[:, cols], probs, reduction="none")  # [B]
            ce = ce + torch.special.xlogy(probs, probs).sum(dim=1)  # less its entropy, as above
            cells = torch.cat([cells, ce[:, None]], dim=1)
            known = torch.cat([known, rows[:, None]], dim=1)
        total = (cells * known).sum()
        return total, logits.new_tensor(float(known.sum()))

    def learn_many(self, hidden: Tensor | Prepared, mask: Tensor | None, targets: Tensor) -> float:
        """One Lion step on a mini-batch; returns the loss before the step (the task's
        loss, without the ``mix_entropy`` term)."""
        return self.learn_chunks([(hidden, mask, targets)])

    def learn_chunks(
        self, chunks: Sequence[tuple[Tensor | Prepared, Tensor | None, Tensor]]
    ) -> float:
        """One Lion step on a mini-batch given in pieces ``(hidden, mask, targets)``: the
        same step as on the whole batch, but each piece is padded only to its own longest
        row (a batch of token-level rows sorted by length wastes little on padding). A batch
        none of whose rows annotates a head makes no step (returns 0.0)."""
        if not chunks:
            raise ProbeError("a step needs at least one example")
        self.probe.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums, norms, mix, exit_sums, exit_norms = [], [], [], [], []
        exit_head = None if self.freeze_shared else self.probe.exit_head
        for hidden, mask, targets in chunks:
            logits, weights = self.probe.forward_with_layer_weights(hidden, mask)  # [B, C], [L, B]
            total, norm = self._loss_parts(logits, targets)
            sums.append(total)
            norms.append(norm)
            mix.append(weights)
            if exit_head is not None:  # the cascade's exit head learns the same labels
                if isinstance(hidden, Prepared):  # Probe.prepare declines with an exit head
                    raise ProbeError("a probe with an exit head learns from raw states")
                total, norm = self._loss_parts(
                    exit_head(self.probe.exit_input(hidden), mask), targets, weighted=False
                )
                exit_sums.append(total)
                exit_norms.append(norm)
        norm = torch.stack(norms).sum()
        if norm == 0:  # no row annotates any head: nothing to learn, no step
            return 0.0
        loss = torch.stack(sums).sum() / norm
        if not torch.isfinite(loss):
            raise ProbeError(f"loss is {float(loss)}; refusing to step (check the inputs)")
        weights = torch.cat(mix, dim=1)  # [L, B_total]
        objective = loss
        if self.mix_entropy > 0 and weights.shape[0] > 1:
            objective = loss + self.mix_entropy * self.entropy_gap(weights)
        if exit_sums:  # its own parameters: the sum trains both without coupling them
            exit_loss = torch.stack(exit_sums).sum() / torch.stack(exit_norms).sum()
            if torch.isfinite(exit_loss):
                objective = objective + exit_loss
        objective.backward()
        with self._rows_held():
            self.optimizer.step()
        self.steps += 1
        self.examples += sum(int(t.shape[0]) for _, _, t in chunks)
        return float(loss.detach())

    @contextlib.contextmanager
    def _rows_held(self) -> Iterator[None]:
        """Put :attr:`held_rows` of the linear head(s) back as they were after the step."""
        if not self.held_rows:
            yield
            return
        exit_head = self.probe.exit_head
        heads = [self.probe.head] + ([exit_head.head] if exit_head is not None else [])
        rows = torch.tensor(self.held_rows, dtype=torch.long)
        kept = [(p, p.detach()[rows].clone()) for h in heads for p in (h.weight, h.bias)]
        yield
        with torch.no_grad():
            for p, before in kept:
                p[rows] = before

    @staticmethod
    def entropy_gap(weights: Tensor) -> Tensor:
        """``log L - H(w̄)`` (nats, >= 0) of the mean layer weights ``w̄`` of ``[L, B]``:
        0 for a uniform mix, ``log L`` for one collapsed on a single layer."""
        w = weights.mean(dim=1)  # [L]
        return math.log(w.shape[0]) + (w * w.clamp_min(1e-12).log()).sum()

    def predict_proba_many(self, hidden: Tensor, mask: Tensor | None = None) -> Tensor:
        """Probabilities ``[B, C]``; see :meth:`Probe.predict_proba_many`."""
        return self.probe.predict_proba_many(hidden, mask)

    def momentum(self) -> dict[str, Tensor]:
        """Lion's momentum per parameter name (safetensors-ready, on the CPU)."""
        state = {}
        for name, param in self.probe.named_parameters():
            exp_avg = self.optimizer.state.get(param, {}).get("exp_avg")
            if exp_avg is not None:
                state[name] = exp_avg.detach().cpu().contiguous()
        return state

    def load_momentum(self, state: dict[str, Tensor], labels: Sequence[str] | None = None) -> int:
        """Restore momentum saved by :meth:`momentum`; returns the tensors used (names or
        shapes that no longer match are skipped).

        ``labels``: the label order of the probe the state was saved from, when it may
        differ from this probe's (a head added or removed since): the linear head's rows
        then follow their labels, and a new label's rows start at zero momentum."""
        params = dict(self.probe.named_parameters())
        if labels is not None and list(labels) != list(self.probe.spec.labels):
            try:
                state = remap_label_rows(state, labels, self.probe.spec.labels)
            except ProbeError as exc:
                log.warning("optimizer state does not fit its labels (%s); skipping rows", exc)
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        used = 0
        for name, exp_avg in state.items():
            param = params.get(name)
            # Parameters a frozen learner does not step have no state to restore.
            if param is not None and id(param) in stepped and param.shape == exp_avg.shape:
                self.optimizer.state[param]["exp_avg"] = exp_avg.to(param.device).clone()
                used += 1
        return used
