"""Label names to training targets: the one encoding that ``fit``, ``eval`` and the
online updater share.

A multiclass probe's target is a class index (``[]`` int64); a multilabel probe's is a
multi-hot vector (``[C]`` float). Each target also gets a *balance bucket*, the class
the replay buffer balances on: the class index, or for multilabel the first label named
(``C`` when none is).

A multi-head probe's target is the flat ``[C]`` vector with ``NaN`` in the columns of every
head the example does not annotate: unknown, masked out of the loss and the metrics, never
taken as negative. A label naming its ``head`` annotates that head alone (for a
multilabel head, the labels named are its positives and the rest negative: ``[]`` is a
negative). One without a head annotates only the heads it names a label of, so a label
written for a single-head probe (``"toxic"``) never says anything of the other heads;
unless it is *exhaustive* (a reviewer judged every head): then every head none of whose
labels is named is a negative, a multiclass head by its one class that does not flag
(one with several such classes stays unknown: which of them is meant cannot be told).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probes.errors import ProbeError
from schemas import ProbeSpec

__all__ = ["annotated", "encode_target", "encode_targets", "head_targets"]


def encode_target(
    spec: ProbeSpec, names: Sequence[str], head: str | None = None, *, exhaustive: bool = False
) -> tuple[torch.Tensor, int]:
    """``(target, balance bucket)`` for one example labeled ``names`` (for ``head`` alone,
    when given; for every head of a multi-head probe when ``exhaustive``).

    Raises :class:`ProbeError` saying why the labels cannot be learned by ``spec``.
    """
    if head is not None and head not in {h.name for h in spec.head_specs}:
        known = [h.name for h in spec.head_specs]
        raise ProbeError(f"probe {spec.name!r} has no head {head!r}; its heads: {known}")
    space = spec.head(head).labels if head is not None else spec.labels
    unknown = [n for n in names if n not in space]
    if unknown:
        where = f"head {head!r}'s" if head is not None else "the probe's"
        raise ProbeError(f"labels {unknown} are not among {where} {space}")
    if spec.heads:
        return _encode_heads(spec, names, head, exhaustive)
    if spec.task == "multiclass":
        if len(names) != 1:
            raise ProbeError(f"a multiclass probe needs exactly one label, got {list(names)}")
        idx = spec.labels.index(names[0])
        return torch.tensor(idx), idx
    hot = torch.zeros(len(spec.labels))
    for n in names:
        hot[spec.labels.index(n)] = 1.0
    bucket = spec.labels.index(names[0]) if names else len(spec.labels)
    return hot, bucket


def _encode_heads(
    spec: ProbeSpec, names: Sequence[str], head: str | None, exhaustive: bool = False
) -> tuple[torch.Tensor, int]:
    target = torch.full((len(spec.labels),), float("nan"))
    for h in spec.head_specs:
        mine = [n for n in names if n in h.labels]
        if head not in (None, h.name) or (head is None and not mine and not exhaustive):
            continue
        if h.task == "multiclass" and not mine and exhaustive:  # its class that does not flag
            calm = [x for x in h.labels if x not in spec.flag_labels]
            if len(calm) != 1:
                continue
            mine = calm
        if h.task == "multiclass" and len(mine) != 1:
            raise ProbeError(f"multiclass head {h.name!r} needs exactly one label, got {mine}")
        cols = spec.head_columns(h.name)
        target[cols] = torch.tensor([float(label in mine) for label in h.labels])
    if target.isnan().all():
        raise ProbeError(
            f"labels {list(names)} annotate no head of probe {spec.name!r}: name the head "
            f"(one of {[h.name for h in spec.heads]}) to give it a negative"
        )
    bucket = spec.labels.index(names[0]) if names else len(spec.labels)
    return target, bucket


def annotated(spec: ProbeSpec, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head, ``[N]`` bool: the rows of ``targets`` that annotate it (all of them for a
    single-head probe)."""
    if not spec.heads:
        return {spec.name: torch.ones(len(targets), dtype=torch.bool)}
    return {h.name: ~targets[:, spec.head_columns(h.name)].isnan().any(dim=1) for h in spec.heads}


def head_targets(spec: ProbeSpec, targets: torch.Tensor, head: str) -> torch.Tensor:
    """The targets of ``head``'s annotated rows in its own encoding (class indices for a
    multiclass head, multi-hot otherwise), for its single-head view
    (:meth:`schemas.ProbeSpec.head_view`)."""
    if not spec.heads:
        return targets
    part = targets[annotated(spec, targets)[head]][:, spec.head_columns(head)]
    return part.argmax(dim=1) if spec.head(head).task == "multiclass" else part


def encode_targets(spec: ProbeSpec, label_sets: Sequence[Sequence[str]]) -> torch.Tensor:
    """Targets of many examples: ``[N]`` class indices or ``[N, C]`` multi-hot.

    Raises :class:`ProbeError` naming every unknown label at once.
    """
    unknown = sorted({n for names in label_sets for n in names} - set(spec.labels))
    if unknown:
        raise ProbeError(
            f"rows carry labels {unknown} that probe {spec.name!r} does not know: {spec.labels}"
        )
    targets = [encode_target(spec, names)[0] for names in label_sets]
    if not targets:
        shape = (0,) if spec.task == "multiclass" else (0, len(spec.labels))
        return torch.zeros(shape, dtype=torch.int64 if spec.task == "multiclass" else None)
    return torch.stack(targets)
