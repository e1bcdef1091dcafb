"""`cache build` on a tiny random LLM: layout, consistency, resumption, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from probes.errors import CacheError
from probes.kinds.pooling import masked_max, masked_mean
from probes.offline.cache import HiddenStateCache, shard_path
from tests.unit.offline_helpers import tiny_extractor, write_labeled
from worker.errors import OfflineError
from worker.offline.build_cache import build_cache, default_token_layers


@pytest.fixture(scope="module")
def extractor():
    return tiny_extractor()


def test_default_token_layers() -> None:
    assert default_token_layers(4) == [1, 2, 3, 4]
    assert default_token_layers(30) == [4, 8, 11, 15, 19, 22, 26, 30]
    assert len(default_token_layers(80)) == 8


def test_layout_targets_and_summaries(tmp_path, extractor) -> None:
    data = write_labeled(tmp_path / "d.jsonl", 21)
    m = build_cache(
        data, tmp_path / "c", extractor, token_layers=[2, 4], shard_rows=8, progress=False
    )
    assert m.num_shards == 3 and m.summary_layers == [0, 1, 2, 3, 4]
    assert (m.label_vocab, m.labels_vocab) == (["ok", "toxic"], ["hate", "insult"])
    cache = HiddenStateCache(tmp_path / "c")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    tokens = cache.dataset("tokens", [2, 4], "label")
    assert tokens.ids == [r["id"] for r in rows]
    assert tokens.targets.tolist() == [int(r["label"] == "toxic") for r in rows]
    multi = cache.dataset("mean", [4], "labels")
    assert multi.targets[:, 1].tolist() == [float(r["label"] == "toxic") for r in rows]
    # Summaries were taken in fp32 before the cast; recomputing them from fp16 tokens agrees.
    hidden, mask, _ = tokens.batch(torch.arange(len(tokens)))
    assert mask is not None
    for kind, pool in (("mean", masked_mean), ("max", masked_max)):
        summary = cache.dataset(kind, [2, 4], "label").summaries.float()  # type: ignore[arg-type, union-attr]
        torch.testing.assert_close(summary, pool(hidden, mask), atol=2e-2, rtol=1e-2)
    # Lengths are the extractor's token counts: <s> + one per character, cut at max_tokens.
    assert tokens.lengths.tolist() == [min(64, len(r["text"]) + 1) for r in rows]


def test_interrupted_build_resumes_to_identical_shards(tmp_path, extractor) -> None:
    data = write_labeled(tmp_path / "d.jsonl", 26)
    build_cache(data, tmp_path / "whole", extractor, shard_rows=8, batch_size=4, progress=False)

    calls = {"n": 0}
    real_extract = extractor.extract

    def flaky(texts, layers):
        calls["n"] += 1
        if calls["n"] == 6:  # the second call of the third shard (two calls per shard)
            raise KeyboardInterrupt
        return real_extract(texts, layers)

    extractor.extract = flaky
    try:
        with pytest.raises(KeyboardInterrupt):
            build_cache(
                data, tmp_path / "part", extractor, shard_rows=8, batch_size=4, progress=False
            )
    finally:
        del extractor.extract
    part = tmp_path / "part"
    assert [shard_path(part, k).exists() for k in range(4)] == [True, True, False, False]
    with pytest.raises(CacheError, match="incomplete: 2 of 4 shards missing"):
        HiddenStateCache(part).dataset("mean", [1], "label")
    (part / ".shard-00002.safetensors.x.tmp").write_bytes(b"half a shard")  # a crash's leftover

    build_cache(data, part, extractor, shard_rows=8, batch_size=4, progress=False)
    assert not list(part.glob(".*.tmp"))
    for k in range(4):  # (bytes may differ: safetensors orders header metadata by a hash map)
        assert _shard(shard_path(part, k)) == _shard(shard_path(tmp_path / "whole", k))


def _shard(path):
    with safe_open(path, framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        return f.metadata(), {
            k: (t.dtype, t.shape, t.numpy().tobytes()) for k, t in tensors.items()
        }


def test_resume_refuses_a_different_build(tmp_path, extractor) -> None:
    data = write_labeled(tmp_path / "d.jsonl", 10)
    build_cache(data, tmp_path / "c", extractor, shard_rows=8, progress=False)
    with pytest.raises(OfflineError, match="token_layers"):
        build_cache(data, tmp_path / "c", extractor, token_layers=[1], shard_rows=8, progress=False)


def test_resume_takes_the_same_file_by_another_path_but_not_other_content(
    tmp_path, extractor, monkeypatch
) -> None:
    # `--data-root ../shared/data` then `/abs/shared/data`: the same rows, so the same cache.
    data = write_labeled(tmp_path / "d.jsonl", 10)
    build_cache(data, tmp_path / "c", extractor, shard_rows=8, progress=False)
    monkeypatch.chdir(tmp_path)
    m = build_cache(Path("d.jsonl"), tmp_path / "c", extractor, shard_rows=8, progress=False)
    assert m.source.path == str(data)  # the manifest kept is the one the cache was built by
    data.write_text(data.read_text().replace("toxic", "ok", 1))
    with pytest.raises(OfflineError, match=r"differs in \['source'\]"):
        build_cache(data, tmp_path / "c", extractor, shard_rows=8, progress=False)


def test_rows_the_extractor_rejects_are_recorded(tmp_path, extractor) -> None:
    data = write_labeled(tmp_path / "d.jsonl", 6, multilabel=False)
    lines = data.read_text().splitlines()
    lines[2] = json.dumps({"id": "bad", "text": "\x00\x01\x02", "label": "ok"})
    data.write_text("\n".join(lines) + "\n")
    build_cache(data, tmp_path / "c", extractor, shard_rows=4, progress=False)
    cache = HiddenStateCache(tmp_path / "c")
    assert list(cache.errors()) == [2] and "empty" in cache.errors()[2]
    ds = cache.dataset("last", [4], "label")
    assert len(ds) == 5 and "bad" not in ds.ids
    with pytest.raises(CacheError, match="no 'labels' field"):
        cache.dataset("last", [4], "labels")


def test_bad_input_lines_are_named(tmp_path, extractor) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "fine", "label": "ok"}\n{"id": "b", "text": "x"}\n')
    with pytest.raises(OfflineError, match=r"bad.jsonl:2: .*label"):
        build_cache(bad, tmp_path / "c", extractor, progress=False)


def test_bf16_caches_hold_what_fp16_cannot(tmp_path, extractor) -> None:
    # Gemma 3's residual stream reaches |h| ~ 1e5 in its middle layers: fp16 (max 65504)
    # refuses such a shard and names the fix; a bf16 cache stores it, finite and close.
    from probes.offline.cache import shard_tensors

    data = write_labeled(tmp_path / "d.jsonl", 6)
    fp16 = build_cache(data, tmp_path / "a", extractor, token_layers=[2], progress=False)
    bf16 = build_cache(
        data, tmp_path / "b", extractor, token_layers=[2], progress=False, dtype="bfloat16"
    )
    assert (fp16.dtype, bf16.dtype) == ("float16", "bfloat16")
    layers = list(range(5))
    hidden = torch.randn(5, 2, 3, extractor.fingerprint.hidden_size)  # [L, B, T, D]
    hidden[2, 1, 0, 0] = 1.2e5
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(CacheError, match=r"layer 2 holds .*PROBEGUARD_STATE_DTYPE=bfloat16"):
        shard_tensors(hidden, mask, layers, fp16)
    stored = shard_tensors(hidden, mask, layers, bf16)
    assert stored["tokens"].dtype == torch.bfloat16 and torch.isfinite(stored["tokens"]).all()
    assert float(stored["summary.max"][2, 1, 0]) == pytest.approx(1.2e5, rel=1e-2)
    tokens = HiddenStateCache(tmp_path / "b").dataset("tokens", [2], "label")
    assert tokens.tokens is not None and tokens.tokens.dtype == torch.bfloat16
    with pytest.raises(OfflineError, match="dtype"):  # resuming as another dtype is refused
        build_cache(data, tmp_path / "b", extractor, token_layers=[2], progress=False)


def test_a_shard_stored_in_another_dtype_than_its_manifest_is_refused(tmp_path, extractor) -> None:
    data = write_labeled(tmp_path / "d.jsonl", 6)
    build_cache(data, tmp_path / "c", extractor, token_layers=[2], progress=False)
    manifest = tmp_path / "c" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"float16"', '"bfloat16"'))
    with pytest.raises(CacheError, match=r"stores tokens as torch\.float16, the manifest says"):
        HiddenStateCache(tmp_path / "c").dataset("tokens", [2], "label")
