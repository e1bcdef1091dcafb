"""Heads that no label has reached keep their scores while the others learn.

A multi-head probe's heads share its pooling and layer mix, so labels for one head move
every other head's scores (fine-tuning the packaged default on ToxicChat's toxicity labels
alone, its other heads went from flagging 79 % of held-out unsafe prompts to 50 %:
docs/default-probe.md, "With the deployment's labels"). :class:`Anchor` keeps a frozen
copy of the probe as the tenure started and, on every labeled text, gives each head that
no label of this tenure has reached the copy's own probabilities as its target
("learning without forgetting") and keeps its own weights: the shared part learns what
the labeled heads need while those heads go on scoring the deployment's texts as they
did. A head is released the first time a label reaches it, and from then on learns from
its labels alone.

::

    anchor = Anchor(probe)                              # at the start of the tenure
    targets, held = anchor.fill(hidden, mask, targets)  # before each batch is learned
    lion.held_rows = held                               # their own rows stay as they are
    replay.release(anchor.release(targets))             # heads reached: opinions forgotten
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import Tensor

from probes.probe import Probe, keep_layers

__all__ = ["Anchor"]

log = logging.getLogger(__name__)


class Anchor:
    """A frozen copy of a multi-head probe and the heads this tenure's labels have reached."""

    def __init__(self, probe: Probe) -> None:
        spec = probe.spec
        if spec.task != "multilabel" or not spec.heads:
            raise ValueError("only a multi-head probe has heads to hold")
        self.probe = copy.deepcopy(probe).eval()
        for p in self.probe.parameters():
            p.requires_grad_(False)
        self.columns = {h.name: (h.task, spec.head_columns(h.name)) for h in spec.head_specs}
        self.labeled: frozenset[str] = frozenset()  # heads a label of this tenure reached

    def keep_first_layers(self, keep: int) -> None:
        """Read only the first ``keep`` layers, as the learning probe does after it dropped
        its deepest ones (their mix weight was negligible, so the scores barely move)."""
        self.probe = keep_layers(self.probe, list(self.probe.layers[:keep]))

    def reached(self, targets: Tensor) -> frozenset[str]:
        """The heads some row of ``targets [B, C]`` annotates, with those reached before."""
        known = ~targets.isnan()
        hit = {name for name, (_, cols) in self.columns.items() if known[:, cols].any()}
        return self.labeled | hit

    def release(self, targets: Tensor) -> list[int]:
        """Record the heads ``targets`` (a batch learned) reaches; the label columns of
        those reached for the first time, whose held opinions must go."""
        reached = self.reached(targets)
        new = reached - self.labeled
        self.labeled = reached
        if new:
            log.info("heads %s reached by a label: they learn from labels now", sorted(new))
        return sorted(c for name in new for c in _indices(self.columns[name][1]))

    def fill(self, hidden: Tensor, mask: Tensor, targets: Tensor) -> tuple[Tensor, list[int]]:
        """``targets [B, C]`` with every cell of a head that neither this batch nor an
        earlier one annotates set to the frozen probe's probability for ``hidden`` (a
        sigmoid per label, a softmax over a multiclass head's labels, over raw logits: the
        scale the loss reads), and those heads' label columns, whose own weights must not
        move (:attr:`probes.learner.Learner.held_rows`). The labels' cells stay as they are."""
        held = [name for name in self.columns if name not in self.reached(targets)]
        if not held:
            return targets, []
        with torch.no_grad():
            logits = self.probe.predict_logits_many(hidden, mask)  # [B, C], uncalibrated
        filled = targets.clone()
        columns: list[int] = []
        for name in held:
            task, cols = self.columns[name]
            own = logits[:, cols]
            filled[:, cols] = own.softmax(dim=1) if task == "multiclass" else own.sigmoid()
            columns += _indices(cols)
        return filled, sorted(columns)


def _indices(cols: slice) -> list[int]:
    return list(range(cols.start, cols.stop))
