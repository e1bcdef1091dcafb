"""The console script: --help works for the program and every subcommand."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from worker.cli import COMMANDS, build_parser, main


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
    # Argument-group descriptions are not %-formatted: a "%%" there prints as typed.
    assert "%%" not in out.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {
        name: child
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, child in action.choices.items()
    }


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_nested_action_help_prints_no_doubled_percent(name: str) -> None:
    """``probeguard default build --help`` printed "70%%": descriptions are not
    %-formatted, only help strings are. Every action under every command is checked."""
    command = _subparsers(build_parser([name]))[name]
    for action, parser in _subparsers(command).items():
        assert "%%" not in parser.format_help(), f"probeguard {name} {action} --help"


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: probeguard" in capsys.readouterr().out


def test_unknown_command_is_an_error() -> None:
    out = _run("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_invalid_settings_are_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROBEGUARD_DEVICE", "gpu")
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "up"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ},
    )
    assert out.returncode == 2 and "device" in out.stderr and "Traceback" not in out.stderr


def test_json_logs_and_secrets_stay_secret(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import logging

    from worker.logs import configure_logging
    from worker.settings import Settings

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", json_lines=True)
        s = Settings(kafka_sasl_password="hunter2", redis_url="redis://:hunter2@h:6379")
        logging.getLogger("probeguard.test").info("settings: %s", s)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    entry = json.loads(line)
    assert entry["level"] == "INFO" and entry["logger"] == "probeguard.test"
    assert "hunter2" not in line and "**********" in line


def test_python_dash_m_worker_runs_the_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "worker", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("probeguard ")


def test_log_lines_follow_stderr_when_it_is_replaced(capsys: pytest.CaptureFixture[str]) -> None:
    """A handler bound to a stream that was since closed made background threads fail."""
    import io
    import logging

    from worker.logs import configure_logging

    old = sys.stderr
    try:
        sys.stderr = first = io.StringIO()
        configure_logging("INFO")
        first.close()
        sys.stderr = second = io.StringIO()
        logging.getLogger("probeguard.test").info("after the swap")
        assert "Logging error" not in second.getvalue()
        assert second.getvalue().rstrip().endswith("after the swap")
    finally:
        sys.stderr = old
        logging.getLogger().handlers.clear()


def test_default_build_reads_the_source_invariant_heads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from worker.offline.default_recipe import HEADS

    parser = build_parser(["default"])
    base = ["default", "build", "--data-root", "data"]
    assert parser.parse_args(base).source_invariant is None  # the recipe's
    read = parser.parse_args([*base, "--source-invariant", "toxicity, hate"])
    assert read.source_invariant == ["toxicity", "hate"]
    every = parser.parse_args([*base, "--source-invariant", "all"]).source_invariant
    assert every == [h.name for h in HEADS]
    assert parser.parse_args([*base, "--source-invariant", "none"]).source_invariant == []
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--source-invariant", "toxicity,bogus"])
    assert "unknown heads ['bogus']" in capsys.readouterr().err
    # The budget rule's price: the recipe's unless named.
    assert parser.parse_args(base).budget_price is None
    assert parser.parse_args([*base, "--budget-price", "share"]).budget_price == "share"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--budget-price", "cheapest"])
    # ... and its rule.
    assert parser.parse_args(base).budget_rule is None
    assert parser.parse_args([*base, "--budget-rule", "joint"]).budget_rule == "joint"
    assert parser.parse_args([*base, "--budget-rule", "heads"]).budget_rule == "heads"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--budget-rule", "bagged"])
