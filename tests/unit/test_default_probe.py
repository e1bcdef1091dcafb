"""The packaged default's recipe end to end on a tiny random LLM and tiny stand-ins of the
recipe's datasets: caches, the multi-head fit, the data card, licenses kept apart."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from probes import load_checkpoint
from probes.offline.fit import FitConfig
from tests.unit.offline_helpers import tiny_extractor
from worker.offline.default_probe import SOURCES, build_default, refresh_drift, split_of

CATEGORIES = ["sexual", "hate", "harassment", "violence", "self-harm"]


def _rows(dataset: str, n: int, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        bad = rng.random() < 0.4
        words = ["hello", "friend", "nice", "day"] if not bad else ["kill", "hate", "idiot"]
        row: dict = {"id": f"{dataset}-train-{i}", "text": " ".join(rng.choices(words, k=5))}
        if dataset == "openai_moderation":
            cats = rng.sample(CATEGORIES, 1) if bad else []
            row |= {"label": "flagged" if bad else "not-flagged", "labels": cats}
        elif dataset == "xstest":
            row["label"] = "unsafe" if bad else "safe"
        elif dataset == "davidson_hate_offensive":
            row["label"] = rng.choice(["hate_speech", "offensive_language"]) if bad else "neither"
        else:  # toxicchat
            row |= {"label": "toxic" if bad else "non-toxic", "labels": ["toxic"] if bad else []}
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    for source in SOURCES:
        folder = root / source.dataset
        folder.mkdir()
        rows = _rows(source.dataset, 60, rng)
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize("noncommercial", [False, True])
def test_the_default_is_built_measured_and_licensed_by_its_recipe(
    data_root: Path, tmp_path: Path, noncommercial: bool
) -> None:
    extractor = tiny_extractor()
    out = tmp_path / "default"
    result = build_default(
        data_root,
        out,
        extractor,
        cache_root=tmp_path / "caches",
        noncommercial=noncommercial,
        config=FitConfig(max_epochs=2, patience=1, batch_size=16),
    )
    probe, manifest = load_checkpoint(out, extractor.fingerprint)
    heads = [h.name for h in probe.spec.heads]
    assert heads[:2] == ["toxicity", "sexual"] and ("jailbreak" in heads) == noncommercial
    card = json.loads((out / "card.json").read_text())
    assert card == result.card
    used = {s["dataset"] for s in card["sources"]}
    assert ("toxicchat" in used) == noncommercial
    assert card["license"] == ("CC-BY-NC-4.0" if noncommercial else "Apache-2.0")
    # Every source is measured on its held-out rows, on the heads it annotates.
    assert set(card["held_out"]) == used
    assert set(card["held_out"]["xstest"]) == {"toxicity", "unsafe"}
    assert "self-harm" in card["held_out"]["openai_moderation"]
    rows = {s["dataset"]: s["rows"] for s in card["sources"]}
    held = sum(split_of(f"xstest-train-{i}") == "held_out" for i in range(60))
    assert rows["xstest"]["held_out"] == held
    assert manifest.counters.labels_seen == sum(r["train"] for r in rows.values())
    # Drift monitoring has its reference on day one: the train rows' statistics.
    assert manifest.drift is not None and manifest.drift.examples == manifest.counters.labels_seen
    assert len(manifest.drift.layer_mean) == len(probe.spec.layers)


def test_stats_restore_the_drift_reference_of_a_default_built_without_it(
    data_root: Path, tmp_path: Path
) -> None:
    extractor = tiny_extractor()
    out, caches = tmp_path / "default", tmp_path / "caches"
    config = FitConfig(max_epochs=1, patience=1, batch_size=16)
    build_default(data_root, out, extractor, cache_root=caches, config=config)
    _, built = load_checkpoint(out, extractor.fingerprint)
    tensors = (out / "tensors.safetensors").read_bytes()
    # As shipped before checkpoints carried drift statistics.
    (out / "manifest.json").write_bytes(built.model_copy(update={"drift": None}).encode())
    refreshed = refresh_drift(data_root, out, extractor, cache_root=caches)
    _, loaded = load_checkpoint(out, extractor.fingerprint)
    assert loaded == refreshed and loaded.drift is not None and built.drift is not None
    assert loaded.drift.examples == built.drift.examples
    assert loaded.drift.layer_mean == pytest.approx(built.drift.layer_mean, rel=1e-4)
    assert loaded.drift.score_bins == pytest.approx(built.drift.score_bins, abs=1e-6)
    assert (out / "tensors.safetensors").read_bytes() == tensors  # the weights are kept


def test_a_capped_source_keeps_the_same_rows_every_build(data_root: Path, tmp_path: Path) -> None:
    from worker.offline.default_probe import _source_file

    davidson = next(s for s in SOURCES if s.dataset == "davidson_hate_offensive")
    small = type(davidson)(**{**davidson.__dict__, "cap": {"offensive_language": 5}})
    first = _source_file(small, data_root, tmp_path / "a").read_text()
    again = _source_file(small, data_root, tmp_path / "b").read_text()
    kept = [json.loads(line)["label"] for line in first.splitlines()]
    assert first == again and kept.count("offensive_language") == 5
    assert kept.count("neither") == sum(
        json.loads(line)["label"] == "neither"
        for line in (data_root / davidson.dataset / "train.jsonl").read_text().splitlines()
    )
