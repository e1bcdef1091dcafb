"""Hidden states of the frozen LLM for a batch of texts: only the layers a probe reads, and
no layer above the deepest of them is ever computed.

Layer indices (the convention of transformers' ``output_hidden_states``):

- ``0``: the embedding output, i.e. the input of the first transformer block (for models
  that scale embeddings before the blocks, e.g. Gemma, the scaled value);
- ``i`` for ``1 <= i < num_layers``: the output of block ``i``;
- ``num_layers``: the model's ``last_hidden_state``. For decoders with a final norm
  (Llama, Qwen, Mistral, SmolLM2) that is the last block's output **after the final
  norm**; BERT-style encoders have no final norm (each block ends in its own LayerNorm),
  so it is the last block's output.

How a text becomes tokens:

1. Cleaning (:mod:`worker.llm.text`): a text that is not valid text, or is empty once
   control characters are removed, is rejected into ``Extraction.errors``; the canonical
   form is what is tokenized; callers keep the original.
2. Huge texts are first clipped (:mod:`worker.llm.text`), so a megabyte of text never
   reaches the tokenizer.
3. Tokens beyond ``max_tokens`` (special tokens included) are dropped: ``"head"`` keeps
   the first ones, ``"head_tail"`` the first half and the last half (the middle goes).
4. With ``max_chunks > 1``, a text longer than ``max_tokens`` is instead cut into at most
   ``max_chunks`` chunks of near-equal length; each chunk is encoded separately (own
   special tokens, positions from 0) and their token states are concatenated in one
   output row, so the probe's token pooling combines them (masked mean = token-weighted
   mean over chunks, max = max over chunks, gate/attention over all chunks' tokens).
   Beyond ``max_chunks`` chunks the truncation rule applies first.
5. ``text_form="chat"`` reads the text as a user turn of the tokenizer's chat template
   (:mod:`worker.llm.chat_form`): each model input is ``context + ids(text) + suffix``
   (the template's ids before and after the text, instead of the special tokens). The
   context runs (it conditions every state, takes positions ``0..``, and counts toward
   ``max_tokens``) but is not part of the output row; the suffix is. Every chunk gets both.
   ``text_form="prompt"`` does the same with ``text_prompt`` (the ids before and after
   ``{text}``), PromptEOL's "means in one word" prompt by default.

Batching (:mod:`worker.llm.plan`, which also cuts the chunks): the pieces of all texts are
sorted by length and cut into micro-batches by count, padded tokens and fill. The forward
pass (:mod:`worker.llm.forward`, which also runs each micro-batch and tells a device fault
from a bad text) runs only up to the deepest wanted layer. Position ids
come from the attention mask, so a text's hidden states do not depend on its batch or the
padding side (within floating-point tolerance). Each output row holds its text's tokens
contiguously, padded on the tokenizer's ``padding_side``; padded positions are zero and
``mask`` False.

Example::

    ex = HiddenStateExtractor.from_settings(load_settings())
    out = ex.extract(["hello there", b"\\xff"], layers=[0, 15])
    out.hidden.shape  # [2, 1, T, 576]: layers 0 and 15, one text extracted
    out.errors        # {1: "invalid_utf8: ..."}
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Self, cast

import torch

from worker.errors import ConfigError, ExtractionError, ExtractionInputError
from worker.llm.chat_form import ChatTurn, Frame, prompt_ids, turn_ids
from worker.llm.forward import (
    ExitStage,
    Staged,
    run_isolating,
    run_micro_batch,
)
from worker.llm.load import LoadedLLM, load_llm
from worker.llm.plan import (
    Batching,
    Padding,
    Piece,
    chunk,
    length_batches,
    plan_pieces,
    span_mask,
)
from worker.llm.text import TokenMemo, Truncation, clean_text, special_affixes
from worker.settings.llm import PROMPT_TEMPLATE

if TYPE_CHECKING:
    from schemas import LLMFingerprint
    from worker.settings import LLMSettings

# ExitStage (forward), Truncation and clean_text (text): callers import them from here.
__all__ = ["ExitStage", "Extraction", "HiddenStateExtractor", "Truncation", "clean_text"]

log = logging.getLogger(__name__)

# Texts whose tokenization is remembered (see HiddenStateExtractor._tokenize): a few polls.
_MEMO_TEXTS = 1024


@dataclass
class Extraction:
    """Hidden states of the extracted texts; ``index[b]`` is row ``b``'s input position.

    With an :class:`ExitStage`, the texts decided at its layer are not among the rows: they
    are in ``exited`` (input position -> the stage's payload row), with ``exit_layer``.
    """

    hidden: torch.Tensor  # [L_sel, B_ok, T, D], in `layers` order, zero at padding
    mask: torch.Tensor  # [B_ok, T] bool, True = real token
    layers: tuple[int, ...]
    index: list[int]
    errors: dict[int, str] = field(default_factory=dict)  # input position -> "kind: reason"
    exited: dict[int, torch.Tensor] = field(default_factory=dict)  # input position -> payload
    exit_layer: int | None = None

    def layer(self, index: int) -> torch.Tensor:
        """``[B_ok, T, D]`` states of hidden-state index ``index`` (one of ``layers``)."""
        return self.hidden[self.layers.index(index)]

    @classmethod
    def of_one(cls, hidden: torch.Tensor, layers: Sequence[int]) -> Extraction:
        """One text's states ``[L, 1, n, D]`` of ``layers``, every position its own (the
        inline guard's, taken from the serving model's own passes)."""
        mask = torch.ones(1, hidden.shape[2], dtype=torch.bool, device=hidden.device)
        return cls(hidden=hidden, mask=mask, layers=tuple(layers), index=[0])

    def select(self, layers: Sequence[int]) -> Extraction | None:
        """These states for ``layers``, in that order; None when one of them is not held."""
        if not set(layers) <= set(self.layers):
            return None
        pick = [self.layers.index(layer) for layer in layers]  # [L_sel]
        return replace(self, hidden=self.hidden[pick], layers=tuple(layers))


class HiddenStateExtractor:
    """Run the frozen LLM on texts and return the requested layers' hidden states.

    ``device`` and ``dtype`` are those of the returned tensors (default: the model's).
    The returned tensors are ordinary tensors (not inference-mode ones), so they can feed
    probe training directly. Forward passes are serialised by a lock; one extractor can
    be shared between threads.

    ``text_form="chat"`` puts each text into the tokenizer's chat template as a user turn
    after ``chat_system_prompt`` (None: the template's default); ``"prompt"`` into
    ``text_prompt`` where ``{text}`` stands; see the module docstring.
    """

    def __init__(
        self,
        llm: LoadedLLM,
        *,
        max_tokens: int,
        truncation: Truncation = "head",
        batch_size: int = 16,
        batch_tokens: int | None = None,
        batch_min_fill: float = 0.0,
        max_chunks: int = 1,
        buckets: Sequence[int] | None = None,
        scatter: bool | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        text_form: Literal["raw", "chat", "prompt"] = "raw",
        chat_system_prompt: str | None = None,
        text_prompt: str = PROMPT_TEMPLATE,
    ) -> None:
        if text_form not in ("raw", "chat", "prompt"):
            raise ConfigError(f"text_form must be 'raw', 'chat' or 'prompt', not {text_form!r}")
        if truncation not in ("head", "head_tail"):
            raise ConfigError(f"truncation must be 'head' or 'head_tail', not {truncation!r}")
        if batch_size < 1 or max_chunks < 1 or (batch_tokens is not None and batch_tokens < 1):
            raise ConfigError(
                f"batch_size={batch_size}, batch_tokens={batch_tokens}, max_chunks={max_chunks}: "
                "must be >= 1"
            )
        self.llm = llm
        self.truncation: Truncation = truncation
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens  # None: no token budget, batch_size pieces per pass
        self.batch_min_fill = batch_min_fill  # 0: rows of any length share a pass
        self.max_chunks = max_chunks
        # Widths a pass is padded up to (None: its longest piece): a few shapes, not one per
        # length (positions come from the attention mask, so the states do not change).
        self.buckets = tuple(sorted(buckets)) if buckets else None
        # How a pass's states reach the output: one gather + scatter per layer (None: off
        # the CPU, where each row's copy would be a kernel launch), or a slice copy per row
        # (on the CPU 2.5x faster than the scatter: 0.4 vs 1.1 ms a layer for 16 rows).
        self.scatter = llm.device.type != "cpu" if scatter is None else scatter
        self.max_tokens = max_tokens
        self.device = torch.device(device) if device is not None else llm.device
        self.dtype = dtype or llm.dtype
        tokenizer = llm.tokenizer
        self._pad_id = int(tokenizer.pad_token_id)
        self.text_form = text_form
        self._turn: ChatTurn | None = None
        if text_form in ("chat", "prompt"):
            self._turn = (
                turn_ids(tokenizer, system_prompt=chat_system_prompt)
                if text_form == "chat"
                else prompt_ids(tokenizer, text_prompt)
            )
            self._frame = self._turn.frame()  # the context runs before every piece, not output
        else:
            prefix, suffix = special_affixes(tokenizer)
            self._frame = Frame((), tuple(prefix), tuple(suffix))
        around = self._frame.size
        self._budget = max_tokens - around  # content tokens
        if self._budget < 1:
            raise ConfigError(
                f"max_tokens={max_tokens} leaves no room next to the {around} ids put around "
                f"a text ({text_form} form)"
            )
        limit = getattr(llm.model.config, "max_position_embeddings", None)
        if limit is not None and max_tokens > limit:
            raise ConfigError(f"max_tokens={max_tokens} exceeds the model's {limit} positions")
        params = inspect.signature(llm.model.forward).parameters
        self._pass_positions = "position_ids" in params
        self._pass_no_cache = "use_cache" in params
        self._lock = threading.Lock()
        self._memo = TokenMemo(
            tokenizer, max_tokens=self._budget * max_chunks, keep=truncation, size=_MEMO_TEXTS
        )

    @classmethod
    def from_settings(cls, settings: LLMSettings) -> HiddenStateExtractor:
        """Load ``settings.model`` and wrap it with the settings' batching and truncation."""
        return cls.for_llm(load_llm(settings), settings)

    @classmethod
    def for_llm(cls, llm: LoadedLLM, settings: LLMSettings) -> Self:
        """Wrap a loaded ``llm`` with the settings' batching (for its device, see
        :meth:`~worker.llm.plan.Batching.for_device`) and truncation."""
        batching = Batching.for_device(settings, llm.device)
        return cls(
            llm,
            max_tokens=settings.max_tokens,
            truncation=settings.truncation,
            batch_size=batching.batch_size,
            batch_tokens=batching.batch_tokens,
            batch_min_fill=batching.min_fill,
            buckets=batching.buckets,
            max_chunks=settings.max_chunks,
            text_form=settings.text_form,
            chat_system_prompt=settings.chat_system_prompt,
            text_prompt=settings.text_prompt,
        )

    @property
    def batching(self) -> Batching:
        """How this extractor cuts a call into forward passes (the scorer's planner cuts a
        backlog the same way)."""
        return Batching(self.batch_size, self.batch_tokens, self.batch_min_fill, self.buckets)

    @property
    def _left_pad(self) -> bool:
        # Read per call: the tokenizer's padding_side can be changed after construction.
        return bool(self.llm.tokenizer.padding_side == "left")

    @property
    def num_layers(self) -> int:
        return self.llm.num_layers

    @property
    def hidden_size(self) -> int:
        return self.llm.hidden_size

    @property
    def model_type(self) -> str:
        """The LLM's architecture (``config.model_type``): it decides ``STATE_DTYPE=auto``."""
        return self.llm.model_type

    @property
    def fingerprint(self) -> LLMFingerprint:
        """The LLM's fingerprint, with the chat or prompt form's key as ``text_form`` (raw: None):
        states of one form are not the other's, so probes of one are refused on the other."""
        if self._turn is None:
            return self.llm.fingerprint
        return self.llm.fingerprint.model_copy(update={"text_form": self._turn.key})

    @property
    def autocast(self) -> Literal["bfloat16", "float16"] | None:
        """The dtype the forward pass autocasts to (``PROBEGUARD_AUTOCAST``), None: off."""
        dtype = self.llm.autocast
        return None if dtype is None else cast(Any, str(dtype).removeprefix("torch."))

    # --- the public call ------------------------------------------------------------------

    def extract(self, texts: Sequence[str | bytes], layers: Sequence[int]) -> Extraction:
        """Hidden states of ``layers`` for every text that can be extracted.

        A text that cannot (see :func:`clean_text`, or a forward pass that fails for it
        alone) is left out of ``hidden`` and named in ``errors``; it never fails the rest.
        Raises :class:`ExtractionError` only for an invalid ``layers``.
        """
        return self.extract_staged(texts, layers, None)

    def extract_staged(
        self,
        texts: Sequence[str | bytes],
        layers: Sequence[int],
        exit_stage: ExitStage | None,
    ) -> Extraction:
        """:meth:`extract` with an exit stage (ignored unless some wanted layer is deeper
        than its layer): the texts it decides are left out of ``hidden`` too and named in
        ``exited``. Raises :class:`ExtractionError` also for an invalid exit layer."""
        wanted = self._check_layers(layers)
        if exit_stage is not None and not 1 <= exit_stage.layer < self.num_layers:
            raise ExtractionError(
                f"exit layer must be in [1, {self.num_layers - 1}], got {exit_stage.layer}"
            )
        if exit_stage is not None and max(wanted) <= exit_stage.layer:
            exit_stage = None
        errors: dict[int, str] = {}
        tokenized = self._tokenize(texts, errors)
        index = [pos for pos, _ in tokenized]
        pieces, lengths = self._plan([ids for _, ids in tokenized])
        T = max(lengths, default=0)
        starts = [T - n if self._left_pad else 0 for n in lengths]
        shape = (len(wanted), len(index), T, self.hidden_size)  # [L_sel, B_ok, T, D]
        if self.device.type == "cpu":
            # Every real token is written exactly once below; only padding needs zeroing,
            # which spares a pass over (and page faults on) an output that can be hundreds
            # of MB.
            hidden = torch.empty(shape, device=self.device, dtype=self.dtype)
            for row, (start, n) in enumerate(zip(starts, lengths, strict=True)):
                hidden[:, row, :start] = 0
                hidden[:, row, start + n :] = 0
        else:  # an accelerator: one memset, not two kernel launches per row
            hidden = torch.zeros(shape, device=self.device, dtype=self.dtype)
        mask = span_mask(starts, lengths, T).to(self.device)  # [B_ok, T]
        failed: dict[int, str] = {}
        with self._lock, torch.inference_mode():
            staged = None
            if exit_stage is not None:
                chunked = {p.row for p in pieces if p.offset > 0}
                staged = Staged(exit_stage, index, frozenset(chunked))
            for batch in self._micro_batches(pieces):
                failed.update(run_isolating(self._run, batch, wanted, hidden, starts, staged))
        exited = {} if staged is None else staged.exited
        exited = {row: v for row, v in exited.items() if row not in failed}
        if failed or exited:
            for row, reason in failed.items():
                errors[index[row]] = reason
            keep = [row for row in range(len(index)) if row not in failed and row not in exited]
            # Drop the failed rows, and the padding only they needed.
            width = max((lengths[row] for row in keep), default=0)
            cols = slice(T - width, T) if self._left_pad else slice(0, width)
            hidden, mask = hidden[:, keep, cols], mask[keep, cols]
            exited = {index[row]: v for row, v in sorted(exited.items())}
            index = [index[row] for row in keep]
        return Extraction(
            hidden=hidden,
            mask=mask,
            layers=wanted,
            index=index,
            errors=errors,
            exited=exited,
            exit_layer=exit_stage.layer if exit_stage is not None else None,
        )

    def token_ids(self, text: str | bytes) -> list[int]:
        """Token ids of ``text`` as :meth:`extract` outputs them: its row's real positions,
        in order (special tokens, truncation, chunks and the chat form's suffix included;
        the chat form's context, run but not output, left out).

        Raises :class:`ExtractionInputError` when the text cannot be extracted.
        """
        errors: dict[int, str] = {}
        tokenized = self._tokenize([text], errors)
        if not tokenized:
            kind, _, reason = errors.get(0, "failed: no tokens").partition(": ")
            raise ExtractionInputError(kind, reason)
        pieces, _ = self._plan([tokenized[0][1]])
        ordered = sorted(pieces, key=lambda p: p.offset)
        return [i for piece in ordered for i in piece.ids[piece.skip :]]

    def token_counts(self, texts: Sequence[str | bytes]) -> list[int]:
        """Real tokens :meth:`extract` would run for each text (special tokens, truncation,
        chunks and the chat form's context included, though the context is no part of the
        output row; 0 for a text it cannot extract): what a batch costs."""
        errors: dict[int, str] = {}
        tokenized = self._tokenize(texts, errors)
        counts = [0] * len(texts)
        pieces, _ = self._plan([ids for _, ids in tokenized])
        for piece in pieces:
            counts[tokenized[piece.row][0]] += len(piece.ids)
        return counts

    # --- texts to pieces ------------------------------------------------------------------

    def _check_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        wanted = tuple(layers)
        bad: list[object] = [i for i in wanted if isinstance(i, bool) or not isinstance(i, int)]
        bad += [i for i in wanted if isinstance(i, int) and not 0 <= i <= self.num_layers]
        if not wanted or bad or len(set(wanted)) != len(wanted):
            raise ExtractionError(
                f"layers must be distinct ints in [0, {self.num_layers}], got {list(wanted)}"
            )
        return wanted

    def _tokenize(
        self, texts: Sequence[str | bytes], errors: dict[int, str]
    ) -> list[tuple[int, list[int]]]:
        """``(input position, content token ids)`` of every text that survives cleaning
        (each text cleaned and tokenized once across calls: :class:`TokenMemo`)."""
        return self._memo(texts, errors)

    def _plan(self, contents: list[list[int]]) -> tuple[list[Piece], list[int]]:
        """Pieces to run, and each row's output token count (the context left out)."""
        return plan_pieces(contents, self._frame, self._chunks)

    def _chunks(self, content: list[int]) -> list[list[int]]:
        return chunk(content, self._budget, self.max_chunks, self.truncation)

    def _micro_batches(self, pieces: list[Piece]) -> list[list[Piece]]:
        groups = length_batches(
            [len(p.ids) for p in pieces], self.batch_tokens, self.batch_size, self.batch_min_fill
        )
        return [[pieces[i] for i in group] for group in groups]

    # --- running the model ----------------------------------------------------------------

    def _run(
        self,
        batch: list[Piece],
        wanted: tuple[int, ...],
        hidden: torch.Tensor,
        starts: list[int],
        staged: Staged | None = None,
    ) -> None:
        padding = Padding(self._pad_id, self._left_pad, self.buckets)
        run_micro_batch(
            self.llm,
            batch,
            wanted,
            hidden,
            starts,
            staged,
            padding,
            self._model_inputs,
            scatter=self.scatter,
        )

    def _model_inputs(self, input_ids: torch.Tensor, attention: torch.Tensor) -> dict[str, Any]:
        model_device = self.llm.device
        kwargs: dict[str, Any] = {"input_ids": input_ids.to(model_device)}
        kwargs["attention_mask"] = attention.to(model_device)
        if self._pass_positions:  # positions count real tokens only: left padding is harmless
            kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp_(min=0)
        if self._pass_no_cache:
            kwargs["use_cache"] = False
        return kwargs
