"""Ensembles: one probe per LLM over the same rows, fit and measured through the CLI
(`cache build` with a tiny Llama and a tiny Gemma 3, `fit --cache A --cache B`, `eval`),
and the ensemble file's verification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from probes import CheckpointError, IncompatibleCheckpoint, ProbeError, load_checkpoint
from probes.ensemble import ENSEMBLE_FILE, is_ensemble, load_ensemble, member_folder
from probes.offline.cache import HiddenStateCache
from probes.offline.ensemble import align_rows
from probes.offline.fit import predict_dataset
from tests.unit.offline_helpers import write_labeled
from worker.cli import main
from worker.llm.tiny import make_tiny_gemma3, make_tiny_llm
from worker.offline.fit_eval import load_split

MODELS = ("tiny-llama-0", "tiny-gemma3")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ensemble")
    make_tiny_llm(root)
    make_tiny_gemma3(root)
    write_labeled(root / "train.jsonl", 160, seed=1, multilabel=False)
    write_labeled(root / "val.jsonl", 60, seed=2, multilabel=False)
    write_labeled(root / "other.jsonl", 60, seed=5, multilabel=False)
    return root


@pytest.fixture(scope="module")
def caches(workspace: Path) -> dict[str, dict[str, Path]]:
    """caches[split][model]: each labeled file's cache under each tiny LLM."""
    out: dict[str, dict[str, Path]] = {}
    for split in ("train", "val", "other"):
        for model in MODELS:
            path = workspace / f"cache-{split}-{model}"
            argv = ["cache", "build", "--data", str(workspace / f"{split}.jsonl")]
            argv += ["--out", str(path), "--no-progress", "--shard-rows", "64"]
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("PROBEGUARD_MODEL", str(workspace / model))
                mp.setenv("PROBEGUARD_CACHE_DIR", str(workspace / "model-cache"))
                mp.setenv("PROBEGUARD_MAX_TOKENS", "64")
                assert main(argv) == 0
            out.setdefault(split, {})[model] = path
    return out


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``argv``; it must fail (exit status 1 or SystemExit); returns what it said."""
    capsys.readouterr()
    try:
        assert main(list(argv)) == 1
    except SystemExit as exc:
        assert exc.code not in (0, None)
        return str(exc.code) + capsys.readouterr().err
    return capsys.readouterr().err


TRAIN = ["--lr", "1e-2", "--epochs", "8", "--batch-size", "32", "--folds", "2", "--pool", "mean"]


@pytest.fixture(scope="module")
def ensemble(caches, workspace: Path) -> Path:
    out = workspace / "ens"
    argv = ["fit", "--cache", str(caches["train"][MODELS[0]])]
    argv += ["--cache", str(caches["train"][MODELS[1]]), "--out", str(out), *TRAIN, "--json"]
    assert main(argv) == 0
    return out


def test_fit_writes_one_checkpoint_per_llm_and_eval_reads_their_mean(
    capsys, caches, ensemble: Path
) -> None:
    report = json.loads((ensemble / "fit-report.json").read_text())["summary"]
    assert report["ensemble"] == 2 and [m["llm"] for m in report["members"]] == list(MODELS)
    assert report["val_auprc"] > 0.8, report  # the insult words are learnable; ~0.35 by chance
    assert set(report["thresholds"]) == {"toxic"}
    assert is_ensemble(ensemble)
    # Each member is an ordinary checkpoint, loadable only with its own LLM.
    llms = [HiddenStateCache(caches["val"][m]).manifest.llm for m in MODELS]
    for i, (model, llm) in enumerate(zip(MODELS, llms, strict=True)):
        folder = ensemble / member_folder(i, llm.model_id)
        assert model in folder.name
        load_checkpoint(folder, llm)
        with pytest.raises(IncompatibleCheckpoint):
            load_checkpoint(folder, llms[1 - i])

    val = [str(caches["val"][m]) for m in MODELS]
    measured = run_json(capsys, "eval", "--checkpoint", str(ensemble), "--cache", *val[:1],
                        "--cache", val[1])  # fmt: skip
    assert measured["n"] == 60 and measured["auprc"] > 0.8
    assert [m["llm"] for m in measured["members"]] == list(MODELS)
    # The member figures are what each member's checkpoint measures alone ...
    for i, (m, path) in enumerate(zip(measured["members"], val, strict=True)):
        alone = run_json(capsys, "eval", "--checkpoint", str(ensemble / m["path"]), "--cache", path)
        assert alone["auprc"] == pytest.approx(m["auprc"]) and m["path"].startswith(f"member-{i}")
    # ... and the ensemble's is their mean's, at the ensemble's thresholds.
    ens = load_ensemble(ensemble, llms)
    datas = [
        load_split(HiddenStateCache(Path(p)), "mean", list(probe.layers), "label")
        for p, probe in zip(val, ens.probes, strict=True)
    ]
    probs = [predict_dataset(p, d) for p, d in zip(ens.probes, datas, strict=True)]
    mean = ens.predict_proba(probs)
    flagged = mean[:, ens.spec.labels.index("toxic")] >= ens.manifest.thresholds["toxic"]
    truth = datas[0].targets == ens.spec.labels.index("toxic")
    tp = int((flagged & truth).sum())
    f1 = 2 * tp / (int(flagged.sum()) + int(truth.sum()))
    assert measured["f1"] == pytest.approx(f1, abs=1e-6)
    # The caches may come in any order.
    swapped = run_json(capsys, "eval", "--checkpoint", str(ensemble), "--cache", val[1],
                       "--cache", val[0])  # fmt: skip
    assert swapped["auprc"] == pytest.approx(measured["auprc"])


def test_a_member_edited_after_the_fit_is_refused(capsys, caches, ensemble: Path, tmp_path) -> None:
    import shutil

    copy = tmp_path / "ens"
    shutil.copytree(ensemble, copy)
    member = copy / ensemble_member(copy, 1) / "manifest.json"
    manifest = json.loads(member.read_text())
    manifest["spec"]["thresholds"] = {"toxic": 0.01}  # flag everything: a valid checkpoint still
    member.write_text(json.dumps(manifest))
    val = [str(caches["val"][m]) for m in MODELS]
    err = fails(capsys, "eval", "--checkpoint", str(copy), "--cache", val[0], "--cache", val[1])
    assert "is not the one the ensemble pins" in err


def ensemble_member(directory: Path, index: int) -> str:
    return json.loads((directory / ENSEMBLE_FILE).read_text())["members"][index]["path"]


def test_signed_ensembles_verify_and_refuse_edits(caches, workspace: Path, capsys) -> None:
    out = workspace / "ens-signed"
    argv = ["fit", "--cache", str(caches["train"][MODELS[0]])]
    argv += ["--cache", str(caches["train"][MODELS[1]]), "--out", str(out), *TRAIN, "--json"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PROBEGUARD_CHECKPOINT_HMAC_KEY", "k" * 32)
        mp.setenv("PROBEGUARD_DEPLOYMENT_ID", "test")
        assert main(argv) == 0
    llms = [HiddenStateCache(caches["val"][m]).manifest.llm for m in MODELS]
    key = b"k" * 32
    assert load_ensemble(out, llms, signing_key=key).manifest.signature is not None
    with pytest.raises(CheckpointError, match="signature does not verify"):
        load_ensemble(out, llms, signing_key=b"x" * 32)
    data = json.loads((out / ENSEMBLE_FILE).read_text())
    data["thresholds"]["toxic"] = 0.01
    (out / ENSEMBLE_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="signature does not verify"):
        load_ensemble(out, llms, signing_key=key)
    val = [str(caches["val"][m]) for m in MODELS]
    with pytest.MonkeyPatch.context() as mp:  # eval with the key checks it
        mp.setenv("PROBEGUARD_CHECKPOINT_HMAC_KEY", "k" * 32)
        mp.setenv("PROBEGUARD_DEPLOYMENT_ID", "test")
        err = fails(capsys, "eval", "--checkpoint", str(out), "--cache", val[0], "--cache", val[1])
    assert "signature does not verify" in err
    data.pop("signature")
    (out / ENSEMBLE_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="unsigned but a signing key is configured"):
        load_ensemble(out, llms, signing_key=key)


def test_ensemble_needs_every_members_llm(caches, ensemble: Path, capsys) -> None:
    val = [str(caches["val"][m]) for m in MODELS]
    err = fails(capsys, "eval", "--checkpoint", str(ensemble), "--cache", val[0])
    assert "reads the states of tiny-gemma3" in err and "not among the LLMs given" in err
    err = fails(capsys, "eval", "--checkpoint", str(ensemble), "--data", "x.jsonl")
    assert "one --cache per member LLM" in err
    err = fails(capsys, "eval", "--checkpoint", str(ensemble), "--cache", val[0], "--cache",
                val[1], "--head", "toxicity")  # fmt: skip
    assert "--head" in err
    other = str(caches["other"][MODELS[1]])
    err = fails(capsys, "eval", "--checkpoint", str(ensemble), "--cache", val[0], "--cache", other)
    assert "build every member's cache from the same labeled file" in err


def test_fit_refuses_what_an_ensemble_cannot_be(caches, workspace: Path, capsys) -> None:
    a, b = caches["train"][MODELS[0]], caches["train"][MODELS[1]]
    out = str(workspace / "never")
    err = fails(capsys, "fit", "--cache", str(a), "--cache", str(caches["val"][MODELS[0]]),
                "--out", out, *TRAIN)  # fmt: skip
    assert "same LLM" in err
    err = fails(capsys, "fit", "--cache", str(a), "--cache", str(caches["other"][MODELS[1]]),
                "--out", out, *TRAIN)  # fmt: skip
    assert "same labeled file" in err
    for extra in (["--val-cache", str(b)], ["--folds", "0"], ["--exit", "2"], ["--depth", "auto"]):
        argv = ["fit", "--cache", str(a), "--cache", str(b), "--out", out, "--pool", "mean"]
        assert "selected by cross-validation" in fails(capsys, *argv, *extra)
    assert "--layers names one LLM's layers" in fails(
        capsys, "fit", "--cache", str(a), "--cache", str(b), "--out", out, *TRAIN, "--layers", "1"
    )
    assert not Path(out).exists()


def test_one_out_folder_holds_a_probe_or_an_ensemble(caches, ensemble: Path, capsys) -> None:
    a = str(caches["train"][MODELS[0]])
    err = fails(capsys, "fit", "--cache", a, "--out", str(ensemble), *TRAIN)
    assert "holds an ensemble" in err
    single = ensemble / member_folder(0, HiddenStateCache(Path(a)).manifest.llm.model_id)
    b = str(caches["train"][MODELS[1]])
    err = fails(capsys, "fit", "--cache", a, "--cache", b, "--out", str(single), *TRAIN)
    assert "holds a single probe's checkpoint" in err


def test_align_rows_puts_every_dataset_in_the_first_ones_order(caches) -> None:
    a, b = (load_split(HiddenStateCache(caches["val"][m]), "mean", [1, 2], "label") for m in MODELS)
    shuffled = b.subset(torch.randperm(len(b), generator=torch.Generator().manual_seed(0)))
    assert shuffled.ids != a.ids
    _, aligned = align_rows([a, shuffled])
    assert aligned.ids == a.ids and torch.equal(aligned.targets, a.targets)
    assert aligned.summaries is not None and b.summaries is not None
    assert torch.equal(aligned.summaries, b.summaries)
    flipped = b.subset(torch.arange(len(b)))
    flipped.targets[0] = 1 - flipped.targets[0]
    with pytest.raises(ProbeError, match="labels some rows differently"):
        align_rows([a, flipped])
