"""Identity of the frozen LLM: hashes that decide whether a probe fits a model.

A checkpoint carries the :class:`schemas.LLMFingerprint` of the model it was trained on
(weights, tokenizer, layer count, hidden size); a scorer refuses a probe whose
fingerprint differs. These functions compute its parts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from probes.files import atomic_write
from worker.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["file_sha256", "state_dict_sha256", "tokenizer_sha256", "weights_sha256"]

log = logging.getLogger(__name__)


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of everything that decides token ids: vocab, merges, normalizer, special tokens.

    Padding and truncation settings are left out: they do not change any real token.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("padding", None)
        spec.pop("truncation", None)
    else:  # a tokenizer without a Rust backend: its vocab and special tokens
        spec = {
            "class": type(tokenizer).__name__,
            "vocab": sorted(tokenizer.get_vocab().items()),
            "special": sorted(tokenizer.all_special_tokens),
        }
    canonical = json.dumps(spec, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def state_dict_sha256(model: nn.Module) -> str:
    """Hash of the parameter names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_sha256(files: Iterable[Path], *, memo_dir: Path | None = None) -> str:
    """sha256 of the one weight file, or of the ``sha256sum``-style listing of several.

    The listing is ``"{sha256}  {file name}\\n"`` per file, sorted by name, so the value can be
    reproduced with ``sha256sum *.safetensors | sha256sum``.
    """
    files = sorted(files, key=lambda p: p.name)
    if not files:
        raise ModelLoadError("no weight files to hash")
    try:
        sums = [file_sha256(f, memo_dir=memo_dir) for f in files]
    except OSError as exc:
        raise ModelLoadError(f"cannot read weight file: {exc}") from exc
    if len(files) == 1:
        return sums[0]
    listing = "".join(f"{s}  {f.name}\n" for s, f in zip(sums, files, strict=True))
    return hashlib.sha256(listing.encode()).hexdigest()


def file_sha256(path: Path, *, memo_dir: Path | None = None) -> str:
    """sha256 of a file's bytes, memoised in ``memo_dir`` (when given) by real path, size
    and mtime; ``OSError`` when the file cannot be read."""
    real = path.resolve()
    stat = real.stat()
    key = hashlib.sha256(f"{real}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    memo = memo_dir / key if memo_dir is not None else None
    if memo is not None and memo.is_file():
        cached = memo.read_text().strip()
        if len(cached) == 64:
            return cached
    digest = hashlib.sha256()
    with real.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    value = digest.hexdigest()
    if memo is not None:
        try:
            atomic_write(memo, value)
        except OSError as exc:
            log.debug("cannot memoise the hash of %s: %s", path, exc)
    return value
