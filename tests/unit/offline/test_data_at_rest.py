"""Data at rest: what probeguard writes is owner-only, and caches can be encrypted.

Every test here runs under ``umask 000``: a file or directory left to the umask would be
world-readable (0666 / 0777), so an explicit mode is the only way these pass.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open

from probes import build_probe, save_checkpoint
from probes.errors import CacheError
from probes.files import atomic_write, open_private, private_dir
from probes.offline.cache import MANIFEST, HiddenStateCache, shard_path
from probes.offline.sealed import MAGIC, CacheKey
from tests.registry_helpers import toxicity_spec
from tests.unit.offline_helpers import tiny_extractor, write_labeled
from worker.cli import main
from worker.errors import OfflineError
from worker.llm.load import _write_cache_entry
from worker.llm.tiny import make_tiny_llm
from worker.offline.build_cache import build_cache
from worker.plots import plot_layer_weights
from worker.settings import Settings

KEY = b"correct horse battery staple, 32+"
OTHER = b"another key of at least 16 bytes"


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


# --- encrypted caches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, extractor) -> dict[str, Path]:
    """The same labeled file cached in plaintext and encrypted with ``KEY``."""
    root = tmp_path_factory.mktemp("sealed")
    data = write_labeled(root / "d.jsonl", 21)
    out = {"data": data}
    for name, key in (("plain", None), ("sealed", KEY)):
        build_cache(
            data, root / name, extractor, token_layers=[2, 4], shard_rows=8, progress=False, key=key
        )
        out[name] = root / name
    return out


def copy_of(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_an_encrypted_cache_round_trips(built: dict[str, Path]) -> None:
    plain, sealed = HiddenStateCache(built["plain"]), HiddenStateCache(built["sealed"], key=KEY)
    assert sealed.manifest.encryption is not None
    assert sealed.manifest.encryption.algorithm == "AES-256-GCM"
    assert sealed.manifest.encryption.key_fingerprint == CacheKey(KEY).fingerprint
    for features, layers in (("tokens", [2, 4]), ("mean", [0, 4])):
        a = plain.dataset(features, layers, "labels")  # type: ignore[arg-type]
        b = sealed.dataset(features, layers, "labels")  # type: ignore[arg-type]
        assert a.ids == b.ids and torch.equal(a.targets, b.targets)
        for x, y in ((a.tokens, b.tokens), (a.summaries, b.summaries)):
            assert (x is None and y is None) or torch.equal(x, y)  # type: ignore[arg-type]
    assert plain.row_labels() == sealed.row_labels() and plain.errors() == sealed.errors()
    # The key is nowhere on disk; the shards are not safetensors any more.
    manifest = (built["sealed"] / MANIFEST).read_bytes()
    assert KEY not in manifest and KEY.hex().encode() not in manifest
    blob = shard_path(built["sealed"], 0).read_bytes()
    assert blob.startswith(MAGIC) and b"dtype" not in blob and b'"ids"' not in blob
    assert_owner_only(built["sealed"])


def test_a_missing_or_wrong_key_is_refused_naming_the_setting(built: dict[str, Path]) -> None:
    fingerprint = CacheKey(KEY).fingerprint
    with pytest.raises(CacheError, match="PROBEGUARD_CACHE_KEY") as missing:
        HiddenStateCache(built["sealed"])
    assert "encrypted" in str(missing.value) and fingerprint in str(missing.value)
    with pytest.raises(CacheError, match="another key") as wrong:
        HiddenStateCache(built["sealed"], key=OTHER)
    assert "PROBEGUARD_CACHE_KEY" in str(wrong.value)
    assert CacheKey(OTHER).fingerprint in str(wrong.value)
    with pytest.raises(CacheError, match="at least 16 bytes"):
        HiddenStateCache(built["sealed"], key=b"short")


@pytest.mark.parametrize("how", ["flip a byte", "truncate", "swap shards", "edit the manifest"])
def test_a_tampered_cache_is_refused(built: dict[str, Path], tmp_path: Path, how: str) -> None:
    cache = copy_of(built["sealed"], tmp_path / "c")
    first, second = shard_path(cache, 0), shard_path(cache, 1)
    if how == "flip a byte":
        blob = bytearray(first.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        first.write_bytes(bytes(blob))
    elif how == "truncate":
        first.write_bytes(first.read_bytes()[:-1])
    elif how == "swap shards":
        a, b = first.read_bytes(), second.read_bytes()
        first.write_bytes(b)
        second.write_bytes(a)
    else:  # still a valid manifest, with the class names exchanged
        text = (cache / MANIFEST).read_text()
        (cache / MANIFEST).write_text(text.replace('"ok","toxic"', '"toxic","ok"'))
        assert (cache / MANIFEST).read_text() != text
    reader = HiddenStateCache(cache, key=KEY)
    with pytest.raises(CacheError, match="fails authentication"):
        reader.dataset("mean", [4], "label")


def test_a_plaintext_cache_is_unchanged_and_loads_with_or_without_a_key(
    built: dict[str, Path],
) -> None:
    manifest = json.loads((built["plain"] / MANIFEST).read_bytes())
    assert "encryption" not in manifest  # byte for byte what readers before this knew
    with safe_open(shard_path(built["plain"], 0), framework="pt") as f:
        assert f.get_tensor("tokens").dim() == 3
    a = HiddenStateCache(built["plain"]).dataset("mean", [4], "label")
    b = HiddenStateCache(built["plain"], key=KEY).dataset("mean", [4], "label")
    assert torch.equal(a.summaries, b.summaries)  # type: ignore[arg-type]


def test_resuming_needs_the_same_key(built: dict[str, Path], tmp_path: Path, extractor) -> None:
    sealed = copy_of(built["sealed"], tmp_path / "sealed")
    shard_path(sealed, 2).unlink()  # an interrupted build
    kw = {"token_layers": [2, 4], "shard_rows": 8, "progress": False}
    for key, match in ((None, "PROBEGUARD_CACHE_KEY"), (OTHER, "another key")):
        with pytest.raises(OfflineError, match=match):
            build_cache(built["data"], sealed, extractor, key=key, **kw)  # type: ignore[arg-type]
    build_cache(built["data"], sealed, extractor, key=KEY, **kw)  # type: ignore[arg-type]
    assert len(HiddenStateCache(sealed, key=KEY).dataset("mean", [4], "label")) == 21
    plain = copy_of(built["plain"], tmp_path / "plain")
    with pytest.raises(OfflineError, match="encryption"):
        build_cache(built["data"], plain, extractor, key=KEY, **kw)  # type: ignore[arg-type]


def test_the_setting_is_a_secret_of_at_least_16_bytes() -> None:
    settings = Settings(cache_key=KEY.decode())
    assert settings.cache_key_bytes == KEY and KEY.decode() not in repr(settings)
    assert Settings(cache_key=None).cache_key_bytes is None
    with pytest.raises(ValidationError, match="cache_key must be at least 16 bytes"):
        Settings(cache_key="too short")


def test_the_cli_encrypts_when_the_setting_is_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tiny_llm(tmp_path)
    data = write_labeled(tmp_path / "d.jsonl", 40)
    monkeypatch.setenv("PROBEGUARD_MODEL", str(tmp_path / "tiny-llama-0"))
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(tmp_path / "model-cache"))
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "64")
    monkeypatch.setenv("PROBEGUARD_CACHE_KEY", KEY.decode())
    out = tmp_path / "work"
    build = ["cache", "build", "--data", str(data), "--out", str(out / "cache"), "--no-progress"]
    assert main(build) == 0
    assert HiddenStateCache(out / "cache", key=KEY).manifest.encryption is not None
    fit = ["fit", "--cache", str(out / "cache"), "--pool", "mean", "--epochs", "2"]
    assert main([*fit, "--out", str(out / "ckpt"), "--json"]) == 0
    assert (out / "ckpt" / "fit-report.json").is_file()
    assert_owner_only(out)
    assert_owner_only(tmp_path / "model-cache")  # the LLM's weight hashes

    monkeypatch.delenv("PROBEGUARD_CACHE_KEY")
    capsys.readouterr()
    assert main(["cache", "info", str(out / "cache")]) == 1
    err = capsys.readouterr().err
    assert "encrypted" in err and "PROBEGUARD_CACHE_KEY" in err
