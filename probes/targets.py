"""Label names to training targets: the one encoding that ``fit``, ``eval`` and the
online updater share.

A multiclass probe's target is a class index (``[]`` int64); a multilabel probe's is a
multi-hot vector (``[C]`` float). Each target also gets a *balance bucket*, the class
the replay buffer balances on: the class index, or for multilabel the first label named
(``C`` when none is).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probes.errors import ProbeError
from schemas import ProbeSpec

__all__ = ["encode_target", "encode_targets"]


def encode_target(spec: ProbeSpec, names: Sequence[str]) -> tuple[torch.Tensor, int]:
    """``(target, balance bucket)`` for one example labeled ``names``.

    Raises :class:`ProbeError` saying why the labels cannot be learned by ``spec``.
    """
    unknown = [n for n in names if n not in spec.labels]
    if unknown:
        raise ProbeError(f"labels {unknown} are not among the probe's {spec.labels}")
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
