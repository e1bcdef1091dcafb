"""``probeguard eval`` on both shapes of the shared labeled data (``label`` alone, and
``label`` + ``labels``) and with ``--heads-map``, through the CLI with the tiny random LLM.

The packaged default here is the real taxonomy (``default_spec``: twelve heads) with zero
weights, so every row scores the same: toxic 0.8, sexual 0.6, every other label 0.3, at
thresholds of 0.5. With every score tied, a head's AUPRC is its share of positives and its
F1 is that of flagging every row (toxicity, sexual) or none (the rest, F1 0), so every
figure below is worked out by hand from the five-row files.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from probes import build_probe, save_checkpoint
from schemas import ProbeSpec
from worker.cli import main
from worker.llm.tiny import make_tiny_llm

P = {"toxic": 0.8, "sexual": 0.6}  # every other label 0.3
F1_ALL_OF_5_WITH_2 = 2 * 2 / (2 * 2 + 3)  # flag all 5 rows, 2 positive: P 0.4, R 1 -> 4/7

# ToxicChat's shape: label + labels (label's value repeated in labels); jailbreaks are toxic.
TOXICCHAT = [
    {"label": "toxic", "labels": ["toxic"]},
    {"label": "toxic", "labels": ["toxic", "jailbreaking"]},
    {"label": "non-toxic", "labels": []},
    {"label": "non-toxic", "labels": []},
    {"label": "non-toxic", "labels": []},
]
# OpenAI moderation's: label flagged / not-flagged, labels the categories.
OPENAI = [
    {"label": "flagged", "labels": ["sexual"]},
    {"label": "flagged", "labels": ["sexual", "hate"]},
    {"label": "not-flagged", "labels": []},
    {"label": "not-flagged", "labels": []},
    {"label": "not-flagged", "labels": []},
]
XSTEST = [{"label": "unsafe"}, {"label": "safe"}, {"label": "safe"}, {"label": "safe"}]
# Davidson's: labels that name no head of the default.
DAVIDSON = [
    {"label": "hate_speech"},
    {"label": "offensive_language"},
    {"label": "neither"},
    {"label": "neither"},
]


def _write(path: Path, rows: list[dict]) -> Path:
    words = ["hello there", "you idiot", "nice day", "how are you", "ok", "thanks a lot"]
    lines = [
        json.dumps({"id": f"{path.stem}-{i}", "text": words[i % len(words)], **r})
        for i, r in enumerate(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval-shapes")
    make_tiny_llm(root)  # root/tiny-llama-0
    files: dict[str, list[dict]] = {
        "toxicchat": TOXICCHAT,
        "openai": OPENAI,
        "xstest": XSTEST,
        "davidson": DAVIDSON,
    }
    for name, rows in files.items():
        _write(root / f"{name}.jsonl", rows)
    return root


@pytest.fixture(autouse=True)
def tiny_model(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROBEGUARD_MODEL", str(root / "tiny-llama-0"))
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(root / "model-cache"))
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "32")
    monkeypatch.setenv("PROBEGUARD_BATCH_SIZE", "8")
    monkeypatch.delenv("PROBEGUARD_FLAG_HEADS", raising=False)


@pytest.fixture(autouse=True)
def constant_default(root: Path, tiny_model: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default's twelve heads, zero weights: the scores of ``P``, the same for every row."""
    import worker.defaults
    from worker.llm.extract import HiddenStateExtractor
    from worker.offline.default_recipe import default_spec
    from worker.settings import load_settings

    folder = root / "packaged" / "tiny"
    if not (folder / "manifest.json").exists():
        base = default_spec(32, [3, 4], noncommercial=True)
        thresholds = {x: 0.5 for x in base.labels if x != "non-toxic"}
        spec = ProbeSpec.model_validate(
            {**base.model_dump(), "token_pool": "mean", "thresholds": thresholds}
        )
        probe = build_probe(spec, seed=0)
        bias = [
            0.0 if x == "non-toxic" else math.log(P.get(x, 0.3) / (1 - P.get(x, 0.3)))
            for x in spec.labels
        ]
        with torch.no_grad():
            probe.head.weight.zero_()
            probe.head.bias.copy_(torch.tensor(bias))
        llm = HiddenStateExtractor.from_settings(load_settings()).fingerprint
        save_checkpoint(probe, folder, llm=llm)
    pin = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
    monkeypatch.setattr(worker.defaults, "ROOT", folder.parent)
    monkeypatch.setattr(worker.defaults, "PINNED", {"tiny": pin})


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", "default", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", "default", *argv]) == 1
    return capsys.readouterr().err


def test_toxicchat_shape_label_and_labels_count_once(capsys, root: Path) -> None:
    # Before: "multiclass head 'toxicity' needs exactly one label, got ['toxic', 'toxic']".
    r = run_json(capsys, "--data", str(root / "toxicchat.jsonl"))
    assert set(r["heads"]) == {"toxicity", "jailbreak"}  # the heads its labels name
    tox, jb = r["heads"]["toxicity"], r["heads"]["jailbreak"]
    assert tox["n"] == 5 and tox["flagged"]["support"] == 2
    assert tox["auprc"] == pytest.approx(0.4) and tox["f1"] == pytest.approx(F1_ALL_OF_5_WITH_2)
    # Every row annotates the jailbreak head: the four without "jailbreaking" are negatives.
    assert jb["n"] == 5 and jb["per_class"]["jailbreaking"]["support"] == 1
    assert jb["auprc"] == pytest.approx(0.2) and jb["f1"] == 0.0  # 0.3 < 0.5: none flagged
    assert r["unannotated"] == 0 and r["unread_labels"] == []
    one = run_json(capsys, "--data", str(root / "toxicchat.jsonl"), "--head", "toxicity")
    assert one["n"] == 5 and one["per_class"]["toxic"]["support"] == 2
    assert one["auprc"] == pytest.approx(0.4) and "policy" not in one


def test_openai_shape_empty_labels_are_negatives_for_the_files_categories(capsys, root) -> None:
    # Before: only each category's positive rows were counted, AUPRC 1.0 for every head.
    r = run_json(capsys, "--data", str(root / "openai.jsonl"))
    assert set(r["heads"]) == {"sexual", "hate"}  # violence & co. are not in this file
    sexual, hate = r["heads"]["sexual"], r["heads"]["hate"]
    assert sexual["n"] == hate["n"] == 5
    assert sexual["auprc"] == pytest.approx(0.4) and hate["auprc"] == pytest.approx(0.2)
    assert sexual["f1"] == pytest.approx(F1_ALL_OF_5_WITH_2) and hate["f1"] == 0.0
    assert r["unread_labels"] == ["flagged", "not-flagged"]
    # The policy: positive when any category is; every row flagged (toxic 0.8 >= 0.5).
    p = r["policy"]
    assert p["n"] == 5 and p["positives"] == 2 and p["flag_rate"] == 1.0
    assert p["f1"] == pytest.approx(F1_ALL_OF_5_WITH_2) and p["auprc"] == pytest.approx(0.4)
    assert "toxicity" in p["heads"] and "offensive" not in p["heads"]  # offensive never flags
    assert p["benign"] == {"n": 3, "flagged": 3, "rate": 1.0, "labels": {"not-flagged": 3}}


def test_heads_map_inline_names_what_the_files_labels_mean(capsys, root) -> None:
    data = ["--data", str(root / "openai.jsonl")]
    r = run_json(capsys, *data, "--heads-map", "toxicity=toxic:flagged")
    tox = r["heads"]["toxicity"]
    assert tox["n"] == 5 and tox["flagged"]["support"] == 2  # not-flagged rows: non-toxic
    assert tox["auprc"] == pytest.approx(0.4) and set(r["heads"]) == {"toxicity", "sexual", "hate"}
    assert r["unread_labels"] == ["not-flagged"]
    # LABEL may be left out where the head has one flag label; ';' joins entries.
    same = run_json(capsys, *data, "--heads-map", " toxicity = flagged ; hate=hate")
    assert same["heads"]["toxicity"] == tox


def test_heads_map_forms_agree_and_a_file_naming_no_head_needs_one(
    capsys, root: Path, tmp_path: Path
) -> None:
    data = ["--data", str(root / "davidson.jsonl")]
    err = fails(capsys, *data)
    assert "name no label of the heads of probe 'moderation'" in err and "--heads-map" in err
    inline = (
        "toxicity=toxic:hate_speech,offensive_language;offensive=hate_speech,offensive_language"
    )
    r = run_json(capsys, *data, "--heads-map", inline)
    assert set(r["heads"]) == {"toxicity", "offensive"}
    assert r["heads"]["toxicity"]["auprc"] == pytest.approx(0.5)
    assert r["heads"]["toxicity"]["f1"] == pytest.approx(2 / 3)  # all flagged, 2 of 4 toxic
    assert r["heads"]["offensive"]["f1"] == 0.0  # offensive 0.3: none flagged
    # Benign: the two "neither" rows, both flagged (toxic 0.8).
    assert r["policy"]["benign"] == {"n": 2, "flagged": 2, "rate": 1.0, "labels": {"neither": 2}}
    as_json = {
        "toxicity": {"hate_speech": ["toxic"], "offensive_language": ["toxic"], "neither": []},
        "offensive": {"hate_speech": ["offensive"], "offensive_language": ["offensive"]},
    }
    # In a JSON map a row naming none of a head's file labels is unknown there:
    # "neither" is not mapped for offensive, so offensive is measured on 2 rows.
    (tmp_path / "map.json").write_text(json.dumps(as_json))
    j = run_json(capsys, *data, "--heads-map", str(tmp_path / "map.json"))
    assert j["heads"]["toxicity"] == r["heads"]["toxicity"]
    assert j["heads"]["offensive"]["n"] == 2
    # The default's own recipe reads Davidson for offensive language only (profanity in
    # tweets is not what the toxicity head flags), as the inline map does for that head.
    rec = run_json(capsys, *data, "--heads-map", "recipe:davidson_hate_offensive")
    assert set(rec["heads"]) == {"offensive"}
    assert rec["heads"]["offensive"] == r["heads"]["offensive"]


def test_label_only_files_and_the_flag_heads_policy(capsys, root: Path, monkeypatch) -> None:
    r = run_json(capsys, "--data", str(root / "xstest.jsonl"))
    assert set(r["heads"]) == {"unsafe"} and r["heads"]["unsafe"]["auprc"] == pytest.approx(0.25)
    assert r["policy"]["f1"] == pytest.approx(0.4)  # all 4 flagged, 1 unsafe: P .25, R 1
    assert r["policy"]["benign"]["labels"] == {"safe": 3}
    # PROBEGUARD_FLAG_HEADS narrows the policy as it narrows the verdict.
    monkeypatch.setenv("PROBEGUARD_FLAG_HEADS", "hate,jailbreak")
    p = run_json(capsys, "--data", str(root / "openai.jsonl"))["policy"]
    assert p["heads"] == ["hate", "jailbreak"] and p["positives"] == 1  # the one hate row
    assert p["flag_rate"] == 0.0 and p["f1"] == 0.0 and p["auprc"] == pytest.approx(0.2)
    assert p["benign"] == {"n": 3, "flagged": 0, "rate": 0.0, "labels": {"not-flagged": 3}}


def test_text_report_prints_the_policy_and_the_benign_flag_rate(capsys, root: Path) -> None:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", "default", "--data", str(root / "openai.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "policy flagged" in out and "rows 5 (2 positive)" in out
    assert "benign rows (negative for every head they annotate): 3 (not-flagged 3)" in out
    assert "benign flag rate 100.0%" in out
    assert "labels no head reads: flagged, not-flagged (see --heads-map)" in out


@pytest.mark.parametrize(
    ("heads_map", "message"),
    [
        ("toxicty=toxic:flagged", "probe 'moderation' has no head 'toxicty'; its heads: ["),
        ("toxicity=toxik:flagged", "'toxik' is not a label of head 'toxicity'"),
        ("toxicity=toxic:flaged", "names label(s) ['flaged'] that no row of"),
        ("toxicity", "entry 'toxicity' is not HEAD=[LABEL:]NAME"),
        ("recipe:nope", "the default's recipe has no dataset 'nope'"),
        ("missing.json", "cannot read 'missing.json'"),
    ],
)
def test_heads_map_errors_name_the_offending_value(capsys, root, heads_map, message) -> None:
    err = fails(capsys, "--data", str(root / "openai.jsonl"), "--heads-map", heads_map)
    assert message in err


def test_a_row_naming_two_classes_of_a_multiclass_head_is_named(capsys, tmp_path: Path) -> None:
    bad = _write(tmp_path / "both.jsonl", [{"label": "toxic", "labels": ["non-toxic"]}])
    err = fails(capsys, "--data", str(bad))
    assert "row 'both-0'" in err and "exactly one class" in err


def test_cache_reads_the_same_rows_as_the_file(capsys, root: Path) -> None:
    out = root / "cache-toxicchat"
    argv = ["cache", "build", "--data", str(root / "toxicchat.jsonl"), "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    on_cache = run_json(capsys, "--cache", str(out))
    on_file = run_json(capsys, "--data", str(root / "toxicchat.jsonl"))
    assert on_cache["heads"] == on_file["heads"] and on_cache["policy"] == on_file["policy"]


def test_a_single_head_probe_reads_a_heads_map_as_its_one_head(
    capsys, root: Path, tmp_path: Path
) -> None:
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import load_settings

    spec = ProbeSpec(
        name="toxicity",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[3, 4],
        hidden_size=32,
        task="multiclass",
        labels=["non-toxic", "toxic"],
        flag_labels=["toxic"],
        thresholds={"toxic": 0.5},
    )
    probe = build_probe(spec, seed=0)
    with torch.no_grad():
        probe.head.weight.zero_()
        probe.head.bias.copy_(torch.tensor([0.0, math.log(0.8 / 0.2)]))
    llm = HiddenStateExtractor.from_settings(load_settings()).fingerprint
    save_checkpoint(probe, tmp_path / "single", llm=llm)
    argv = ["eval", "--checkpoint", str(tmp_path / "single"), "--data", str(root / "openai.jsonl")]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "['flagged', 'not-flagged']" in err and "--heads-map 'toxicity=LABEL:NAME,...'" in err
    assert main([*argv, "--heads-map", "toxicity=toxic:flagged", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["n"] == 5 and r["auprc"] == pytest.approx(0.4)
    assert r["f1"] == pytest.approx(F1_ALL_OF_5_WITH_2) and "policy" not in r
    # A JSON map naming only "flagged": the other rows are unknown, so not measured.
    (tmp_path / "m.json").write_text(json.dumps({"toxicity": {"flagged": ["toxic"]}}))
    assert main([*argv, "--heads-map", str(tmp_path / "m.json"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["n"] == 2 and r["unannotated"] == 3 and r["auprc"] == 1.0
