"""The default probe's name (``moderation``), the guard for registries under the old one
(``toxicity``), and ``probeguard probe status`` saying what serves before anything is live."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from schemas import CheckpointManifest
from tests.conftest import RedisNamespace
from worker.cli import main
from worker.defaults import ROOT
from worker.rollout.status import before_live
from worker.settings import DEFAULT_PROBE_NAME, LEGACY_PROBE_NAME, Settings

PACKAGED = sorted(ROOT.glob("*/manifest.json"))


def _packaged() -> tuple[str, list[str]]:
    """The packaged default for the default LLM: its folder and its heads."""
    for path in PACKAGED:
        m = CheckpointManifest.model_validate_json(path.read_bytes())
        if m.llm.model_id.startswith(f"{Settings().model}/"):
            return path.parent.name, [h.name for h in m.spec.head_specs]
    raise AssertionError("no packaged default for the default LLM")


def test_the_default_probe_is_named_moderation() -> None:
    assert Settings().probe_names == [DEFAULT_PROBE_NAME] == ["moderation"]
    assert Settings(probes=LEGACY_PROBE_NAME).probe_names == ["toxicity"]  # still accepted


def test_before_live_follows_the_settings(tmp_path: Path) -> None:
    folder, heads = _packaged()
    got = before_live(Settings())
    assert (got.version, got.source, list(got.heads)) == (
        0,
        f"the packaged default probe {folder}",
        heads,
    )
    assert before_live(Settings(default_probe=False)).version is None
    boot = before_live(Settings(bootstrap_checkpoint=tmp_path))
    assert boot.version == 0 and str(tmp_path) in boot.source
    # An LLM with no packaged default (its manifest names another model) waits.
    other = before_live(Settings(model="gemma3-270m"))
    assert other.version is None and "gemma3-270m" in other.source
    # The same folder under another GGUF file of the same model is not that default.
    assert before_live(Settings(model_gguf_file="other.gguf")).version is None
    # Read from the manifests: a copy elsewhere is found the same way.
    shutil.copytree(ROOT / folder, tmp_path / "copy")
    assert before_live(Settings(), root=tmp_path).source == "the packaged default probe copy"


def _head(out: str) -> str:
    """The status's first statement (wrapped at 80 columns), as one line."""
    return " ".join(line.strip() for line in out.split("\nupdater:")[0].splitlines())


def _env(monkeypatch: pytest.MonkeyPatch, redis_ns: RedisNamespace, **extra: str) -> None:
    monkeypatch.setenv("PROBEGUARD_REDIS_URL", redis_ns.url)
    monkeypatch.setenv("PROBEGUARD_REDIS_PREFIX", redis_ns.prefix)
    for key in ("PROBEGUARD_PROBES", "PROBEGUARD_TRAIN_PROBE", "PROBEGUARD_DEFAULT_PROBE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)


def test_probe_status_shows_the_packaged_default_as_v0(
    monkeypatch: pytest.MonkeyPatch, redis_ns: RedisNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``probe toxicity: live none`` while ``score`` and ``serve`` answered as v0."""
    _env(monkeypatch, redis_ns)
    folder, heads = _packaged()
    assert main(["probe", "status"]) == 0
    first = _head(capsys.readouterr().out)
    assert first == (
        f"probe moderation: live v0, the packaged default probe {folder} ({len(heads)} heads), "
        "until a version is published"
    ), first
    assert main(["probe", "status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["live"] is None  # the registry's own pointer: nothing published
    assert report["serving_before_live"] == {
        "version": 0,
        "source": f"the packaged default probe {folder}",
        "heads": heads,
    }
    _env(monkeypatch, redis_ns, PROBEGUARD_DEFAULT_PROBE="false")
    assert main(["probe", "status"]) == 0
    first = _head(capsys.readouterr().out)
    assert first == (
        "probe moderation: live none; scorers serve nothing until a version is published "
        "(PROBEGUARD_DEFAULT_PROBE=false)"
    ), first


def test_a_registry_under_the_old_default_name_is_not_set_aside(
    monkeypatch: pytest.MonkeyPatch, redis_ns: RedisNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    redis_ns.client.set(redis_ns.keys.next_version(LEGACY_PROBE_NAME), 3)
    _env(monkeypatch, redis_ns)
    assert main(["probe", "status"]) == 1
    err = capsys.readouterr().err
    assert "PROBEGUARD_PROBES=toxicity" in err and redis_ns.prefix in err, err
    # Saying which probe, in the environment or on the command line, is enough.
    _env(monkeypatch, redis_ns, PROBEGUARD_PROBES="toxicity")
    assert main(["probe", "status"]) == 0  # (its scorers serve the packaged default as v0)
    assert capsys.readouterr().out.startswith("probe toxicity: live v0, the packaged default")
    _env(monkeypatch, redis_ns, PROBEGUARD_PROBES="moderation")
    assert main(["probe", "status"]) == 0
    _env(monkeypatch, redis_ns)
    assert main(["probe", "status", "--probe", "toxicity"]) == 0
    # Once the new name has versions too, the old ones are a choice made: no refusal.
    redis_ns.client.set(redis_ns.keys.next_version(DEFAULT_PROBE_NAME), 1)
    assert main(["probe", "status"]) == 0
