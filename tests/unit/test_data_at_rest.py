"""Data at rest: what probeguard writes is owner-only.

Every test here runs under ``umask 000``: a file or directory left to the umask would be
world-readable (0666 / 0777), so an explicit mode is the only way these pass.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from probes import build_probe, save_checkpoint
from probes.files import atomic_write, open_private, private_dir
from tests.registry_helpers import toxicity_spec
from tests.tiny_llm import make_tiny_llm
from tests.unit.offline_helpers import tiny_extractor, write_labeled
from worker.llm.load import _write_cache_entry
from worker.offline.build_cache import build_cache
from worker.plots import plot_layer_weights


@pytest.fixture(autouse=True)
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def extractor():
    return tiny_extractor()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def assert_owner_only(root: Path) -> None:
    """``root`` and everything under it: directories 0700, files 0600."""
    assert mode(root) == 0o700, root
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            assert mode(Path(dirpath, name)) == 0o700, Path(dirpath, name)
        for name in files:
            assert mode(Path(dirpath, name)) == 0o600, Path(dirpath, name)


# --- owner-only files -------------------------------------------------------------------


def test_helpers_set_modes_whatever_the_umask_and_leave_existing_directories(
    tmp_path: Path,
) -> None:
    mine = tmp_path / "user-dir"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    atomic_write(mine / "a" / "b" / "f.json", "{}")
    assert mode(mine) == 0o755  # the user's directory keeps its mode
    assert_owner_only(mine / "a")
    # Replacing a file that was world-readable leaves it owner-only.
    old = mine / "old.txt"
    old.write_text("x")
    os.chmod(old, 0o644)
    atomic_write(old, b"y")
    assert mode(old) == 0o600
    log = mine / "service.log"
    log.write_text("x")
    os.chmod(log, 0o666)
    with open_private(log) as fh:
        fh.write(b"new")
    assert mode(log) == 0o600 and log.read_bytes() == b"new"
    assert private_dir(mine / "a") == mine / "a"
    with pytest.raises(NotADirectoryError):
        private_dir(old)


def test_a_cache_build_is_owner_only(tmp_path: Path, extractor) -> None:
    data = write_labeled(tmp_path / "d.jsonl", 10)
    build_cache(data, tmp_path / "new" / "cache", extractor, shard_rows=4, progress=False)
    assert_owner_only(tmp_path / "new")


def test_checkpoints_plots_and_the_llm_cache_are_owner_only(tmp_path: Path) -> None:
    llm = make_tiny_llm()
    probe = build_probe(toxicity_spec(llm.fingerprint.hidden_size), seed=0)
    save_checkpoint(probe, tmp_path / "runs" / "ckpt", llm=llm.fingerprint)
    assert_owner_only(tmp_path / "runs")
    plot_layer_weights([1, 2], [0.4, 0.6], tmp_path / "report" / "w.png", title="t")
    assert_owner_only(tmp_path / "report")
    # The dequantized-GGUF cache entry: config, weights and tokenizer that transformers and
    # safetensors write with default modes are made owner-only before the entry goes live.
    entry = tmp_path / "cache" / "llm" / "gguf-0123"
    _write_cache_entry(entry, llm.model, llm.tokenizer, "0" * 64, "model.gguf")
    assert (entry / "model.safetensors").is_file()
    assert_owner_only(tmp_path / "cache")
