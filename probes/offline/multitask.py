"""Several labeled sources, one multi-head probe: each source annotates some heads.

A :class:`SourceHeads` says how one source's label names map onto heads::

    SourceHeads("xstest", {"unsafe": {"unsafe": ["unsafe"], "safe": []}})

Every row of that source annotates head ``unsafe``: its positives are the head labels
its own labels map to (``[]``: a negative). The heads a source does not name stay
unknown on its rows (``NaN`` targets, masked out of the loss and the metrics): a tweet
corpus says nothing of self-harm, so it never teaches the self-harm head "no".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from probes.errors import ProbeError
from probes.offline.dataset import ProbeDataset
from schemas import ProbeSpec

__all__ = ["SourceHeads", "as_multitask", "multitask_targets"]


@dataclass(frozen=True)
class SourceHeads:
    """How the rows of source ``name`` annotate heads: head -> source label -> head labels."""

    name: str
    heads: Mapping[str, Mapping[str, Sequence[str]]]

    def check(self, spec: ProbeSpec) -> None:
        for head, mapping in self.heads.items():
            space = spec.head(head).labels
            bad = sorted({x for labels in mapping.values() for x in labels} - set(space))
            if bad:
                raise ProbeError(f"{self.name}: {bad} are not labels of head {head!r} {space}")


def multitask_targets(
    spec: ProbeSpec,
    source: SourceHeads,
    row_labels: Sequence[frozenset[str]],
    *,
    row_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """``[N, C]`` targets over ``spec.labels`` for rows labeled ``row_labels``.

    A multiclass head needs exactly one class per row; a row whose named labels all map
    to ``[]`` there takes the head's one class that does not flag (a negative, as ``[]``
    is for a multilabel head). A row none of whose labels the mapping names leaves that
    head unknown. Errors name a row by its id in ``row_ids`` (else its index).
    """
    source.check(spec)
    out = torch.full((len(row_labels), len(spec.labels)), float("nan"))
    for head, mapping in source.heads.items():
        h, cols = spec.head(head), spec.head_columns(head)
        calm = [x for x in h.labels if x not in spec.flag_labels]
        for i, names in enumerate(row_labels):
            named = [n for n in names if n in mapping]
            if not named:
                continue
            positives = {x for n in named for x in mapping[n]}
            if h.task == "multiclass" and not positives and len(calm) == 1:
                positives = set(calm)
            if h.task == "multiclass" and len(positives) != 1:
                row = f"row {row_ids[i]!r}" if row_ids is not None else f"row {i}"
                raise ProbeError(
                    f"{source.name}: {row} ({sorted(names)}) maps to {sorted(positives)} "
                    f"in multiclass head {head!r}: exactly one class is needed"
                )
            out[i, cols] = torch.tensor([float(x in positives) for x in h.labels])
    return out


def as_multitask(data: ProbeDataset, spec: ProbeSpec, targets: torch.Tensor) -> ProbeDataset:
    """``data``'s hidden states with ``targets`` over ``spec``'s heads (see
    :func:`multitask_targets`), ready for :func:`probes.offline.fit.fit` and
    :meth:`ProbeDataset.concat` with the other sources."""
    if targets.shape != (len(data), len(spec.labels)):
        raise ProbeError(
            f"targets have shape {tuple(targets.shape)}; expected {(len(data), len(spec.labels))}"
        )
    return replace(data, labels=list(spec.labels), task="multilabel", targets=targets)
