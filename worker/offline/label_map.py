"""Which rows of a labeled file are positives, negatives or unknown for each head of a probe
(what ``probeguard eval`` measures), and ``--heads-map`` for files whose labels name other
things.

A row's label names are its ``label`` and its ``labels`` together, as a set: ToxicChat's
``{"label": "toxic", "labels": ["toxic"]}`` names ``toxic`` once, OpenAI moderation's
``{"label": "flagged", "labels": ["sexual", "hate"]}`` names ``flagged``, ``sexual`` and
``hate``. The file's *vocabulary* is every name its rows carry.

Defaults, head by head: a head one of whose labels is in the vocabulary is *covered* by the
file, and every row annotates it: its positives are the head's labels the row names; a row
naming none is a negative (for a multiclass head, its one class that does not flag). So
OpenAI moderation's ``labels: []`` is a negative for every category the file names, and
ToxicChat's rows without ``jailbreaking`` are negatives for the jailbreak head. A head the
vocabulary does not name stays unknown on every row (a tweet corpus says nothing of
self-harm). ``head``: that head alone, covered whatever the vocabulary (``eval --head``).

A :class:`HeadsMap` (``--heads-map``, :func:`parse_heads_map`) says what the file's labels
mean for some heads; the others keep the defaults:

- inline, ``HEAD=[LABEL:]NAME[,NAME...]`` entries joined by ``;``:
  ``toxicity=toxic:flagged,unsafe;hate=hate``. The rows naming one of the ``NAME``\\ s are
  positives of the head's ``LABEL`` (omitted: the head's only label, or its only flag
  label), on top of the head's own label names; every other row is a negative. ``HEAD=``
  with no names covers the head with its own names alone. A head may recur.
- a JSON file (a path ending in ``.json``, or ``@PATH``): ``{head: {file label: [head
  labels]}}``, the form the default's recipe maps its datasets with (``Source.heads`` in
  :mod:`worker.offline.default_probe`): ``[]`` is a negative, and a row naming none of a
  head's file labels leaves the head unknown.
- ``recipe:DATASET``: the default's recipe's own map of that dataset (heads the probe lacks
  are skipped).

All three become a :class:`probes.offline.multitask.SourceHeads`, read by
:func:`probes.offline.multitask.multitask_targets` as the default's build reads its sources.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from probes.errors import ProbeError
from probes.offline.multitask import SourceHeads, multitask_targets
from schemas import HeadSpec, LabeledText, ProbeSpec
from worker.errors import OfflineError

__all__ = [
    "HeadsMap",
    "file_source_heads",
    "file_targets",
    "parse_heads_map",
    "row_names",
    "source_targets",
    "unread_labels",
]


@dataclass(frozen=True)
class HeadsMap:
    """What a file's label names mean for some heads (see the module docstring).

    ``heads``: head -> file label -> head labels (``None`` in an inline entry without
    ``LABEL:``, resolved against the probe); ``closed``: the heads whose rows naming none of
    their file labels are negatives (inline entries) rather than unknown (JSON, recipe);
    ``strict``: every head and file label must exist (inline and JSON; a recipe's map is
    written for the default's heads and for a whole dataset)."""

    heads: Mapping[str, Mapping[str, Sequence[str | None]]]
    closed: frozenset[str] = frozenset()
    strict: bool = True
    origin: str = "--heads-map"


def parse_heads_map(value: str) -> HeadsMap:
    """``--heads-map``'s value: inline entries, a JSON file, or ``recipe:DATASET``.

    Raises :class:`OfflineError` naming the entry, file or dataset that cannot be read."""
    text = value.strip()
    if text.startswith("recipe:"):
        return _recipe(text.removeprefix("recipe:").strip())
    if text.startswith("@") or text.endswith(".json"):
        return _json_file(Path(text.removeprefix("@")))
    return _inline(text)


def _inline(text: str) -> HeadsMap:
    heads: dict[str, dict[str, list[str | None]]] = {}
    entries = [e.strip() for e in text.split(";") if e.strip()]
    if not entries:
        raise OfflineError(f"--heads-map {text!r} has no entry: write HEAD=[LABEL:]NAME,...")
    for entry in entries:
        head, eq, rest = entry.partition("=")
        head = head.strip()
        if not eq or not head:
            raise OfflineError(
                f"--heads-map entry {entry!r} is not HEAD=[LABEL:]NAME,... (e.g. "
                "'toxicity=toxic:flagged')"
            )
        label: str | None = None
        if ":" in rest:
            label, _, rest = (x.strip() for x in rest.partition(":"))
            if not label:
                raise OfflineError(f"--heads-map entry {entry!r}: the LABEL before ':' is empty")
        names = [n.strip() for n in rest.split(",")]
        if any(not n for n in names) and rest.strip():
            raise OfflineError(f"--heads-map entry {entry!r} has an empty NAME")
        mapping = heads.setdefault(head, {})
        for n in (n for n in names if n):
            mapping.setdefault(n, []).append(label)
    return HeadsMap(heads, closed=frozenset(heads), origin="--heads-map")


def _json_file(path: Path) -> HeadsMap:
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise OfflineError(f"--heads-map: cannot read {str(path)!r}: {exc}") from exc
    except ValueError as exc:
        raise OfflineError(f"--heads-map: {path} is not JSON: {exc}") from exc
    shape = (
        "{head: {file label: [head labels]}}, e.g. "
        '{"toxicity": {"flagged": ["toxic"], "not-flagged": ["non-toxic"]}}'
    )
    if not isinstance(raw, dict) or not raw:
        raise OfflineError(f"--heads-map: {path} must hold {shape}")
    heads: dict[str, dict[str, list[str | None]]] = {}
    for head, mapping in raw.items():
        if not isinstance(mapping, dict):
            raise OfflineError(f"--heads-map: {path}: head {head!r} must map to {shape}")
        for name, labels in mapping.items():
            if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
                raise OfflineError(
                    f"--heads-map: {path}: {head!r} -> {name!r} must be a list of head "
                    f"labels ([] for a negative), got {labels!r}"
                )
        heads[head] = {name: list(labels) for name, labels in mapping.items()}
    return HeadsMap(heads, origin=str(path))


def _recipe(dataset: str) -> HeadsMap:
    from worker.offline.default_recipe import SOURCES

    by_name = {s.dataset: s for s in SOURCES}
    if dataset not in by_name:
        raise OfflineError(
            f"--heads-map recipe:{dataset}: the default's recipe has no dataset {dataset!r}; "
            f"its datasets: {sorted(by_name)}"
        )
    heads = {h: {n: list(x) for n, x in m.items()} for h, m in by_name[dataset].heads.items()}
    return HeadsMap(heads, strict=False, origin=f"recipe:{dataset}")


def row_names(rows: Sequence[LabeledText]) -> list[frozenset[str]]:
    """Each row's label names: its ``label`` and its ``labels``, as one set (what a
    hidden-state cache's ``row_labels`` gives for the same rows)."""
    return [frozenset(([r.label] if r.label else []) + list(r.labels or [])) for r in rows]


def _resolve(h: HeadSpec, spec: ProbeSpec, label: str | None, origin: str) -> str:
    if label is not None:
        if label not in h.labels:
            raise OfflineError(
                f"{origin}: {label!r} is not a label of head {h.name!r} {list(h.labels)}"
            )
        return label
    flags = [x for x in h.labels if x in spec.flag_labels]
    if len(h.labels) == 1:
        return h.labels[0]
    if len(flags) == 1:
        return flags[0]
    raise OfflineError(
        f"{origin}: head {h.name!r} has labels {list(h.labels)}: say which one, e.g. "
        f"'{h.name}={h.labels[-1]}:NAME'"
    )


def _identity(h: HeadSpec, vocab: set[str]) -> dict[str, list[str]]:
    """The default map of a covered head: its own label names are its positives, every
    other name of the file a negative."""
    return {n: [n] if n in h.labels else [] for n in sorted(vocab)}


def file_source_heads(
    spec: ProbeSpec,
    vocab: set[str],
    heads_map: HeadsMap | None = None,
    *,
    head: str | None = None,
    name: str = "the file",
) -> SourceHeads:
    """The :class:`SourceHeads` by which a file with label names ``vocab`` annotates
    ``spec``'s heads (only ``head`` when given; see the module docstring).

    Raises :class:`OfflineError` for a head the probe lacks, a head label it does not know,
    (inline and JSON maps) a file label no row carries, or when no head is annotated at
    all (the file's labels name none of the probe's)."""
    known = [h.name for h in spec.head_specs]
    given = dict(heads_map.heads) if heads_map is not None else {}
    origin = heads_map.origin if heads_map is not None else ""
    if heads_map is not None and not heads_map.strict:
        given = {h: m for h, m in given.items() if h in known}
    unknown_heads = [h for h in given if h not in known]
    if unknown_heads:
        raise OfflineError(
            f"{origin}: probe {spec.name!r} has no head {unknown_heads[0]!r}; its heads: {known}"
        )
    if head is not None and head not in known:
        raise OfflineError(f"probe {spec.name!r} has no head {head!r}; its heads: {known}")
    if heads_map is not None and heads_map.strict:
        absent = sorted({n for m in given.values() for n in m} - vocab)
        if absent:
            raise OfflineError(
                f"{origin} names label(s) {absent} that no row of {name} carries; its labels: "
                f"{sorted(vocab)}"
            )
    out: dict[str, dict[str, list[str]]] = {}
    for h in spec.head_specs:
        if head is not None and h.name != head:
            continue
        if h.name in given:
            assert heads_map is not None
            closed = h.name in heads_map.closed
            mapping = _identity(h, vocab) if closed else {}
            for n, labels in given[h.name].items():
                resolved = [_resolve(h, spec, x, origin) for x in labels]
                mapping[n] = sorted(set(mapping.get(n, [])) | set(resolved)) if closed else resolved
            out[h.name] = mapping
        elif head is not None or vocab & set(h.labels):
            out[h.name] = _identity(h, vocab)
    if not out:
        raise OfflineError(
            f"the labels of {name} {sorted(vocab)} name no label of the heads of probe "
            f"{spec.name!r} ({[x for h in spec.head_specs for x in h.labels]}); say what "
            "they mean with --heads-map HEAD=[LABEL:]NAME,... (e.g. 'toxicity=toxic:flagged')"
        )
    source = SourceHeads(name, out)
    try:
        source.check(spec)
    except ProbeError as exc:
        raise OfflineError(f"{origin}: {exc}") from exc
    return source


def source_targets(
    spec: ProbeSpec,
    source: SourceHeads,
    names: Sequence[frozenset[str]],
    ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """``[N, C]`` targets over ``spec.labels`` of rows labeled ``names`` by ``source``
    (:func:`probes.offline.multitask.multitask_targets`; errors name rows by ``ids``)."""
    try:
        return multitask_targets(spec, source, names, row_ids=ids)
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc


def file_targets(
    spec: ProbeSpec,
    names: Sequence[frozenset[str]],
    heads_map: HeadsMap | None = None,
    *,
    head: str | None = None,
    ids: Sequence[str] | None = None,
    name: str = "the file",
) -> torch.Tensor:
    """``[N, C]`` targets over ``spec.labels`` for rows labeled ``names`` (see
    :func:`row_names`), ``NaN`` where a row does not annotate a head: the defaults and
    ``heads_map`` of the module docstring, ``head`` alone when given.

    Raises :class:`OfflineError` as :func:`file_source_heads` does, and when a row maps to
    several classes of a multiclass head (naming the row by its id in ``ids``)."""
    vocab: set[str] = set().union(*names) if names else set()
    source = file_source_heads(spec, vocab, heads_map, head=head, name=name)
    return source_targets(spec, source, names, ids)


def unread_labels(source: SourceHeads, vocab: set[str]) -> list[str]:
    """The names of ``vocab`` no head reads as one of its labels (``flagged`` in OpenAI
    moderation, ``abusive`` in ConvAbuse without a map): what a ``--heads-map`` could
    give a meaning."""
    read = {n for m in source.heads.values() for n, labels in m.items() if labels}
    return sorted(vocab - read)
