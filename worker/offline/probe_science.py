"""What a probe knows and where, on caches: per-layer curves, control tasks and selectivity,
per-class layer use. The glue between caches, labeled files and :mod:`probes.offline.layerwise`,
:mod:`probes.offline.control` and :func:`probes.offline.layerwise.class_layer_use`;
``probeguard eval`` calls these (``bench/probe_science.py`` has its own copy of the
selectivity, not these).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from probes import ProbeError
from probes.offline.cache import HiddenStateCache
from probes.offline.control import control_key, control_targets, label_predictability
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig
from probes.offline.layerwise import class_layer_use, fit_and_measure, probe_layers
from probes.probe import Probe
from schemas import ProbeSpec
from worker.errors import OfflineError
from worker.offline.fit_eval import Target, load_split
from worker.offline.labeled import read_labeled

__all__ = [
    "class_layers",
    "control_for",
    "curve_layers",
    "kind_selectivity",
    "layer_curve",
    "texts_by_id",
]

log = logging.getLogger(__name__)


def texts_by_id(caches: Sequence[HiddenStateCache], files: Sequence[Path] = ()) -> dict[str, str]:
    """Message texts by id, from ``files`` or else from the labeled files the caches were
    built from (their manifests name them)."""
    paths = list(files) or [Path(c.manifest.source.path) for c in caches]
    texts: dict[str, str] = {}
    for path in paths:
        if not path.exists():
            raise OfflineError(
                f"the control task needs the message texts: {path} is missing "
                "(pass the labeled files with --texts)"
            )
        texts.update({r.id: r.text for r in read_labeled(path)})
    return texts


def control_for(
    parts: Sequence[ProbeDataset], texts: dict[str, str]
) -> tuple[list[Tensor], dict[str, float]]:
    """Control targets for each of ``parts`` (computed over all of them together, so a key
    gets one label everywhere) and how well the real label predicts them."""
    missing = [i for p in parts for i in p.ids if i not in texts]
    if missing:
        raise OfflineError(f"no text for {len(missing)} rows (e.g. {missing[:3]})")
    keys = [control_key(texts[i]) for p in parts for i in p.ids]
    real = ProbeDataset.concat(list(parts)).targets
    control = control_targets(keys, real)
    accuracy, majority = label_predictability(real, control)
    out, start = [], 0
    for p in parts:
        out.append(control[start : start + len(p)])
        start += len(p)
    info = {
        "control_from_label_accuracy": accuracy,
        "control_majority_accuracy": majority,
        "control_keys": float(len(set(keys))),
    }
    return out, info


def curve_layers(cache: HiddenStateCache, pool: str) -> list[int]:
    """Every layer the cache holds for ``pool`` (all summary layers for separable pools,
    the token-level layers otherwise)."""
    m = cache.manifest
    layers = m.summary_layers if pool in m.summaries else m.token_layers
    if not layers:
        raise OfflineError(f"cache {cache.directory} stores no layers usable by pool {pool!r}")
    return list(layers)


def _target(spec: ProbeSpec) -> Target:
    return "label" if spec.task == "multiclass" else "labels"


def _split_data(
    spec: ProbeSpec, train: HiddenStateCache, test: HiddenStateCache, layers: list[int]
) -> tuple[ProbeDataset, ProbeDataset]:
    if train.manifest.llm != test.manifest.llm:
        raise OfflineError("the training and evaluation caches were built with different LLMs")
    try:
        a = load_split(train, spec.token_pool, layers, _target(spec)).relabel(list(spec.labels))
        b = load_split(test, spec.token_pool, layers, _target(spec)).relabel(list(spec.labels))
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc
    return a, b


def layer_curve(
    spec: ProbeSpec,
    train: HiddenStateCache,
    test: HiddenStateCache,
    config: FitConfig,
    *,
    control: dict[str, str] | None = None,
    layers: list[int] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Fit ``spec``'s kind on each layer of ``train`` alone and measure on ``test``; with
    ``control`` (texts by id), the control task and selectivity too. Returns the rows and
    the control's predictability figures (empty without control)."""
    layers = layers or curve_layers(train, spec.token_pool)
    a, b = _split_data(spec, train, test, layers)
    pair: tuple[Tensor, Tensor] | None = None
    info: dict[str, float] = {}
    if control is not None:
        targets, info = control_for([a, b], control)
        pair = (targets[0], targets[1])
    rows = probe_layers(spec, a, b, config, control=pair, progress=progress)
    return rows, info


def kind_selectivity(
    spec: ProbeSpec,
    train: HiddenStateCache,
    test: HiddenStateCache,
    config: FitConfig,
    texts: dict[str, str],
) -> dict[str, Any]:
    """The probe kind of ``spec`` with all of its layers, fitted on the task and on the
    control task of ``train``, measured on ``test``: F1/AUPRC of each and selectivity."""
    a, b = _split_data(spec, train, test, list(spec.layers))
    (ca, cb), info = control_for([a, b], texts)
    fresh = spec.model_copy(update={"thresholds": {}})
    task = fit_and_measure(fresh, a, b, config)
    ctl = fit_and_measure(fresh, replace(a, targets=ca), replace(b, targets=cb), config)
    return {
        "kind": f"{spec.token_pool}/{spec.layer_mix}",
        "parameters": task["probe"].num_parameters(),
        "f1": task["f1"],
        "auprc": task["auprc"],
        "control_f1": ctl["f1"],
        "control_auprc": ctl["auprc"],
        "selectivity_f1": task["f1"] - ctl["f1"],
        "selectivity_auprc": task["auprc"] - ctl["auprc"],
        "seconds": task["seconds"] + ctl["seconds"],
        **info,
    }


def class_layers(probe: Probe, cache: HiddenStateCache) -> dict[str, Any]:
    """Per-class layer use of ``probe`` over every row of ``cache`` (the explain breakdown
    aggregated; see :class:`probes.explain.ClassLayerUse`), as JSON-ready lists."""
    try:
        data = load_split(
            cache, probe.spec.token_pool, list(probe.layers), _target(probe.spec)
        ).relabel(list(probe.labels))
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc
    use = class_layer_use(probe, data)
    return {
        "labels": list(use.labels),
        "layers": list(use.layers),
        "rows": use.rows.tolist(),
        "gap": [[round(float(v), 5) for v in row] for row in use.gap],
        "shares": [[round(float(v), 5) for v in row] for row in use.shares()],
    }
