"""Offline evaluation: a checkpoint (or the packaged default, or one head of a multi-head
probe) measured on a labeled cache or on labeled rows extracted on the fly.

The CLI command ``eval`` is a thin wrapper over these functions; training is in
:mod:`worker.offline.fit_eval`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from probes import Probe, ProbeError, encode_target, encode_targets, load_checkpoint
from probes.ensemble import load_ensemble
from probes.metrics import evaluate
from probes.offline.cache import HiddenStateCache
from probes.offline.ensemble import align_rows
from probes.offline.fit import predict_dataset
from probes.probe import Prepared
from schemas import CheckpointManifest, LabeledText, LLMFingerprint, ProbeSpec
from worker.defaults import find_default
from worker.errors import OfflineError
from worker.offline.build_cache import ExtractorLike
from worker.offline.fit_eval import Target, load_split

__all__ = [
    "HeadView",
    "evaluate_ensemble_on_caches",
    "evaluate_on_cache",
    "evaluate_on_rows",
    "for_head",
    "load_for_eval",
]


def load_for_eval(checkpoint: Path, llm: LLMFingerprint) -> tuple[Probe, CheckpointManifest]:
    """``checkpoint`` verified against ``llm``; ``default``: the packaged default for it."""
    if str(checkpoint) == "default":
        found = find_default(llm, "moderation")
        if found is None:
            raise OfflineError(f"this release ships no packaged default for {llm.model_id}")
        return found.probe, found.manifest
    return load_checkpoint(checkpoint, llm)


def for_head(probe: Probe, head: str | None) -> Probe:
    """``probe`` seen as its head ``head`` alone (a single-head view sharing the weights),
    for measuring one head on a file labeled for it; ``None``: the probe itself."""
    if head is None:
        return probe
    try:
        view = probe.spec.head_view(head)
    except ValueError as exc:
        raise OfflineError(str(exc)) from exc
    return HeadView(probe, head, view)


class HeadView(Probe):
    """One head of a multi-head probe as a single-head probe: the shared pooling, mix and
    weights, its own columns of the output, its task, labels, flags and thresholds."""

    def __init__(self, probe: Probe, head: str, view: ProbeSpec) -> None:
        torch.nn.Module.__init__(self)
        self.whole = probe
        self.head_name = head
        self._spec = view
        self._cols = probe.spec.head_columns(head)

    def forward(
        self, hidden: torch.Tensor | Prepared, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.whole(hidden, mask)[:, self._cols]  # [B, C_head]

    @torch.no_grad()
    def predict_proba_pooled(
        self, hidden: torch.Tensor | Prepared, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The whole probe's pass (its normalization and pooling); a head's columns form
        # whole softmax groups, so its probabilities are the whole probe's, sliced.
        probs, pooled = self.whole.predict_proba_pooled(hidden, mask)
        return probs[:, self._cols], pooled

    def layer_weights(
        self, hidden: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.whole.layer_weights(hidden, mask)

    @property
    def layers(self) -> tuple[int, ...]:
        return self.whole.layers

    @property
    def separable(self) -> bool:
        return self.whole.separable


def evaluate_on_cache(
    checkpoint: Path, cache: HiddenStateCache, head: str | None = None
) -> tuple[Probe, dict[str, Any]]:
    """Load ``checkpoint`` (verified against the cache's LLM) and evaluate it on ``cache``
    (on one head's columns with ``head``, the file's labels read as that head's)."""
    probe, manifest = load_for_eval(checkpoint, cache.manifest.llm)
    probe = for_head(probe, head)
    if isinstance(probe, HeadView) or probe.spec.heads:
        data = load_split(cache, probe.spec.token_pool, list(probe.spec.layers), "label")
        targets = _targets_of_names(probe, [list(names) for names in cache.row_labels()])
        data = replace(data, labels=list(probe.spec.labels), task=probe.spec.task, targets=targets)
    else:
        target: Target = "label" if probe.spec.task == "multiclass" else "labels"
        data = load_split(cache, probe.spec.token_pool, list(probe.spec.layers), target)
        data = data.relabel(list(probe.spec.labels))
    probs = predict_dataset(probe, data)
    weights = torch.zeros(len(probe.layers))
    for start in range(0, len(data), 128):
        idx = torch.arange(start, min(start + 128, len(data)))
        hidden, mask, _ = data.batch(idx)
        weights += probe.layer_weights(hidden, mask) * len(idx)
    report = evaluate(probe.spec, probs, data.targets)
    report.update(_layer_summary(probe, weights / max(1, len(data))))
    report.update(checkpoint=str(checkpoint), probe=manifest.probe, version=manifest.version)
    return probe, report


def evaluate_ensemble_on_caches(
    checkpoint: Path, caches: Sequence[HiddenStateCache], *, signing_key: bytes | None = None
) -> dict[str, Any]:
    """Load the ensemble in ``checkpoint`` (each member verified against the cache of its
    LLM; one cache per member, of the same labeled rows; with ``signing_key``, its
    signatures too) and evaluate the mean of its members' probabilities at its thresholds;
    ``members``: each member's own figures."""
    by_llm = {cache.manifest.llm.digest: cache for cache in caches}
    if len(by_llm) != len(caches):
        raise OfflineError("two of the caches were built with the same LLM; give one per member")
    llms = [cache.manifest.llm for cache in caches]
    ensemble = load_ensemble(checkpoint, llms, signing_key=signing_key)
    members = {m.llm.digest for m in ensemble.manifest.members}
    extra = [c.directory for d, c in by_llm.items() if d not in members]
    if extra:
        raise OfflineError(f"no member of the ensemble reads the LLM of cache(s) {extra}")
    datas = []
    for probe, member in zip(ensemble.probes, ensemble.manifest.members, strict=True):
        target: Target = "label" if probe.spec.task == "multiclass" else "labels"
        cache = by_llm[member.llm.digest]
        data = load_split(cache, probe.spec.token_pool, list(probe.spec.layers), target)
        datas.append(data.relabel(list(probe.spec.labels)))
    try:
        datas = align_rows(datas)
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc
    targets = datas[0].targets
    probs = [predict_dataset(p, d) for p, d in zip(ensemble.probes, datas, strict=True)]
    report = evaluate(ensemble.spec, ensemble.predict_proba(probs), targets)
    report["members"] = []
    for probe, member, p in zip(ensemble.probes, ensemble.manifest.members, probs, strict=True):
        own = evaluate(probe.spec, p, targets)
        report["members"].append(
            {
                "llm": member.llm.model_id,
                "path": member.path,
                **{k: own[k] for k in ("f1", "auprc", "recall_at_1pct_fpr", "ece")},
            }
        )
    report.update(checkpoint=str(checkpoint), probe=ensemble.manifest.probe, version=0)
    return report


def evaluate_on_rows(
    checkpoint: Path,
    rows: Sequence[LabeledText],
    extractor: ExtractorLike,
    batch_size: int = 16,
    head: str | None = None,
) -> tuple[Probe, dict[str, Any]]:
    """Extract ``rows`` with ``extractor`` (only the probe's layers) and evaluate ``checkpoint``
    (``default``: the packaged default; with ``head``, that head on the file's labels)."""
    probe, manifest = load_for_eval(checkpoint, extractor.fingerprint)
    probe = for_head(probe, head)
    targets = _targets(probe, rows)
    probs, kept, skipped = [], [], {}
    weights = torch.zeros(len(probe.layers))
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        out = extractor.extract([r.text for r in chunk], list(probe.layers))
        skipped.update({chunk[p].id: reason for p, reason in out.errors.items()})
        if out.index:
            hidden = out.hidden.float()  # [L, B_ok, T, D]
            probs.append(probe.predict_proba_many(hidden, out.mask))
            weights += probe.layer_weights(hidden, out.mask) * len(out.index)
            kept += [start + p for p in out.index]
    if not kept:
        raise OfflineError("no row could be extracted")
    report = evaluate(probe.spec, torch.cat(probs), targets[torch.tensor(kept)])
    report.update(_layer_summary(probe, weights / len(kept)))
    report.update(checkpoint=str(checkpoint), probe=manifest.probe, version=manifest.version)
    report["skipped"] = skipped
    return probe, report


def _targets(probe: Probe, rows: Sequence[LabeledText]) -> torch.Tensor:
    multiclass = probe.spec.task == "multiclass"
    if isinstance(probe, HeadView) or probe.spec.heads:
        names = [([r.label] if r.label else []) + (r.labels or []) for r in rows]
        return _targets_of_names(probe, names)
    if any((r.label if multiclass else r.labels) is None for r in rows):
        field = "label" if multiclass else "labels"
        raise OfflineError(f"a {probe.spec.task} probe needs {field!r} on every row")
    label_sets = [[r.label] if multiclass and r.label else list(r.labels or []) for r in rows]
    try:
        return encode_targets(probe.spec, label_sets)
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc


def _targets_of_names(probe: Probe, names: Sequence[Sequence[str]]) -> torch.Tensor:
    """Each row's label names read as the probe's: the names outside its label space say
    nothing. One head (:class:`HeadView`): the names in its space are its positives (a
    multiclass head needs exactly one per row). A multi-head probe: each row annotates the
    heads it names a label of (the others unknown; a row naming none counts for none)."""
    space = set(probe.spec.labels)
    label_sets = [[n for n in row if n in space] for row in names]
    if isinstance(probe, HeadView):
        if probe.spec.task == "multiclass" and any(len(x) != 1 for x in label_sets):
            raise OfflineError(
                f"multiclass head {probe.head_name!r} needs exactly one of {probe.spec.labels} "
                "per row"
            )
        return encode_targets(probe.spec, label_sets)
    unknown = torch.full((len(probe.spec.labels),), float("nan"))
    return (
        torch.stack([encode_target(probe.spec, x)[0] if x else unknown for x in label_sets])
        if label_sets
        else unknown[None][:0]
    )


def _layer_summary(probe: Probe, weights: torch.Tensor) -> dict[str, Any]:
    from probes.probe import weight_entropy

    return {
        "layers": list(probe.layers),
        "layer_weights": [round(float(w), 6) for w in weights],
        "layer_entropy": weight_entropy(weights),
    }
