"""The ``probeguard`` command line: one program, one subcommand per process role.

Each subcommand lives in ``worker/commands/<name>.py`` and exposes
``register(subparsers)``; it sets ``func`` to a callable taking the parsed
arguments and returning an exit code. Modules are imported lazily per command
so ``probeguard --help`` stays fast (no torch import).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from worker.errors import ProbeguardError
from worker.logs import configure_logging
from worker.settings import load_settings

__all__ = ["build_parser", "main"]

# (module under worker.commands, one-line help). Order is the order in --help.
COMMANDS: list[tuple[str, str]] = [
    ("demo", "run broker, Redis, a scorer and an updater on a replayed labeled stream"),
    ("up", "run the embedded Kafka-protocol broker and Redis in the foreground"),
    ("score", "consume chat messages, publish verdicts (the scoring worker)"),
    ("train", "learn from human labels and publish probe versions (the updater)"),
    ("probe", "operate probe versions: status, promote, canary, rollback, pin, history"),
    ("cache", "build or inspect a hidden-state cache for offline training"),
    ("fit", "train a probe offline on a hidden-state cache; write a checkpoint"),
    ("eval", "evaluate a checkpoint on a labeled file or a cache"),
    ("default", "build or show the packaged default probe (moderation on day one)"),
    ("explain", "show how a probe's verdict on one message forms, layer by layer"),
    ("console", "the web console: review queue, probe rollout, explanations"),
    ("serve", "OpenAI- and Perspective-compatible moderation endpoints over HTTP"),
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("probeguard")
    except PackageNotFoundError:
        return "unknown"


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="probeguard",
        description=(
            "Streaming, online-learning content moderation: a frozen LLM's hidden states "
            "scored by small trained probes; messages and labels on Kafka, versioned "
            "checkpoints through Redis. Settings come from PROBEGUARD_* environment variables."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only import the module of the command being run (and none for bare --help).
    args = list(sys.argv[1:] if argv is None else argv)
    names = {name for name, _ in COMMANDS}
    wanted = next((a for a in args if a in names), None)
    for name, help_text in COMMANDS:
        if name == wanted:
            module = importlib.import_module(f"worker.commands.{name}")
            module.register(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
    except ValidationError as exc:
        print(f"probeguard: invalid settings (PROBEGUARD_* environment):\n{exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, json_lines=settings.log_json)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ProbeguardError as exc:
        print(f"probeguard {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
