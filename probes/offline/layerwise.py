"""Where the signal lives: one probe per layer, on the task and on its control task.

::

    rows = probe_layers(spec, train, test, FitConfig(max_epochs=20),
                        control=(train_control_targets, test_control_targets))
    rows[0]["layer"], rows[0]["f1"], rows[0]["control_f1"], rows[0]["selectivity_f1"]

For each layer ``l`` of the data, a probe of ``spec``'s kind reads layer ``l`` alone
(``layer_mix="single"``) and is fitted on ``train`` with early stopping and thresholds on
a fixed, id-hashed share of ``train`` (:func:`probes.offline.select.held_out`, ``val_share``);
its headline F1 and AUPRC are measured on ``test``, which no choice saw. With ``control``
targets (:mod:`probes.offline.control`) the same probe is fitted and measured again on them,
and **selectivity** = task metric - control metric (Hewitt & Liang): a probe that only
learns surface features from a layer scores as well on the control and has selectivity
near 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from probes.errors import ProbeError
from probes.explain import ClassLayerUse, class_layer_use_batches
from probes.metrics import evaluate
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, fit, predict_dataset
from probes.offline.select import held_out
from probes.probe import Probe, build_probe
from schemas import ProbeSpec

__all__ = ["class_layer_use", "fit_and_measure", "layer_slice", "probe_layers"]


def layer_slice(data: ProbeDataset, layers: list[int]) -> ProbeDataset:
    """The same rows reading only ``layers`` (a subset of ``data.layers``, in that order)."""
    missing = [layer for layer in layers if layer not in data.layers]
    if missing:
        raise ProbeError(f"layers {missing} are not in the data's {data.layers}")
    idx = [data.layers.index(layer) for layer in layers]
    if data.summaries is not None:
        return replace(data, layers=list(layers), summaries=data.summaries[idx])
    assert data.tokens is not None  # a ProbeDataset holds one of the two
    return replace(data, layers=list(layers), tokens=data.tokens[:, idx])


def fit_and_measure(
    spec: ProbeSpec,
    train: ProbeDataset,
    test: ProbeDataset,
    config: FitConfig,
    *,
    val_share: float = 0.15,
) -> dict[str, Any]:
    """Fit ``spec`` on ``train`` (early stopping and thresholds on an id-hashed
    ``val_share`` of it) and measure on ``test``: ``{"f1", "auprc", "accuracy",
    "macro_f1", "epochs", "seconds", "report"}``."""
    started = time.perf_counter()
    val_rows = held_out(train.ids, val_share, salt="probeguard-layerwise-val")
    if val_rows.all() or not val_rows.any():
        raise ProbeError(f"{len(train)} training rows are too few to hold out {val_share:.0%}")
    fitting = train.subset((~val_rows).nonzero().flatten())
    val = train.subset(val_rows.nonzero().flatten())
    result = fit(build_probe(spec, seed=config.seed), fitting, val, config)
    report = evaluate(result.probe.spec, predict_dataset(result.probe, test), test.targets)
    return {
        "f1": float(report["f1"]),
        "auprc": float(report["auprc"]),
        "accuracy": float(report["accuracy"]),
        "macro_f1": float(report["macro_f1"]),
        "epochs": result.best_epoch,
        "seconds": round(time.perf_counter() - started, 2),
        "report": report,
        "probe": result.probe,
    }


def probe_layers(
    spec: ProbeSpec,
    train: ProbeDataset,
    test: ProbeDataset,
    config: FitConfig,
    *,
    control: tuple[Tensor, Tensor] | None = None,
    layers: list[int] | None = None,
    val_share: float = 0.15,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per layer (see the module docstring): ``layer``, ``f1``, ``auprc``,
    ``epochs``, ``seconds``, and with ``control`` (train and test control targets)
    ``control_f1``, ``control_auprc``, ``selectivity_f1``, ``selectivity_auprc``."""
    rows = []
    for layer in layers or train.layers:
        one = spec.model_copy(update={"layers": [layer], "layer_mix": "single", "thresholds": {}})
        tr, te = layer_slice(train, [layer]), layer_slice(test, [layer])
        task = fit_and_measure(one, tr, te, config, val_share=val_share)
        row: dict[str, Any] = {"layer": layer}
        row.update({k: task[k] for k in ("f1", "auprc", "epochs", "seconds")})
        if control is not None:
            ctr = replace(tr, targets=control[0])
            cte = replace(te, targets=control[1])
            ctl = fit_and_measure(one, ctr, cte, config, val_share=val_share)
            row.update(
                control_f1=ctl["f1"],
                control_auprc=ctl["auprc"],
                selectivity_f1=task["f1"] - ctl["f1"],
                selectivity_auprc=task["auprc"] - ctl["auprc"],
            )
        if progress is not None:
            progress(row)
        rows.append(row)
    return rows


@torch.no_grad()
def class_layer_use(probe: Probe, data: ProbeDataset, batch_size: int = 128) -> ClassLayerUse:
    """Per-class, per-layer contributions of ``probe`` over every row of ``data`` (whose
    layers and labels must be the probe's; see :class:`ClassLayerUse`)."""
    batches = (
        data.batch(torch.arange(start, min(start + batch_size, len(data))))
        for start in range(0, len(data), batch_size)
    )
    return class_layer_use_batches(probe, batches)
