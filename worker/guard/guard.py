"""The inline guard: moderate a chat app's prompts and replies from the serving model's own
hidden states, with no second forward pass.

A chat app that serves the LLM probeguard's probes read (SmolLM2, Gemma 3) already computes
every layer's states for the prompt when it prefills, and for each reply token as it
decodes. :class:`Guard` generates with that model and, through :class:`StateTap` hooks,
keeps only what the served probes read:

1. **The prompt.** After the prefill, the live probe (hot-swapped from Redis by the
   scorer's own watcher, its LLM fingerprint checked against this model) scores the user's
   turn, and the prompt's :class:`~schemas.Verdict` goes out exactly as a scorer's does
   (:meth:`ScoringEngine.judge(states=...) <worker.scoring.engine.ScoringEngine.judge>`,
   through the :class:`~worker.scoring.front.FrontDoor` ``serve`` has too: verdicts
   topic, review queue within the shared budget, evidence, decided records, text cache),
   so labels, the updater and canary rollout work unchanged. With
   ``guard_on_flag=refuse`` a flagged prompt gets ``guard_refusal`` and no reply (one
   token was sampled; it is discarded).
2. **The reply, as it streams.** Every ``guard_stream_every`` generated tokens the reply so
   far is scored from the states decoding produced; with ``refuse`` a flag stops
   generation and the reply is withheld. When generation ends the whole reply gets one
   verdict, a message of its own whose ``reply_to`` names the prompt, so reviewers can
   label replies and the updater learns from them.

**Which tokens the probe reads.** The prompt is the tokenizer's chat template around the
conversation (:func:`worker.llm.chat_form.turn_ids`): ``context + ids(text) + suffix``.
With ``PROBEGUARD_TEXT_FORM=chat`` the probes were trained on exactly that form of each
message, and the guard pools the text and the suffix: a single-turn prompt under the
configured system prompt gives the same states as the Kafka scorer's, so the same scores.
With ``raw`` (probes trained on bare texts, e.g. the raw packaged default; the chat form
has a packaged default of its own) it pools the text's own tokens, whose states now also
carry the template before them: an approximation (on ToxicChat it loses 17 AUPRC points,
``bench/text_form.md``; the guard logs a warning). A reply's states always carry its
prompt; the scorer, given the reply's text alone, would not see that.

Example::

    settings = load_settings()
    with Guard.from_settings(settings) as guard:
        guard.wait_ready(30)
        reply = guard.chat([{"role": "user", "content": "hi there"}], max_new_tokens=64)
        print(reply.text, reply.prompt.decision if reply.prompt else "unscored")
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import redis
import torch

from schemas import ChatMessage, Verdict, utcnow
from worker.errors import ConfigError, ExtractionInputError
from worker.guard.tap import StateTap
from worker.llm.chat_form import turn_ids
from worker.llm.extract import Extraction, HiddenStateExtractor, clean_text
from worker.llm.load import load_llm
from worker.llm.model import LoadedLLM
from worker.scoring.engine import Retain
from worker.scoring.front import FrontDoor, FrontSettings
from worker.settings import Settings

__all__ = ["Guard", "GuardedReply"]

log = logging.getLogger(__name__)


@dataclass
class GuardedReply:
    """One guarded turn: what to show, and how each part was judged."""

    text: str  # what the app shows: the reply, or guard_refusal in its place
    generated: str  # the model's own reply, even when withheld
    prompt_id: str
    reply_id: str
    prompt: Verdict | None  # None: the text could not be scored (see errors)
    reply: Verdict | None  # the whole reply's (None: refused before it, or unscorable)
    refused: Literal["prompt", "reply"] | None = None  # what guard_on_flag=refuse stopped
    tokens: int = 0  # reply tokens generated
    checks: int = 0  # streaming checks of the reply run before the end
    flagged_at: int | None = None  # reply tokens when a streaming check first flagged
    errors: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        """Some verdict flagged (``annotate``: the app marks the reply)."""
        return any(v is not None and v.decision == "flag" for v in (self.prompt, self.reply))


class _Held:
    """A ``streamer`` (transformers' ``TextStreamer``, ...) that is shown reply tokens only
    once a verdict has covered them: the prompt's before the first, then each streaming
    check's, then the whole reply's. A refused turn's tokens are never shown."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.held: list[torch.Tensor] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands over the prompt first
            self.prompt_seen = True
            self.inner.put(value)
        else:
            self.held.append(value)

    def end(self) -> None:
        """generate's own end: the guard ends the inner streamer after the last verdict."""

    def release(self) -> None:
        for value in self.held:
            self.inner.put(value)
        self.held.clear()

    def finish(self, show: bool) -> None:
        if show:
            self.release()
        self.held.clear()
        self.inner.end()


@dataclass
class _Turn:
    """One :meth:`Guard.chat` call in progress; also the stopping criterion ``generate``
    calls after each sampled token: the prompt's verdict after the first, a check of the
    reply every ``guard_stream_every`` tokens."""

    guard: Guard
    tap: StateTap
    prompt: ChatMessage
    reply_id: str
    prompt_len: int
    last: int | None = None  # max_new_tokens: the final verdict reads the last check's states
    prompt_verdict: Verdict | None = None
    prompt_done: bool = False
    refused: Literal["prompt", "reply"] | None = None
    checks: int = 0
    flagged_at: int | None = None
    errors: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the reply's ids sampled so far
    shown: _Held | None = None  # the caller's streamer, shown what verdicts covered

    def __call__(self, input_ids: torch.Tensor, scores: Any, **_: Any) -> torch.Tensor:
        stop = self.step(input_ids[0, self.prompt_len :].tolist())
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    def step(self, ids: list[int]) -> bool:
        """After the reply tokens ``ids`` were sampled: True stops generation."""
        g = self.guard
        self.ids = ids
        if not self.prompt_done:
            self.prompt_done = True
            self.prompt_verdict = g._judge_prompt(self)
            flagged = self.prompt_verdict is not None and self.prompt_verdict.decision == "flag"
            if g.refusing and flagged:
                self.refused = "prompt"
                return True
            self._release()
        every = g.settings.guard_stream_every
        if every and len(ids) % every == 0 and self.tap.decoded > 0 and len(ids) != self.last:
            self.checks += 1
            if g._reply_flags(self):
                self.flagged_at = self.flagged_at or len(ids)
                if g.refusing:
                    self.refused = "reply"
                    return True
            self._release()
        return False

    def _release(self) -> None:
        if self.shown is not None:
            self.shown.release()


class Guard:
    """Generate with the serving model and moderate the turn from its own hidden states.

    ``llm`` must hold the whole causal LM (``load_llm(settings, lm_head=True)``); its
    fingerprint is the one probes were trained against. One generation at a time: calls
    from several threads wait for each other (the hooks are on shared modules).
    """

    def __init__(
        self,
        llm: LoadedLLM,
        settings: Settings,
        redis_client: redis.Redis,
        *,
        worker_id: str | None = None,
    ) -> None:
        if llm.causal is None:
            raise ConfigError(
                f"the inline guard generates text, and this model has no LM head "
                f"({llm.lm_head_missing}); load it with load_llm(settings, lm_head=True)"
            )
        self.settings = settings
        self.llm = llm
        self.model: Any = llm.causal
        self.tokenizer: Any = llm.tokenizer
        # Its states come from the serving model's own passes; it runs a pass of its own
        # only for a probe swapped in mid-turn that reads other layers.
        extractor = HiddenStateExtractor.for_llm(llm, settings)
        self.door = FrontDoor(
            settings, extractor, redis_client, FrontSettings.guard(settings), worker_id=worker_id
        )
        self.engine = self.door.engine
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, redis_client: redis.Redis | None = None) -> Guard:
        """Load ``settings.model`` with its LM head and connect to Redis (``make_redis``)."""
        from worker.store.redis import make_redis

        client = redis_client if redis_client is not None else make_redis(settings)
        return cls(load_llm(settings, lm_head=True), settings, client)

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> Guard:
        """The probe watcher and the Kafka outbox; probes load in the background."""
        if self.settings.text_form != "chat":
            log.warning(
                "the inline guard reads %s-form probes inside the chat template: scores are "
                "approximate (on ToxicChat a raw MHA probe loses 17 AUPRC points there, "
                "bench/text_form.md); train on PROBEGUARD_TEXT_FORM=chat for the scorer's "
                "scores (the packaged default ships a chat-form one)",
                self.settings.text_form,
            )
        self.door.start()
        return self

    def stop(self) -> None:
        self.door.stop()

    def __enter__(self) -> Guard:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def ready(self) -> bool:
        """Every probe has a live version to score with."""
        return self.door.ready()

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.ready()

    @property
    def refusing(self) -> bool:
        return self.settings.guard_on_flag == "refuse"

    # --- one turn --------------------------------------------------------------------

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        message_id: str | None = None,
        conversation_id: str | None = None,
        user_id: str | None = None,
        **generate: Any,
    ) -> GuardedReply:
        """Answer the conversation's last (user) turn, moderated.

        ``messages``: ``{"role", "content"}`` turns, the last one the user's, the earlier
        ones its history. ``generate``: ``model.generate`` options (``max_new_tokens``,
        ``do_sample``, ``streamer``, ...). The prompt's verdict is made after the prefill,
        before the second token; with ``refuse`` a flagged prompt generates nothing more.
        Raises ``ValueError`` for a conversation that does not end in a user turn.
        """
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("the conversation must end with the user's turn")
        if not self.ready():
            raise RuntimeError("no probe is loaded yet: wait_ready() first")
        raw = str(messages[-1].get("content", ""))
        try:
            text = clean_text(raw, max_chars=self.settings.max_text_chars)
        except ExtractionInputError as exc:  # nothing a model or a probe can read
            raise ValueError(f"the user's turn cannot be read: {exc}") from None
        prompt = ChatMessage.build(
            self.settings.limits,
            message_id=message_id or uuid.uuid4().hex,
            conversation_id=conversation_id or uuid.uuid4().hex,
            user_id=user_id,
            text=text,
            created_at=utcnow(),
        )
        turn = turn_ids(
            self.tokenizer,
            messages[:-1],
            system_prompt=self.settings.chat_system_prompt,
        )
        content = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        # Chat form: the text and the suffix, as the probes were trained; raw and prompt
        # forms: the text alone (the prompt's suffix is not in the chat template).
        frame = turn.frame(pool_suffix=self.settings.text_form == "chat")
        ids = frame.ids(content)
        with self._lock:
            layers = self.engine.batch_scorer.layers()
            tap = StateTap(self.llm, layers, frame.span(len(content)), self.engine.extractor.dtype)
            last = generate.get("max_new_tokens")
            state = _Turn(self, tap, prompt, uuid.uuid4().hex, len(ids), last)
            out = self._generate(ids, tap, state, generate)
            reply_text = self.tokenizer.decode(out, skip_special_tokens=True)
            reply = None
            if state.refused != "prompt":
                reply = self._judge_reply(state, reply_text)
                if self.refusing and reply is not None and reply.decision == "flag":
                    state.refused = "reply"
            if state.shown is not None:
                state.shown.finish(show=state.refused is None)
        shown = self.settings.guard_refusal if state.refused else reply_text
        return GuardedReply(
            text=shown,
            generated=reply_text,
            prompt_id=prompt.message_id,
            reply_id=state.reply_id,
            prompt=state.prompt_verdict,
            reply=reply,
            refused=state.refused,
            tokens=len(out),
            checks=state.checks,
            flagged_at=state.flagged_at,
            errors=state.errors,
        )

    def _generate(
        self, ids: list[int], tap: StateTap, turn: _Turn, options: dict[str, Any]
    ) -> list[int]:
        from transformers import StoppingCriteriaList

        device = self.llm.device
        input_ids = torch.tensor([ids], device=device)
        criteria = StoppingCriteriaList([turn])
        extra = options.pop("stopping_criteria", None)
        if extra:
            criteria.extend(extra)
        if options.get("streamer") is not None:
            turn.shown = options["streamer"] = _Held(options["streamer"])
        options.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        autocast = self.llm.autocast
        with (
            tap.attached(),
            torch.no_grad(),  # generate's own mode: inference tensors would poison the engine
            torch.autocast(device.type, dtype=autocast, enabled=autocast is not None),
        ):
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                stopping_criteria=criteria,
                **options,
            )
        reply = out[0, len(ids) :].tolist()
        if turn.refused == "prompt":
            return []  # the one token sampled before the prompt's verdict
        return [int(i) for i in reply]

    def _judge_prompt(self, turn: _Turn) -> Verdict | None:
        return self._judge(turn.prompt, turn.tap.prompt_states(), Retain.ALL, turn)

    def _reply_flags(self, turn: _Turn) -> bool:
        """A streaming check: does the reply so far flag? (Recorded nowhere.)"""
        so_far = self.tokenizer.decode(turn.ids, skip_special_tokens=True)
        message = self._reply_message(turn, so_far)
        if message is None:
            return False
        verdict = self._judge(message, turn.tap.reply_states(), Retain.NOTHING, turn, send=False)
        return verdict is not None and verdict.decision == "flag"

    def _judge_reply(self, turn: _Turn, text: str) -> Verdict | None:
        """The whole reply's verdict, recorded and sent like the prompt's."""
        message = self._reply_message(turn, text)
        if turn.tap.decoded == 0 or message is None:
            return None
        return self._judge(message, turn.tap.reply_states(), Retain.ALL, turn)

    def _reply_message(self, turn: _Turn, text: str) -> ChatMessage | None:
        try:
            text = clean_text(text, max_chars=self.settings.max_text_chars)
        except ExtractionInputError:
            return None  # nothing readable yet (whitespace, control characters)
        return ChatMessage.build(
            self.settings.limits,
            message_id=turn.reply_id,
            conversation_id=turn.prompt.conversation_id,
            text=text,
            created_at=utcnow(),
            reply_to=turn.prompt.message_id,
        )

    def _judge(
        self,
        message: ChatMessage,
        states: torch.Tensor,
        retain: Retain,
        turn: _Turn,
        *,
        send: bool = True,
    ) -> Verdict | None:
        """Score ``message`` from ``states`` ``[L, 1, n, D]`` through the engine, with the
        turn's hooks off: a pass of the engine's own (a probe swapped in that reads other
        layers) is no part of the generation."""
        with turn.tap.detached():
            judged = self.door.judge(
                [message],
                [retain],
                review=send,
                states=Extraction.of_one(states, turn.tap.layers),
            )
        if send:
            self.door.send(judged)
        if 0 in judged.errors:
            turn.errors.append(f"{message.message_id}: {judged.errors[0]}")
        return judged.verdicts.get(0)
