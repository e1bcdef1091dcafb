"""Offline evaluation: a checkpoint (or the packaged default, or one head of a multi-head
probe) measured on a labeled cache or on labeled rows extracted on the fly.

The CLI command ``eval`` is a thin wrapper over these functions; training is in
:mod:`worker.offline.fit_eval`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from probes import Probe, ProbeError, encode_targets, load_checkpoint
from probes.ensemble import load_ensemble
from probes.metrics import benign_rows, evaluate, evaluate_policy
from probes.offline.cache import HiddenStateCache
from probes.offline.ensemble import align_rows
from probes.offline.fit import predict_dataset
from probes.probe import Prepared
from probes.targets import annotated, head_targets
from schemas import CheckpointManifest, LabeledText, LLMFingerprint, ProbeSpec
from worker.defaults import find_default, missing
from worker.errors import OfflineError
from worker.offline.build_cache import ExtractorLike
from worker.offline.fit_eval import Target, load_split
from worker.offline.label_map import (
    HeadsMap,
    file_source_heads,
    row_names,
    source_targets,
    unread_labels,
)

__all__ = [
    "FileLabels",
    "HeadView",
    "evaluate_ensemble_on_caches",
    "evaluate_on_cache",
    "evaluate_on_rows",
    "for_head",
    "load_for_eval",
    "read_file_labels",
]


def load_for_eval(checkpoint: Path, llm: LLMFingerprint) -> tuple[Probe, CheckpointManifest]:
    """``checkpoint`` verified against ``llm``; ``default``: the packaged default for it."""
    if str(checkpoint) == "default":
        found = find_default(llm, "moderation")
        if found is None:
            raise OfflineError(missing(llm))
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
    checkpoint: Path,
    cache: HiddenStateCache,
    head: str | None = None,
    *,
    heads_map: HeadsMap | None = None,
    flag_heads: frozenset[str] | None = None,
) -> tuple[Probe, dict[str, Any]]:
    """Load ``checkpoint`` (verified against the cache's LLM) and evaluate it on ``cache``
    (on one head's columns with ``head``). A multi-head probe, one head, or any probe with
    ``heads_map``: each row's ``label`` and ``labels`` read as :mod:`worker.offline.label_map`
    says; a multi-head probe's report adds ``policy`` (:func:`probes.metrics.evaluate_policy`
    with ``flag_heads``)."""
    probe, manifest = load_for_eval(checkpoint, cache.manifest.llm)
    probe = for_head(probe, head)
    if isinstance(probe, HeadView) or probe.spec.heads or heads_map is not None:
        data = load_split(cache, probe.spec.token_pool, list(probe.spec.layers), "label")
        names = cache.row_labels()
        labels = read_file_labels(probe, names, data.ids, heads_map, str(cache.directory))
        data = replace(
            data, labels=list(probe.spec.labels), task=probe.spec.task, targets=labels.targets
        ).subset(labels.rows)
    else:
        labels = None
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
    if labels is not None:
        report.update(labels.report(probe, probs, torch.arange(len(data)), flag_heads))
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
    *,
    heads_map: HeadsMap | None = None,
    flag_heads: frozenset[str] | None = None,
    name: str = "the file",
) -> tuple[Probe, dict[str, Any]]:
    """Extract ``rows`` with ``extractor`` (only the probe's layers) and evaluate ``checkpoint``
    (``default``: the packaged default; with ``head``, that head alone). A multi-head probe,
    one head, or any probe with ``heads_map``: each row's ``label`` and ``labels`` read as
    :mod:`worker.offline.label_map` says, and rows that annotate no head are not extracted
    (``unannotated``); a multi-head probe's report adds ``policy``
    (:func:`probes.metrics.evaluate_policy` with ``flag_heads``). ``name``: the file, in
    error messages."""
    probe, manifest = load_for_eval(checkpoint, extractor.fingerprint)
    probe = for_head(probe, head)
    labels: FileLabels | None = None
    if isinstance(probe, HeadView) or probe.spec.heads or heads_map is not None:
        labels = read_file_labels(probe, row_names(rows), [r.id for r in rows], heads_map, name)
        targets = labels.targets
        order = labels.rows.tolist()  # the rows measured, in file order
    else:
        targets = _targets(probe, rows)
        order = list(range(len(rows)))
    probs, kept, skipped = [], [], {}
    weights = torch.zeros(len(probe.layers))
    for start in range(0, len(order), batch_size):
        chunk = [rows[i] for i in order[start : start + batch_size]]
        out = extractor.extract([r.text for r in chunk], list(probe.layers))
        skipped.update({chunk[p].id: reason for p, reason in out.errors.items()})
        if out.index:
            hidden = out.hidden.float()  # [L, B_ok, T, D]
            probs.append(probe.predict_proba_many(hidden, out.mask))
            weights += probe.layer_weights(hidden, out.mask) * len(out.index)
            kept += [start + p for p in out.index]
    if not kept:
        raise OfflineError("no row could be extracted")
    at = torch.tensor(kept)  # positions in ``order``
    all_probs = torch.cat(probs)
    report = evaluate(probe.spec, all_probs, targets[at])
    if labels is not None:
        report.update(labels.report(probe, all_probs, at, flag_heads))
    report.update(_layer_summary(probe, weights / len(kept)))
    report.update(checkpoint=str(checkpoint), probe=manifest.probe, version=manifest.version)
    report["skipped"] = skipped
    return probe, report


@dataclass(frozen=True)
class FileLabels:
    """A labeled file read for one probe (:func:`read_file_labels`).

    ``rows``: the file's rows that annotate what is measured (``[M]`` indices, file order);
    ``targets``: theirs in the measured probe's encoding (one head or a single-head probe:
    class indices or multi-hot; a multi-head probe: ``[M, C]`` with ``NaN`` for unknown);
    ``full``: theirs over the whole probe's labels; ``names``: their label names;
    ``total``: the file's rows; ``unread``: the file's label names no head reads."""

    rows: torch.Tensor
    targets: torch.Tensor
    full: torch.Tensor
    names: list[frozenset[str]]
    total: int
    unread: list[str]

    def report(
        self,
        probe: Probe,
        probs: torch.Tensor,
        at: torch.Tensor,
        flag_heads: frozenset[str] | None = None,
    ) -> dict[str, Any]:
        """What eval adds for the measured rows ``at`` (positions in ``rows``) with
        probabilities ``probs``: ``unannotated`` (the file's rows that annotate nothing),
        ``unread_labels``, and for a multi-head probe ``policy``
        (:func:`probes.metrics.evaluate_policy`), its benign rows' label names counted."""
        out: dict[str, Any] = {
            "unannotated": self.total - len(self.rows),
            "unread_labels": self.unread,
        }
        if isinstance(probe, HeadView) or not probe.spec.heads:
            return out
        full = self.full[at]
        policy = evaluate_policy(probe.spec, probs, full, flag_heads)
        where = benign_rows(probe.spec, full).nonzero().flatten().tolist()
        # Filled with update(): the metric-name check reads any Counter(...) call as a
        # Prometheus counter's definition (tests/unit/prometheus_helpers.py).
        counts: Counter[str] = Counter()
        counts.update(n for i in where for n in self.names[int(at[i])])
        policy["benign"]["labels"] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        out["policy"] = policy
        return out


def read_file_labels(
    probe: Probe,
    names: Sequence[frozenset[str]],
    ids: Sequence[str] | None = None,
    heads_map: HeadsMap | None = None,
    name: str = "the file",
) -> FileLabels:
    """The rows of a file (label names ``names``, see :func:`worker.offline.label_map.row_names`)
    that annotate ``probe`` and their targets, read as :mod:`worker.offline.label_map` says:
    a multi-head probe's rows that annotate some head; a :class:`HeadView`'s that annotate its
    head; a single-head probe (with ``heads_map``) is its one head."""
    whole = probe.whole if isinstance(probe, HeadView) else probe
    spec = whole.spec
    head = probe.head_name if isinstance(probe, HeadView) else None if spec.heads else spec.name
    vocab: set[str] = set().union(*names) if names else set()
    source = file_source_heads(spec, vocab, heads_map, head=head, name=name)
    full = source_targets(spec, source, names, ids)
    if head is not None:  # (``annotated`` takes every row of a single-head probe)
        keep = ~full[:, spec.head_columns(head)].isnan().any(dim=1)
    else:
        keep = torch.stack(list(annotated(spec, full).values())).any(dim=0)
    rows = keep.nonzero().flatten()
    if len(rows) == 0:
        mapped = sorted({n for m in source.heads.values() for n in m})
        raise OfflineError(
            f"no row of {name} annotates {f'head {head!r}' if head else 'any head'}: its "
            f"labels {sorted(vocab)} are none of those the map reads ({mapped})"
        )
    full = full[rows]
    if isinstance(probe, HeadView):
        targets = head_targets(spec, full, probe.head_name)
    elif not spec.heads and spec.task == "multiclass":
        targets = full.argmax(dim=1)
    else:
        targets = full
    return FileLabels(
        rows=rows,
        targets=targets,
        full=full,
        names=[names[i] for i in rows.tolist()],
        total=len(names),
        unread=unread_labels(source, vocab),
    )


def _targets(probe: Probe, rows: Sequence[LabeledText]) -> torch.Tensor:
    """A single-head probe's targets without a heads map: ``label`` for a multiclass probe,
    ``labels`` for a multilabel one."""
    multiclass = probe.spec.task == "multiclass"
    if any((r.label if multiclass else r.labels) is None for r in rows):
        field = "label" if multiclass else "labels"
        raise OfflineError(f"a {probe.spec.task} probe needs {field!r} on every row")
    label_sets = [[r.label] if multiclass and r.label else list(r.labels or []) for r in rows]
    try:
        return encode_targets(probe.spec, label_sets)
    except ProbeError as exc:
        hint = f"; say what they mean with --heads-map '{probe.spec.name}=LABEL:NAME,...'"
        raise OfflineError(f"{exc}{hint}") from exc


def _layer_summary(probe: Probe, weights: torch.Tensor) -> dict[str, Any]:
    from probes.probe import weight_entropy

    return {
        "layers": list(probe.layers),
        "layer_weights": [round(float(w), 6) for w in weights],
        "layer_entropy": weight_entropy(weights),
    }
