"""The console script: --help works for the program and every subcommand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker.cli import COMMANDS, main


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_top_level_help_lists_every_command() -> None:
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    for name, _ in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_subcommand_help(name: str) -> None:
    out = _run(name, "--help")
    assert out.returncode == 0, out.stderr
    assert f"usage: probeguard {name}" in out.stdout


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: probeguard" in capsys.readouterr().out


def test_unknown_command_is_an_error() -> None:
    out = _run("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr
