"""From logits to probabilities, and the calibration that makes those probabilities honest.

::

    logits [..., C]
        -> logits / temperature + bias      per head (spec.calibration; absent: unchanged)
        -> softmax / sigmoid                by the task: one softmax (multiclass), sigmoids
                                            (multilabel), a softmax per multiclass head

A probe trained with a class-balanced loss scores as if half the messages were flagged:
its scores rank well (AUPRC) but read poorly as probabilities. :func:`fit_heads` fits, per
head, the temperature and per-label bias that minimize the negative log-likelihood of
out-of-fold logits (``fit``) or of the updater's prequential window; the probe applies them
in :meth:`probes.probe.Probe.probabilities`, the one place its logits become probabilities
(scorer, explain, drift, the updater's test-then-train). The cascade's exit head is
calibrated the same way with one temperature (:class:`schemas.ExitSpec`, :mod:`probes.exit`).

>>> from schemas import HeadCalibration, ProbeSpec
>>> spec = ProbeSpec(name="tox", token_pool="mean", layer_mix="single", layers=[1],
...     hidden_size=8, task="multilabel", labels=["toxic"],
...     calibration={"tox": HeadCalibration(temperature=2.0, bias=[-1.0])})
>>> calibrated_probabilities(spec, torch.tensor([[2.0]]))  # sigmoid(2 / 2 - 1)
tensor([[0.5000]])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from probes.targets import annotated, head_targets
from schemas import HeadCalibration, ProbeSpec

__all__ = [
    "calibrated",
    "calibrated_probabilities",
    "fit_calibration",
    "fit_heads",
    "multiclass_columns",
    "probabilities",
    "raw_logits",
]


def multiclass_columns(spec: ProbeSpec) -> list[slice]:
    """The output columns of each multiclass head of a multi-head spec (a single-head
    multiclass probe has none here: its whole output is one softmax)."""
    return [spec.head_columns(h.name) for h in spec.heads if h.task == "multiclass"]


def probabilities(spec: ProbeSpec, logits: Tensor) -> Tensor:
    """Softmax (multiclass) or sigmoid (multilabel) of logits ``[..., C]``; with heads,
    each multiclass head's columns take a softmax of their own. No calibration."""
    if spec.task == "multiclass":
        return torch.softmax(logits, dim=-1)
    probs = torch.sigmoid(logits)
    for cols in multiclass_columns(spec):  # over the last axis: [..., C]
        probs[..., cols] = torch.softmax(logits[..., cols], dim=-1)
    return probs


def calibrated(
    spec: ProbeSpec,
    logits: Tensor,
    temperature: float | Tensor,
    bias: list[float] | Tensor | None = None,
) -> Tensor:
    """Probabilities ``[..., C]`` of ``logits / temperature + bias`` (``temperature``: one,
    or one per column ``[C]``; ``bias``: one per column), by the spec's task."""
    if isinstance(temperature, Tensor):
        temperature = temperature.to(device=logits.device, dtype=torch.float32)
    scaled = logits.float() / temperature
    if bias is not None:
        scaled = scaled + torch.as_tensor(bias, dtype=scaled.dtype, device=scaled.device)
    return probabilities(spec, scaled)


def _columns(spec: ProbeSpec) -> tuple[Tensor, Tensor]:
    """Per output column ``[C]``: its head's temperature and its label's bias."""
    temperature, bias = torch.ones(len(spec.labels)), torch.zeros(len(spec.labels))
    columns: dict[str, slice] = {}
    start = 0
    for h in spec.head_specs:  # heads own consecutive columns (ProbeSpec.head_columns)
        columns[h.name] = slice(start, start + len(h.labels))
        start += len(h.labels)
    for name, cal in spec.calibration.items():
        cols = columns[name] if name in columns else spec.head_columns(name)  # unknown: raises
        temperature[cols] = cal.temperature
        bias[cols] = torch.tensor(cal.bias)
    return temperature, bias


def calibrated_probabilities(spec: ProbeSpec, logits: Tensor) -> Tensor:
    """Probabilities ``[..., C]`` of the probe's logits ``[..., C]`` under
    ``spec.calibration`` (exactly :func:`probabilities` without one)."""
    if not spec.calibration:
        return probabilities(spec, logits)
    temperature, bias = _columns(spec)
    scaled = logits / temperature.to(logits) + bias.to(logits)
    return probabilities(spec, scaled)


def raw_logits(spec: ProbeSpec, probs: Tensor) -> Tensor:
    """Logits ``[N, C]`` that give ``probs`` ``[N, C]`` (those of a probe of ``spec``,
    calibrated by ``spec.calibration`` if it has one) with no calibration: ``log p -
    log(1 - p)`` for a sigmoid column, ``log p`` for softmax columns (a softmax ignores a
    constant per row), then the calibration undone. Exact up to float32 saturation: a
    sigmoid probability that rounded to 1 comes back as about 17.3 (``1 - p`` taken as half
    float32's spacing below 1), one that underflowed to 0 as about -69.

    >>> spec = ProbeSpec(name="t", token_pool="mean", layer_mix="single", layers=[1],
    ...     hidden_size=8, task="multilabel", labels=["a", "b"])
    >>> raw_logits(spec, torch.sigmoid(torch.tensor([[-3.0, 2.0]])))
    tensor([[-3.0000,  2.0000]])
    """
    p = probs.double()
    logits = p.clamp_min(1e-30).log()
    if spec.task == "multilabel":
        soft = torch.zeros(len(spec.labels), dtype=torch.bool)
        for cols in multiclass_columns(spec):
            soft[cols] = True
        logits = torch.where(soft, logits, logits - (1.0 - p).clamp_min(2.0**-25).log())
    if spec.calibration:
        temperature, bias = _columns(spec)
        logits = (logits - bias.double()) * temperature.double()
    return logits.float()


def fit_calibration(
    spec: ProbeSpec, logits: Tensor, targets: Tensor, steps: int = 300
) -> tuple[float, list[float]]:
    """The temperature and per-label bias that minimize the negative log-likelihood of
    out-of-fold ``logits [N, C]`` as ``logits / T + bias`` (NaN multilabel targets are
    unknown). The bias moves probabilities to the data's base rate, which a head trained
    with balanced classes lacks; the temperature alone would only squash them toward 0.5."""
    logits = logits.float().detach()
    log_t = torch.zeros((), requires_grad=True)
    bias = torch.zeros(logits.shape[1], requires_grad=True)
    optimizer = torch.optim.Adam([log_t, bias], lr=0.05)
    known = None if spec.task == "multiclass" else ~targets.isnan()
    for _ in range(steps):
        optimizer.zero_grad()
        scaled = logits / log_t.exp() + bias
        if known is None:
            loss = F.cross_entropy(scaled, targets)
        else:
            cells = F.binary_cross_entropy_with_logits(
                scaled, targets.nan_to_num(0.0), reduction="none"
            )
            loss = (cells * known).sum() / known.sum().clamp_min(1)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            log_t.clamp_(-6.9, 6.9)  # T in [0.001, 1000] (the specs' range)
            bias.clamp_(-100.0, 100.0)
    final = bias.detach()
    if spec.task == "multiclass":
        final = final - final.mean()  # softmax: only differences matter
    return float(log_t.detach().exp()), [round(float(b), 6) for b in final]


def _enough(view: ProbeSpec, targets: Tensor, min_positives: int) -> bool:
    """Each label of the head ``view`` has ``min_positives`` positives and a negative."""
    if view.task == "multiclass":
        counts = torch.bincount(targets, minlength=len(view.labels))
        return bool((counts >= min_positives).all()) and bool((counts < len(targets)).all())
    positives = targets.nansum(dim=0)
    negatives = (targets == 0).sum(dim=0)
    return bool((positives >= min_positives).all()) and bool((negatives >= 1).all())


def fit_heads(
    spec: ProbeSpec,
    logits: Tensor,
    targets: Tensor,
    *,
    min_positives: int = 1,
    labels_seen: int = 0,
    steps: int = 300,
) -> dict[str, HeadCalibration]:
    """Per head, the calibration (:func:`fit_calibration` on its own view: one temperature,
    a bias per label) of uncalibrated ``logits [N, C]`` against ``targets``, on the rows that
    annotate it. A head whose rows lack ``min_positives`` positives (or any negative) of one
    of its labels is left out: it has too little evidence to be calibrated.

    >>> spec = ProbeSpec(name="t", token_pool="mean", layer_mix="single", layers=[1],
    ...     hidden_size=8, task="multilabel", labels=["toxic"])
    >>> cal = fit_heads(spec, torch.zeros(4, 1), torch.tensor([[1.0], [0.0], [0.0], [0.0]]))
    >>> round(cal["t"].bias[0], 2)  # log(1/3): the base rate
    -1.1
    """
    out: dict[str, HeadCalibration] = {}
    for name, rows in annotated(spec, targets).items():
        view, cols = spec.head_view(name), spec.head_columns(name)
        y = head_targets(spec, targets, name)
        if not len(y) or not _enough(view, y, min_positives):
            continue
        temperature, bias = fit_calibration(view, logits[rows][:, cols], y, steps)
        if not math.isfinite(temperature) or not all(map(math.isfinite, bias)):
            continue
        out[name] = HeadCalibration(temperature=temperature, bias=bias, labels_seen=labels_seen)
    return out
