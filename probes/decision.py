"""From probabilities to decisions: predicted labels and the flag, using the spec's thresholds.

- multilabel: label ``l`` is predicted when ``p_l >= thresholds.get(l, 0.5)``.
- multiclass: a flag label with a threshold is predicted when ``p_l`` reaches it
  (the most probable such label wins); otherwise the arg-max over the labels
  that have no threshold. With no thresholds this is the plain arg-max.
- flagged: any flag label is predicted.
- several heads: each head decides on its own columns by the rule of its task (a
  multiclass head's predicted class is one hot among its columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from schemas import ProbeSpec

__all__ = ["Decision", "decide", "flagging_heads"]


@dataclass(frozen=True)
class Decision:
    """Decisions for a batch: ``predicted`` is ``[B]`` class indices (multiclass) or a
    ``[B, C]`` bool matrix (multilabel); ``flagged`` is ``[B]`` bool."""

    predicted: Tensor
    flagged: Tensor

    def head_flags(self, spec: ProbeSpec) -> dict[str, Tensor]:
        """Per head, ``[B]`` bool: one of its flag labels is predicted."""
        hot = self.predicted
        if hot.dim() == 1:
            hot = torch.nn.functional.one_hot(hot, len(spec.labels)).bool()
        flag = torch.tensor([label in spec.flag_labels for label in spec.labels])  # [C]
        flags: dict[str, Tensor] = {}
        start = 0
        for h in spec.head_specs:  # heads own consecutive columns (ProbeSpec.head_columns)
            cols = slice(start, start + len(h.labels))
            flags[h.name] = (hot[:, cols] & flag[cols]).any(1)
            start = cols.stop
        return flags

    def label_names(self, spec: ProbeSpec) -> list[list[str]]:
        """Predicted label names per row."""
        if self.predicted.dim() == 1:
            return [[spec.labels[i]] for i in self.predicted.tolist()]
        labels = spec.labels
        return [[labels[j] for j, hot in enumerate(row) if hot] for row in self.predicted.tolist()]


def flagging_heads(spec: ProbeSpec, heads: frozenset[str] | None) -> ProbeSpec:
    """``spec`` whose flag labels are only those of ``heads`` (a deployment's per-head flag
    policy: which heads may flag a message); ``None``: unchanged. Names that are not heads
    of ``spec`` are ignored, so one policy can serve probes with different heads."""
    if heads is None or not spec.heads:
        return spec
    keep = [x for x in spec.flag_labels if spec.head_of(x).name in heads]
    return spec if keep == spec.flag_labels else spec.model_copy(update={"flag_labels": keep})


def _thresholds(spec: ProbeSpec, default: float) -> Tensor:
    return torch.tensor([spec.thresholds.get(label, default) for label in spec.labels])  # [C]


def decide(spec: ProbeSpec, probs: Tensor) -> Decision:
    """Apply ``spec``'s thresholds to probabilities ``[B, C]``."""
    flag = torch.tensor([label in spec.flag_labels for label in spec.labels])  # [C]
    if spec.task == "multilabel":
        predicted = probs >= _thresholds(spec, 0.5)[None]  # [B, C]
        for h in spec.heads:
            if h.task == "multiclass":
                cols = spec.head_columns(h.name)
                one = decide(spec.head_view(h.name), probs[:, cols]).predicted  # [B]
                predicted[:, cols] = torch.nn.functional.one_hot(one, len(h.labels)).bool()
        return Decision(predicted, (predicted & flag[None]).any(dim=1))
    has_t = torch.tensor([label in spec.thresholds for label in spec.labels])  # [C]
    passing = has_t[None] & (probs >= _thresholds(spec, 2.0)[None])  # [B, C]
    free = probs.masked_fill(has_t[None], float("-inf")) if not has_t.all() else probs
    best_free = free.argmax(dim=1)  # [B]
    best_passing = probs.masked_fill(~passing, float("-inf")).argmax(dim=1)  # [B]
    predicted = torch.where(passing.any(dim=1), best_passing, best_free)  # [B]
    return Decision(predicted, flag[predicted])
