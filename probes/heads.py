"""Adding and removing heads of a probe: a custom category from a few labels.

::

    bigger = add_head(probe, HeadSpec(name="jailbreak", task="multilabel",
                                      labels=["jailbreaking"]), flag=True)
    smaller = remove_head(bigger, "jailbreak")

Both are pure: they return a new probe and leave ``probe`` as it was. The shared part
(normalization buffers, token pooling, layer mix) and every kept head's rows of the
linear head are copied bit for bit, so the other heads score exactly as before; a new
head's rows start at zero (``init_std`` for small random weights instead), so it
scores 0.5 per label (a multilabel head) or uniform (a multiclass head) until it learns.

A single-head probe becomes a multi-head one with its old head named after the probe
(:meth:`schemas.ProbeSpec.head_specs`); its outputs are unchanged (a multiclass head's
columns take their own softmax, which is the whole output's softmax before).

:func:`remap_label_rows` moves any per-label state (the Lion momentum of the linear
head) from one label order to another by label name, so an optimizer state saved
before a head was added or removed still fits: kept labels keep their rows, new ones
start at zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from pydantic import ValidationError
from torch import Tensor

from probes.errors import ProbeError
from probes.probe import Probe
from schemas import HeadSpec, ProbeSpec, describe_error

__all__ = ["HEAD_ROWS", "add_head", "remap_label_rows", "remove_head"]

# The tensors with one row per output column (label): the linear head's.
HEAD_ROWS = ("head.weight", "head.bias", "exit_head.head.weight", "exit_head.head.bias")


def _spec(data: dict[str, object], what: str) -> ProbeSpec:
    try:
        return ProbeSpec.model_validate(data)
    except ValidationError as exc:
        raise ProbeError(f"{what}: {describe_error(exc)[1]}") from None


def remap_label_rows(
    state: Mapping[str, Tensor], old_labels: Sequence[str], new_labels: Sequence[str]
) -> dict[str, Tensor]:
    """``state`` (tensors of a probe over ``old_labels``) for a probe over ``new_labels``:
    the rows of :data:`HEAD_ROWS` picked by label name, zero for a label ``old_labels``
    lacks; every other tensor as it is (cloned)."""
    old = {label: i for i, label in enumerate(old_labels)}
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name not in HEAD_ROWS:
            out[name] = t.detach().clone()
            continue
        if t.shape[0] != len(old_labels):
            raise ProbeError(f"{name} has {t.shape[0]} rows for {len(old_labels)} labels")
        rows = torch.zeros((len(new_labels), *t.shape[1:]), dtype=t.dtype, device=t.device)
        for j, label in enumerate(new_labels):
            if label in old:
                rows[j] = t[old[label]]
        out[name] = rows
    return out


def _exit_for(spec: ProbeSpec, new_labels: Sequence[str]) -> dict[str, object] | None:
    """``spec.exit`` for a probe over ``new_labels``: its per-label bias picked by label
    name, 0 for a new label. A new flag label's exit column then scores 0.5 (zero rows),
    above any sane ``allow_below``: the exit decides nothing early until it has learned."""
    if spec.exit is None:
        return None
    out = spec.exit.model_dump()
    if spec.exit.bias is not None:
        old = dict(zip(spec.labels, spec.exit.bias, strict=True))
        out["bias"] = [old.get(label, 0.0) for label in new_labels]
    return out


def _rebuilt(probe: Probe, spec: ProbeSpec, state: dict[str, Tensor]) -> Probe:
    out = Probe(spec)
    out.load_state_dict(state)
    out.to(probe.shift.device)
    out.train(probe.training)
    return out


def add_head(
    probe: Probe,
    head: HeadSpec,
    *,
    flag: bool | Sequence[str] = False,
    thresholds: Mapping[str, float] | None = None,
    init_std: float = 0.0,
    seed: int | None = None,
) -> Probe:
    """A copy of ``probe`` with ``head`` appended: its labels get new output columns.

    ``flag``: the new head's labels join ``flag_labels`` (it can flag a verdict; a list:
    those of its labels);
    ``thresholds``: decision thresholds of its labels; ``init_std``: the standard deviation
    of its initial weights (0: zero weights and bias); ``seed`` makes those reproducible.
    Raises :class:`ProbeError` when the head's name or a label is already taken, or the
    spec would not validate.
    """
    spec = probe.spec
    heads = spec.head_specs
    if head.name in {h.name for h in heads}:
        raise ProbeError(f"probe {spec.name!r} already has a head {head.name!r}")
    taken = sorted(set(head.labels) & set(spec.labels))
    if taken:
        raise ProbeError(
            f"labels {taken} already belong to probe {spec.name!r} (labels are unique across "
            "heads; name the new head's labels differently)"
        )
    flags = list(head.labels) if flag is True else list(flag or [])
    unknown = sorted((set(thresholds or {}) | set(flags)) - set(head.labels))
    if unknown:
        raise ProbeError(f"thresholds or flags name labels {unknown} that head {head.name!r} lacks")
    new_labels = [*spec.labels, *head.labels]
    new_spec = _spec(
        {
            **spec.model_dump(),
            "task": "multilabel",
            "heads": [h.model_dump() for h in [*heads, head]],
            "labels": new_labels,
            "exit": _exit_for(spec, new_labels),
            "flag_labels": [*spec.flag_labels, *flags],
            "thresholds": {
                **spec.thresholds,
                **{k: float(v) for k, v in (thresholds or {}).items()},
            },
        },
        f"cannot add head {head.name!r} to probe {spec.name!r}",
    )
    state = remap_label_rows(probe.state_dict(), spec.labels, new_labels)
    if init_std > 0:
        cols = new_spec.head_columns(head.name)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        w = state["head.weight"]
        noise = torch.randn(w[cols].shape, generator=gen) * init_std
        w[cols] = noise.to(w.dtype).to(w.device)
    return _rebuilt(probe, new_spec, state)


def remove_head(probe: Probe, name: str) -> Probe:
    """A copy of ``probe`` without head ``name`` (its columns, flag labels and thresholds
    dropped; the other heads score exactly as before). The last head cannot be removed."""
    spec = probe.spec
    gone = spec.head(name)  # raises, naming the heads
    heads = [h for h in spec.head_specs if h.name != name]
    if not heads:
        raise ProbeError(f"head {name!r} is probe {spec.name!r}'s only head")
    new_labels = [label for h in heads for label in h.labels]
    new_spec = _spec(
        {
            **spec.model_dump(),
            "task": "multilabel",
            "heads": [h.model_dump() for h in heads],
            "labels": new_labels,
            "exit": _exit_for(spec, new_labels),
            "flag_labels": [x for x in spec.flag_labels if x not in gone.labels],
            "thresholds": {k: v for k, v in spec.thresholds.items() if k not in gone.labels},
            "calibration": {
                k: v.model_dump() for k, v in spec.calibration.items() if k != gone.name
            },
        },
        f"cannot remove head {name!r} from probe {spec.name!r}",
    )
    return _rebuilt(probe, new_spec, remap_label_rows(probe.state_dict(), spec.labels, new_labels))
