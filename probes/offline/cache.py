"""Hidden-state cache on disk: a manifest plus safetensors shards (fp16 unless the manifest
says bf16 or fp32).

Layout of a cache directory::

    manifest.json              schemas.CacheManifest (written before the first shard)
    shard-00000.safetensors    rows [0, shard_rows) of the source file
    shard-00001.safetensors    ...

Tensors of one shard (``B`` rows extracted, ``n`` their real tokens in total):

    row            int64 [B]         row positions in the source file
    length         int64 [B]         real tokens per row (the mask, run-length coded)
    label          int64 [B]         index into manifest.label_vocab, -1 when absent
    labels         uint8 [B, C]      multi-hot over manifest.labels_vocab (if the file has labels)
    tokens         dtype [n, Lt, D]  real tokens of token_layers, row after row (no padding)
    summary.<kind> dtype [Ls, B, D]  per-layer mean/max/first/last over real tokens

Shard metadata: ``ids`` (JSON list) and ``errors`` (JSON object: source row ->
reason) for rows the extractor could not process. A shard file appears
atomically (write to a temporary name, then rename), so a shard that exists
is complete: an interrupted build resumes at the first missing shard.

Owner-only: files ``0600``, the directories a build creates ``0700`` (``probes.files``).
Encrypted at rest when built with a key (``PROBEGUARD_CACHE_KEY``): each shard file then
holds its safetensors bytes sealed with AES-256-GCM (``probes.offline.sealed``), the
manifest says so and names the key's fingerprint, and reading it needs the same key. A
plaintext cache reads without one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, Protocol

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from probes.errors import CacheError
from probes.files import atomic_write, private_dir
from probes.kinds.pooling import SUMMARIES
from probes.offline.dataset import ProbeDataset
from probes.offline.sealed import KEY_SETTING, CacheKey
from schemas import CacheEncryption, CacheManifest, Task, describe_error

__all__ = [
    "MANIFEST",
    "HiddenStateCache",
    "concat_batches",
    "encryption_for",
    "features_for",
    "shard_path",
    "shard_tensors",
    "write_manifest",
    "write_shard",
]

MANIFEST = "manifest.json"


def shard_path(directory: Path, k: int) -> Path:
    return directory / f"shard-{k:05d}.safetensors"


def write_manifest(directory: Path, manifest: CacheManifest) -> None:
    private_dir(directory)
    atomic_write(directory / MANIFEST, manifest.encode())


def encryption_for(key: bytes | None) -> CacheEncryption | None:
    """What a manifest records of a cache built with ``key`` (None: not encrypted)."""
    return None if key is None else CacheEncryption(key_fingerprint=CacheKey(key).fingerprint)


def _shard_aad(manifest_bytes: bytes, k: int) -> bytes:
    """What an encrypted shard is bound to: its index and its cache's manifest bytes."""
    manifest = hashlib.sha256(manifest_bytes).hexdigest()
    return f"probeguard-hidden-cache/shard-{k:05d}/manifest-sha256:{manifest}".encode()


def _stored(name: str, t: Tensor, layers: list[int], layer_dim: int, dtype: str) -> Tensor:
    """Cast to the cache's ``dtype``, refusing values it cannot hold (they would become inf)."""
    to = getattr(torch, dtype)
    limit = torch.finfo(to).max
    big = t.abs().amax(dim=[d for d in range(t.dim()) if d != layer_dim])  # [L]
    if (big > limit).any() or not torch.isfinite(big).all():
        bad = int(big.argmax())
        hint = " (store bfloat16: PROBEGUARD_STATE_DTYPE=bfloat16)" if dtype == "float16" else ""
        raise CacheError(
            f"{name}: layer {layers[bad]} holds |value| {float(big[bad]):.4g}, "
            f"beyond {dtype}'s {limit:.6g}{hint}"
        )
    return t.to(to)


def shard_tensors(
    hidden: Tensor,
    mask: Tensor,
    layers: list[int],
    manifest: CacheManifest,
) -> dict[str, Tensor]:
    """Cacheable tensors of one extracted batch: ``hidden [L, B, T, D]`` for ``layers``."""
    pos = {layer: i for i, layer in enumerate(layers)}
    out: dict[str, Tensor] = {"length": mask.sum(dim=1).long()}
    if manifest.token_layers:
        sel = hidden[[pos[i] for i in manifest.token_layers]]  # [Lt, B, T, D]
        tokens = sel.permute(1, 2, 0, 3)[mask]  # [n, Lt, D], row-major over the mask
        out["tokens"] = _stored("tokens", tokens, manifest.token_layers, 1, manifest.dtype)
    if manifest.summary_layers:
        sel = hidden[[pos[i] for i in manifest.summary_layers]]  # [Ls, B, T, D]
        for kind in manifest.summaries:
            summary = SUMMARIES[kind](sel, mask)  # [Ls, B, D]
            out[f"summary.{kind}"] = _stored(
                kind, summary, manifest.summary_layers, 0, manifest.dtype
            )
    return out


def concat_batches(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Join per-batch tensors of :func:`shard_tensors` along the row axis."""
    if not parts:
        return {}
    out: dict[str, Tensor] = {}
    for key in parts[0]:
        dim = 1 if key.startswith("summary.") else 0
        out[key] = torch.cat([p[key] for p in parts], dim=dim)
    return out


def write_shard(
    directory: Path,
    k: int,
    tensors: dict[str, Tensor],
    ids: list[str],
    errors: dict[int, str],
    key: bytes | None = None,
) -> None:
    """Write shard ``k`` atomically. ``tensors`` must hold ``row``, ``length`` and ``label``.

    With ``key`` it is encrypted, bound to the ``manifest.json`` already in ``directory``.
    """
    for name in ("row", "length", "label"):
        if name not in tensors:
            raise CacheError(f"shard {k} lacks the {name!r} tensor")
    metadata = {
        "ids": json.dumps(ids),
        "errors": json.dumps({str(r): e for r, e in errors.items()}),
    }
    blob = st_save({name: t.contiguous() for name, t in tensors.items()}, metadata=metadata)
    if key is not None:
        blob = CacheKey(key).seal(blob, _shard_aad((directory / MANIFEST).read_bytes(), k))
    atomic_write(shard_path(directory, k), blob)


Features = Literal["tokens", "mean", "max", "first", "last"]


def features_for(pool: str, layers: list[int], available: CacheManifest) -> Features:
    """What a probe with token pool ``pool`` reading ``layers`` trains on: its own summary
    when the cache holds it for those layers, else token-level states."""
    if pool in available.summaries and set(layers) <= set(available.summary_layers):
        return pool
    return "tokens"


class _Shard(Protocol):
    """What the reader uses of an open shard: a safetensors ``safe_open`` handle, or
    :class:`_DecryptedShard`."""

    def metadata(self) -> dict[str, str]: ...
    def get_tensor(self, name: str) -> Tensor: ...


class _DecryptedShard:
    """A decrypted shard's safetensors bytes, read like a ``safe_open`` handle."""

    def __init__(self, blob: bytes) -> None:
        size = int.from_bytes(blob[:8], "little")
        self._metadata: dict[str, str] = json.loads(blob[8 : 8 + size]).get("__metadata__", {})
        self._tensors = st_load(blob)

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def get_tensor(self, name: str) -> Tensor:
        return self._tensors[name]


class HiddenStateCache:
    """Read side of a cache directory (see the module docstring).

    ``key``: the secret an encrypted cache was built with (``PROBEGUARD_CACHE_KEY``); an
    encrypted cache is refused without it or with another, a plaintext one ignores it.
    """

    def __init__(self, directory: str | os.PathLike[str], key: bytes | None = None) -> None:
        self.directory = Path(directory)
        try:
            raw = (self.directory / MANIFEST).read_bytes()
        except OSError as exc:
            raise CacheError(f"{str(self.directory)!r} is not a cache: {exc}") from exc
        try:
            self.manifest = CacheManifest.decode(raw)
        except ValidationError as exc:
            raise CacheError(
                f"invalid cache manifest in {self.directory}: {describe_error(exc)[1]}"
            ) from exc
        self._raw_manifest = raw  # what encrypted shards are authenticated against
        self._key = self._check_key(key)

    def _check_key(self, key: bytes | None) -> CacheKey | None:
        sealed = self.manifest.encryption
        if sealed is None:
            return None
        where = f"cache {str(self.directory)!r} is encrypted ({sealed.algorithm}"
        if key is None:
            raise CacheError(
                f"{where}, key fingerprint {sealed.key_fingerprint}): set {KEY_SETTING} "
                "to the key it was built with"
            )
        cache_key = CacheKey(key)
        if cache_key.fingerprint != sealed.key_fingerprint:
            raise CacheError(
                f"{where}) with another key (fingerprint {sealed.key_fingerprint}) than "
                f"{KEY_SETTING} (fingerprint {cache_key.fingerprint})"
            )
        return cache_key

    @contextmanager
    def _shard(self, k: int) -> Iterator[_Shard]:
        """Shard ``k`` open for reading (decrypted and authenticated if encrypted)."""
        path, what = shard_path(self.directory, k), f"shard {k} of {self.directory}"
        try:
            if self._key is not None:
                aad = _shard_aad(self._raw_manifest, k)
                blob = self._key.open(path.read_bytes(), aad, what)
                handle = None
            else:
                handle = safe_open(path, framework="pt")
        except (OSError, SafetensorError) as exc:
            raise CacheError(f"{what} is unreadable: {exc}") from exc
        if handle is None:
            yield _DecryptedShard(blob)
            return
        with handle as f:
            yield f

    def missing_shards(self) -> list[int]:
        return [
            k for k in range(self.manifest.num_shards) if not shard_path(self.directory, k).exists()
        ]

    def _check_complete(self) -> None:
        missing = self.missing_shards()
        if missing:
            raise CacheError(
                f"cache {str(self.directory)!r} is incomplete: {len(missing)} of "
                f"{self.manifest.num_shards} shards missing (first {missing[:5]}); "
                "run `probeguard cache build` again to resume"
            )

    def errors(self) -> dict[int, str]:
        """Source rows the extractor skipped, with the reason."""
        out: dict[int, str] = {}
        for k in range(self.manifest.num_shards):
            with self._shard(k) as f:
                out.update({int(r): e for r, e in json.loads(f.metadata()["errors"]).items()})
        return out

    def row_labels(self) -> list[frozenset[str]]:
        """Every cached row's label names: its ``label`` and its ``labels``, in row order
        (what a multi-task recipe maps onto heads; see :mod:`probes.offline.multitask`)."""
        m = self.manifest
        self._check_complete()
        out: list[frozenset[str]] = []
        for k in range(m.num_shards):
            with self._shard(k) as f:
                label = f.get_tensor("label").tolist()
                hot = f.get_tensor("labels").bool() if m.has_labels_field else None
            for i, li in enumerate(label):
                names = {m.label_vocab[li]} if li >= 0 else set()
                if hot is not None:
                    names |= {m.labels_vocab[j] for j in hot[i].nonzero().flatten().tolist()}
                out.append(frozenset(names))
        return out

    def dataset(
        self,
        features: Features,
        layers: list[int],
        target: Literal["label", "labels"] = "label",
    ) -> ProbeDataset:
        """Load ``features`` of ``layers`` for every cached row, with ``target`` as targets."""
        m = self.manifest
        self._check_complete()
        stored = m.token_layers if features == "tokens" else m.summary_layers
        if features != "tokens" and features not in m.summaries:
            raise CacheError(f"cache has summaries {m.summaries}, not {features!r}; use tokens")
        missing = sorted(set(layers) - set(stored))
        if missing:
            raise CacheError(
                f"cache stores {features} for layers {stored}; layers {missing} are missing"
            )
        if target == "labels" and not m.has_labels_field:
            raise CacheError(
                "the cached file has no 'labels' field: multilabel targets unavailable"
            )
        pick = torch.tensor([stored.index(i) for i in layers])
        key = "tokens" if features == "tokens" else f"summary.{features}"
        parts, lengths, targets, ids = [], [], [], []
        for k in range(m.num_shards):
            with self._shard(k) as f:
                ids += json.loads(f.metadata()["ids"])
                lengths.append(f.get_tensor("length"))
                targets.append(f.get_tensor(target))
                data = f.get_tensor(key)
                if data.dtype != getattr(torch, m.dtype):
                    raise CacheError(
                        f"shard {k} of {self.directory} stores {key} as {data.dtype}, "
                        f"the manifest says {m.dtype}"
                    )
                parts.append(data[:, pick] if features == "tokens" else data[pick])
        length = torch.cat(lengths)
        task: Task
        if target == "label":
            y = torch.cat(targets)
            if (y < 0).any():
                raise CacheError("some cached rows have no 'label': multiclass targets unavailable")
            names, task = list(m.label_vocab), "multiclass"
        else:
            y, names, task = torch.cat(targets).float(), list(m.labels_vocab), "multilabel"
        if features == "tokens":
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), length.cumsum(0)])
            return ProbeDataset(
                layers, names, task, y, ids, tokens=torch.cat(parts), offsets=offsets
            )
        return ProbeDataset(layers, names, task, y, ids, summaries=torch.cat(parts, dim=1))
