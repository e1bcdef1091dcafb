"""``probeguard demo``: the main job on one machine."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

__all__ = ["register", "summary"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo",
        help="run broker, Redis, a scorer and an updater on a replayed labeled stream",
        description=(
            "One command, no configuration: start the embedded Kafka-protocol broker and Redis "
            "(or use PROBEGUARD_KAFKA_BOOTSTRAP / PROBEGUARD_REDIS_URL when set), one scorer and "
            "one updater on the default LLM, then replay a labeled file as chat messages plus "
            "delayed human labels. Shows a live view, and writes a report (HTML + PNG plots) at "
            "the end, also after Ctrl-C."
        ),
    )
    _replay_args(p)
    _output_args(p)
    _chat_args(p)
    p.set_defaults(func=_run)


def _replay_args(p: argparse.ArgumentParser) -> None:
    """What is replayed: the labeled file, how often, how fast, how much of it is labeled."""
    p.add_argument(
        "--data",
        type=Path,
        help='labeled JSONL ({"id","text","label"} per line); default: the packaged '
        "demo chat set (121 messages)",
    )
    p.add_argument("--limit", type=int, help="use only the first N rows")
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="replay the rows this many times (default: 2 for the packaged set, else 1)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=5.0,
        help="chat messages per second (default: %(default)s; 0 = as fast as possible)",
    )
    p.add_argument(
        "--label-share",
        type=float,
        default=0.6,
        help="share of messages that get a human label (default: %(default)s)",
    )
    p.add_argument(
        "--label-delay-s",
        type=float,
        default=2.0,
        help="delay before a message's label arrives (default: %(default)s)",
    )
    p.add_argument("--flag-labels", help="comma-separated labels that mean 'flag' (default: guess)")


def _output_args(p: argparse.ArgumentParser) -> None:
    """Where the report goes, what is left running, the console beside it, the time limit."""
    p.add_argument(
        "--out",
        type=Path,
        default=Path("probeguard-report"),
        help="report folder (default: %(default)s)",
    )
    p.add_argument(
        "--keep", action="store_true", help="leave the embedded broker and Redis running afterwards"
    )
    p.add_argument(
        "--console",
        action="store_true",
        help="also serve the web console (label the review queue live, watch the probe); "
        "it stays up after the replay until Ctrl-C",
    )
    p.add_argument(
        "--console-port", type=int, help="console port (default: PROBEGUARD_CONSOLE_PORT, 8300)"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=1800,
        help="stop and report after this long (default: %(default)s)",
    )


def _chat_args(p: argparse.ArgumentParser) -> None:
    """``--chat``: the inline guard instead of the replay."""
    chat = p.add_argument_group(
        "chat (--chat)",
        "Chat with the default LLM (SmolLM2-Instruct) moderated inline by the guard: the "
        "probe reads the model's own hidden states as it answers (no second forward pass); "
        "verdicts go to the broker, /label trains a new version the guard swaps to.",
    )
    chat.add_argument("--chat", action="store_true", help="chat instead of the replay")
    chat.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a line to send instead of reading the terminal (repeat it for several; "
        "'/label toxic' lines label the last message)",
    )
    chat.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="longest reply, tokens (default: %(default)s)",
    )


def _run(args: argparse.Namespace) -> int:
    if args.chat:
        return _chat(args)
    if args.prompt:
        raise SystemExit("demo: --prompt needs --chat")
    from worker.demo.run import DemoOptions, run_demo
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import load_settings

    opts = DemoOptions(
        data=args.data,
        limit=args.limit,
        repeat=args.repeat if args.repeat is not None else (1 if args.data else 2),
        rate=args.rate,
        label_share=args.label_share,
        label_delay_s=args.label_delay_s,
        out=args.out,
        keep=args.keep,
        timeout_s=args.timeout_s,
        flag_labels=args.flag_labels.split(",") if args.flag_labels else None,
        console=args.console,
        console_port=args.console_port,
    )
    settings = load_settings()
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    signal.signal(signal.SIGTERM, lambda *_: interrupted.set())
    log.info("loading the LLM (%s) …", settings.model)
    extractor = HiddenStateExtractor.from_settings(settings)
    figures, page = run_demo(settings, opts, extractor, interrupted=interrupted)
    print(f"report: {page}")
    print(summary(figures))
    if args.console and figures.get("replay_complete"):
        return 0  # with the console, Ctrl-C after the replay is the normal end
    return 130 if interrupted.is_set() else 0


def summary(figures: dict[str, Any]) -> str:
    """The run in two lines: traffic, then served F1 (worker.demo.quality) of the flag
    policy and of each head the labels judged, over all labeled messages and per half."""

    def f1(v: float | None) -> str:
        return "–" if v is None else f"{v:.3f}"

    from worker.demo.report import headline_rows

    served = "; ".join(
        f"{what.split(' (')[0]} {f1(a)} (first half {f1(b)}, second half {f1(c)})"
        for what, _, a, b, c in headline_rows(figures)
    )
    return (
        f"messages {figures['messages']}  verdicts {figures['verdicts']}  "
        f"dead letters {figures['dead_letters']}  p50 {figures['p50_ms']} ms  "
        f"p99 {figures['p99_ms']} ms\nserved F1: {served}"
    )


def _chat(args: argparse.Namespace) -> int:
    import sys
    from collections.abc import Iterator

    from worker.demo.chat import ChatOptions, run_chat
    from worker.llm.load import load_llm
    from worker.settings import load_settings

    settings = load_settings()
    log.info("loading the LLM (%s) with its LM head …", settings.model)
    llm = load_llm(settings, lm_head=True)

    def typed() -> Iterator[str]:
        while True:
            try:
                yield input("you> ")
            except EOFError:
                return

    lines = args.prompt if args.prompt else typed()
    opts = ChatOptions(max_new_tokens=args.max_new_tokens, keep=args.keep, echo=bool(args.prompt))
    interrupted = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: interrupted.set())

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        session = run_chat(settings, llm, lines, opts, write=write, stop=interrupted)
    except KeyboardInterrupt:
        return 130
    flagged = sum(t.flagged for t in session.turns)
    print(f"turns {len(session.turns)}  flagged {flagged}  labels {session.labels}")
    return 0
