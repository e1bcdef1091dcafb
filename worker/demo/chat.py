"""``probeguard demo --chat``: a chat with the default LLM (SmolLM2-Instruct), moderated
inline by :class:`~worker.guard.Guard` from the model's own hidden states, on the embedded
broker and Redis (or the configured ones).

Each turn prints the reply as it streams (shown only once a verdict covered it) and the
prompt's and the reply's verdicts; both are on the verdicts topic like a scorer's. An
updater runs beside it: ``/label LABEL`` labels the last prompt, ``/label-reply LABEL`` the
last reply (the labels join through the text cache the guard wrote), and once
``publish_every_labels`` labels are in it publishes a version the guard swaps to.

Message text is hostile: the terminal is shown control and format characters escaped, never
raw (an ANSI escape in a prompt or a reply cannot restyle or rewrite the screen).
"""

from __future__ import annotations

import json
import logging
import threading
import unicodedata
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from schemas import HumanLabel, Verdict, utcnow
from worker.demo.stack import embedded_stack, run_names
from worker.guard import Guard, GuardedReply
from worker.kafka.clients import ensure_topics, make_producer
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.llm.model import LoadedLLM
from worker.settings import Settings
from worker.store.redis import make_redis

__all__ = ["ChatOptions", "run_chat", "shown"]

log = logging.getLogger(__name__)
PROBE = "chat"
HELP = (
    "type a message; /label LABEL labels your last message, /label-reply LABEL the last "
    "reply (e.g. /label toxic, /label non-toxic); /quit ends"
)


def shown(text: str) -> str:
    """``text`` safe for a terminal: control and format characters (escapes, bidi
    overrides, zero-width characters) as ``\\u....``; newlines and tabs kept."""
    return "".join(
        ch
        if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Co", "Cs")
        else f"\\u{ord(ch):04x}"
        for ch in text
    )


@dataclass
class ChatOptions:
    max_new_tokens: int = 64
    keep: bool = False
    echo: bool = True  # write each input line back (scripted input; a person's is on screen)
    tag: str = field(default_factory=lambda: f"chat-{uuid.uuid4().hex[:8]}")  # keys, topics
    generate: dict[str, Any] = field(default_factory=dict)  # more model.generate options


@dataclass
class ChatSession:
    """What a session did (the command prints it; tests read it)."""

    turns: list[GuardedReply] = field(default_factory=list)
    labels: int = 0
    versions: list[int] = field(default_factory=list)  # the live version at each turn


class _Printer:
    """A ``generate`` streamer that writes the decoded reply as it comes, escaped."""

    def __init__(self, tokenizer: Any, write: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.write = write
        self.ids: list[int] = []
        self.done = 0
        self.prompt = True

    def put(self, value: Any) -> None:
        if self.prompt:  # generate hands over the prompt first
            self.prompt = False
            return
        self.ids += [int(i) for i in value.reshape(-1).tolist()]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.write(shown(text[self.done :]))
        self.done = len(text)

    def end(self) -> None:
        if self.ids:
            self.write("\n")


def verdict_line(name: str, verdict: Verdict | None) -> str:
    if verdict is None:
        return f"  {name}: not scored"
    r = verdict.results[0]
    said = "  ".join(f"{label} {r.scores[label]:.2f}" for label in r.predicted)
    return f"  {name}: {verdict.decision:5}  v{r.version}  {said}"


def run_chat(
    settings: Settings,
    llm: LoadedLLM,
    lines: Iterable[str],
    opts: ChatOptions,
    *,
    write: Callable[[str], None],
    stop: threading.Event | None = None,
) -> ChatSession:
    """Chat over ``lines`` (a person's input, or a script of them) until they end, ``/quit``
    or ``stop``."""
    stop = stop or threading.Event()
    session = ChatSession()
    with embedded_stack(settings, keep=opts.keep) as stack:
        s = stack.model_copy(
            update={
                **run_names(opts.tag),
                "probes": PROBE,
                "train_probe": PROBE,
                "guard_on_flag": settings.guard_on_flag,
                "publish_every_labels": min(settings.publish_every_labels, 4),
                "publish_every_s": 2.0,
                "stats_warmup": min(settings.stats_warmup, 4),
                "metrics_port": 0,
                "stage_check_interval_s": 1.0,
            }
        )
        ensure_topics(s, partitions=1)
        extractor = HiddenStateExtractor.for_llm(llm, s)
        updater = Updater(s, extractor, make_redis(s), worker_id="chat-updater")
        learner = threading.Thread(target=updater.run, name="updater", daemon=True)
        learner.start()
        producer = make_producer(s)
        try:
            with Guard(llm, s, make_redis(s), worker_id="chat-guard") as guard:
                if not guard.wait_ready(60):
                    raise RuntimeError("no probe to serve: the packaged default did not load")
                write(f"probeguard chat: {HELP}\n")
                for line in lines:
                    if stop.is_set() or line.strip() == "/quit":
                        break
                    if line.startswith("/label"):
                        session.labels += _label(s, producer, session, line, write)
                    elif line.strip():
                        session.turns.append(_turn(guard, line.strip(), opts, write))
                        session.versions.append(
                            guard.engine.watcher.versions()[PROBE].get("live") or 0
                        )
        finally:
            producer.flush(timeout=10)
            producer.close(timeout=10)
            updater.stop()
            learner.join(60)
    return session


def _turn(guard: Guard, text: str, opts: ChatOptions, write: Callable[[str], None]) -> GuardedReply:
    if opts.echo:
        write(f"you> {shown(text)}\n")
    write("bot> ")
    printer = _Printer(guard.tokenizer, write)
    reply = guard.chat(
        [{"role": "user", "content": text}],
        **{"max_new_tokens": opts.max_new_tokens, "do_sample": False, **opts.generate},
        streamer=printer,
    )
    if reply.refused:
        write(f"{shown(reply.text)}   [refused: the {reply.refused} was flagged]\n")
    elif reply.flagged:
        write("  [flagged: shown under guard_on_flag=" + guard.settings.guard_on_flag + "]\n")
    write(verdict_line("prompt", reply.prompt) + "\n")
    write(verdict_line("reply ", reply.reply) + "\n")
    return reply


def _label(
    s: Settings, producer: Any, session: ChatSession, line: str, write: Callable[[str], None]
) -> int:
    command, _, value = line.strip().partition(" ")
    if not session.turns or not value or command not in ("/label", "/label-reply"):
        write(f"  {HELP}\n")
        return 0
    turn = session.turns[-1]
    target = turn.reply_id if command == "/label-reply" else turn.prompt_id
    if command == "/label-reply" and turn.reply is None:
        write("  the last reply was not scored: nothing to label\n")
        return 0
    try:
        label = HumanLabel.build(
            s.limits, message_id=target, label=value, labeler_id="chat-user", created_at=utcnow()
        )
    except ValueError as exc:
        write(f"  not a label: {shown(str(exc).splitlines()[0])}\n")
        return 0
    producer.send(s.topic_labels, key=target.encode(), value=label.encode())
    producer.flush(timeout=10)
    which = "reply" if command == "/label-reply" else "message"
    write(f"  labelled your last {which} {json.dumps(value)}\n")
    return 1
