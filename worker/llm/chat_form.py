"""The chat form of a message: the text as the model reads it when it serves the message as
a chat turn, through the tokenizer's own chat template.

A chat model never reads a user's message bare: its prompt is the template's system
prompt, the earlier turns, a user header, the text, the end of the turn and the assistant
header (SmolLM2: ``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`` + text +
``<|im_end|>\\n<|im_start|>assistant\\n``). A probe that is to read the serving model's own
hidden states (:mod:`worker.guard`) must be trained on states of that form.

:func:`turn_ids` splits the rendered template around the text into

- ``context``: the ids before the text; the model runs them (they condition every later
  state) but the probe does not pool them;
- ``suffix``: the ids after the text (end of turn, generation prompt); pooled with the
  text's own tokens: the assistant header is where the model has read the whole turn.

The text itself is tokenized alone, so ``context + ids(text) + suffix`` is the same id
sequence for the extractor (training, the Kafka scorer) and for the guard (generation),
by construction; tokenizing the rendered string in one go could merge across the seams.

Which of those ids a probe pools is :class:`Frame`'s to say, for the extractor's inputs
and the guard's prompts alike.

Example::

    turn = turn_ids(tokenizer)                 # the template's default system prompt
    frame = turn.frame()
    content = tokenizer.encode(text, add_special_tokens=False)
    ids, (start, end) = frame.ids(content), frame.span(len(content))
    turn.key                                   # "chat-3f2a...": names the form
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.errors import ConfigError

__all__ = ["PLACEHOLDER", "ChatTurn", "Frame", "prompt_ids", "turn_ids"]

# Stands for the text while the template renders; no template or text contains it.
PLACEHOLDER = "\u2063probeguard-text\u2063"


@dataclass(frozen=True)
class Frame:
    """The ids a model input puts around a text's own ids, and the span a probe pools.

    ``context`` runs first and is never pooled (the chat form's template before the text);
    ``prefix`` and ``suffix`` are pooled with the text (a raw text's special tokens; the
    chat form's end of turn and assistant header, where the model has read the whole turn),
    the suffix only with ``pool_suffix`` (the guard reading raw-form probes inside the
    template pools the text alone).
    """

    context: tuple[int, ...] = ()
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    pool_suffix: bool = True

    def ids(self, content: Sequence[int]) -> list[int]:
        """What the model runs for a text whose own ids are ``content``."""
        return [*self.context, *self.prefix, *content, *self.suffix]

    def span(self, n: int) -> tuple[int, int]:
        """``[start, end)`` of :meth:`ids` that the probe pools, for ``n`` content ids."""
        start = len(self.context)
        tail = len(self.suffix) if self.pool_suffix else 0
        return start, start + len(self.prefix) + n + tail

    @property
    def size(self) -> int:
        """Ids put around every text."""
        return len(self.context) + len(self.prefix) + len(self.suffix)


@dataclass(frozen=True)
class ChatTurn:
    """The ids around one user turn's text (see the module docstring)."""

    context: tuple[int, ...]
    suffix: tuple[int, ...]
    form: str = "chat"  # or "prompt": the text inside a prompt of the settings' (prompt_ids)

    @property
    def key(self) -> str:
        """The form and 16 hex digits of the ids' sha256 (``chat-3f2a...``): two forms with
        the same key put the same ids around a text (the fingerprint's ``text_form``)."""
        body = ",".join(map(str, self.context)) + "|" + ",".join(map(str, self.suffix))
        return f"{self.form}-" + hashlib.sha256(body.encode()).hexdigest()[:16]

    def frame(self, *, pool_suffix: bool = True) -> Frame:
        """The turn's ids as a :class:`Frame`: the context runs, the text and (with
        ``pool_suffix``, as chat-form probes are trained) the suffix are pooled."""
        return Frame(self.context, (), self.suffix, pool_suffix)


def turn_ids(
    tokenizer: Any,
    history: Sequence[Mapping[str, str]] = (),
    *,
    system_prompt: str | None = None,
) -> ChatTurn:
    """The ids around a new user turn after ``history`` (earlier ``{"role", "content"}``
    turns), with the generation prompt. ``system_prompt`` (None: the template's own
    default, if it has one) is put first unless ``history`` starts with a system turn.

    Raises :class:`ConfigError` when the tokenizer has no chat template, or the template
    does not put the user's text into the prompt exactly once.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template: the chat "
            "form needs one (PROBEGUARD_TEXT_FORM=raw reads the bare text)"
        )
    turns = [dict(t) for t in history]
    if system_prompt is not None and not (turns and turns[0].get("role") == "system"):
        turns.insert(0, {"role": "system", "content": system_prompt})
    turns.append({"role": "user", "content": PLACEHOLDER})
    rendered = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    if not isinstance(rendered, str) or rendered.count(PLACEHOLDER) != 1:
        raise ConfigError("the chat template does not render the user's text exactly once")
    before, after = rendered.split(PLACEHOLDER)
    return ChatTurn(_ids(tokenizer, before), _ids(tokenizer, after))


def prompt_ids(tokenizer: Any, template: str) -> ChatTurn:
    """The ids around a text put into ``template`` where ``{text}`` stands (the prompt
    form, ``PROBEGUARD_TEXT_PROMPT``): what comes before runs unpooled, what comes after is
    pooled with the text. Each side is tokenized alone, as the chat form's are."""
    if template.count("{text}") != 1:
        raise ConfigError(f"the text prompt must hold {{text}} exactly once: {template!r}")
    before, after = template.split("{text}")
    return ChatTurn(_ids(tokenizer, before), _ids(tokenizer, after), form="prompt")


def _ids(tokenizer: Any, part: str) -> tuple[int, ...]:
    return tuple(tokenizer(part, add_special_tokens=False)["input_ids"]) if part else ()
