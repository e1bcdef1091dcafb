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

1. Cleaning (:func:`clean_text`): ``bytes`` are decoded as strict UTF-8; control
   characters (Unicode ``Cc`` except tab, LF, CR) are removed; a text that is then
   empty or whitespace-only is rejected. Rejections go to ``Extraction.errors``. Then
   the canonical form (:mod:`worker.llm.canonical`: NFKC, format characters removed,
   spelled-out letters joined) is what is tokenized; callers keep the original.
2. Huge texts are first clipped to ``32`` characters per token they can use (head, or
   head and tail), so a megabyte of text never reaches the tokenizer.
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

Batching: the pieces of all texts are sorted by length (longest first) and cut into
micro-batches of at most ``batch_size`` pieces and at most ``batch_tokens`` padded tokens
(pieces × the longest piece in the micro-batch), so short texts are not padded to long
ones and a long text runs alone rather than inflating a batch of short ones; a piece
shorter than ``batch_min_fill`` × the micro-batch's longest starts a new one, so padding
never outweighs a row's own tokens that much (chat lengths are skewed: a batch of 8
ToxicChat texts padded to its longest held 3.7× its real tokens). Position ids
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
import itertools
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar, cast

import torch

from worker.errors import ConfigError, DeviceError, ExtractionError, ExtractionInputError
from worker.llm.canonical import canonical_text
from worker.llm.chat_form import ChatTurn, turn_ids
from worker.llm.load import LoadedLLM, load_llm

if TYPE_CHECKING:
    from schemas import LLMFingerprint
    from worker.settings import Settings

__all__ = [
    "CUDA_BATCH_TOKENS",
    "Batching",
    "ExitStage",
    "Extraction",
    "HiddenStateExtractor",
    "Truncation",
    "clean_text",
    "token_buckets",
]

log = logging.getLogger(__name__)

Truncation = Literal["head", "head_tail"]
_Seq = TypeVar("_Seq", str, list[int])
# Characters kept per usable token before tokenizing: generous, since only tokens longer
# than this on average (long runs of one character) would lose content to the clip.
_CHARS_PER_TOKEN = 32
# Texts whose tokenization is remembered (see HiddenStateExtractor._tokenize): a few polls.
_MEMO_TEXTS = 1024
# Unicode Cc except \t \n \r.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# Padded tokens per forward pass on CUDA unless BATCH_TOKENS is set: 256 texts of 256
# tokens, one pass per scoring call. The forward there is launch-bound up to ~64 texts
# (issue 44, one H200: 1 x 32 tokens 25.2 ms, 64 x 64 tokens 21.8 ms), so the CPU's
# length-sorted 4096-token passes ran a 64-message call as several passes of the same cost.
CUDA_BATCH_TOKENS = 65536


@dataclass(frozen=True)
class Batching:
    """How a call's texts are cut into forward passes (see the module docstring)."""

    batch_size: int  # pieces per pass at most
    batch_tokens: int | None  # padded tokens per pass at most (None: no budget)
    min_fill: float  # a piece shorter than this share of its pass's longest starts another
    buckets: tuple[int, ...] | None = None  # widths a pass is padded up to (None: its longest)

    @classmethod
    def for_device(cls, settings: Settings, device: torch.device) -> Batching:
        """The settings' batching for an LLM on ``device``: as set on the CPU (length-sorted
        token budgets, measured there: ``bench/batching.py``); on CUDA, what the settings
        leave at its default is one pass per call, up to :data:`CUDA_BATCH_TOKENS` padded
        tokens and no split by length, since a pass costs about the same whatever its rows;
        and its width padded up to one of a few sizes (:func:`token_buckets`), so that the
        passes repeat a few shapes (what CUDA graphs and compiled kernels are made for).
        """
        tokens, fill = settings.batch_tokens or None, settings.batch_min_fill
        if device.type != "cuda":
            return cls(settings.batch_size, tokens, fill)
        chosen = settings.model_fields_set
        tokens = tokens if "batch_tokens" in chosen else CUDA_BATCH_TOKENS
        fill = fill if "batch_min_fill" in chosen else 0.0
        return cls(settings.batch_size, tokens, fill, token_buckets(settings.max_tokens))


def token_buckets(max_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Pass widths: powers of two from ``smallest`` below ``max_tokens``, then it.

    >>> token_buckets(256)
    (16, 32, 64, 128, 256)
    >>> token_buckets(300)
    (16, 32, 64, 128, 256, 300)
    """
    sizes = []
    width = smallest
    while width < max_tokens:
        sizes.append(width)
        width *= 2
    return (*sizes, max_tokens)


@dataclass(frozen=True)
class ExitStage:
    """Decide some rows at a shallow layer; only the others continue the forward pass.

    After hidden-state index ``layer`` (``1 <= layer < num_layers``) is computed for a
    micro-batch, ``decide(states [b, t, D], mask [b, t] bool, positions)`` (``mask``: the
    tokens of the rows' output, i.e. without the chat form's context; ``positions``: the
    rows' input positions) returns ``(exit [b] bool, payload [b, ...])``: rows with
    ``exit`` set are decided there (their payload row is kept in
    :attr:`Extraction.exited`), the others run on from block ``layer + 1`` in a smaller
    batch. A text cut into several chunks always continues (its row spans several
    model inputs). If ``decide`` raises, every row continues (full depth is never wrong).
    """

    layer: int
    decide: Callable[[torch.Tensor, torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor]]


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


@dataclass(frozen=True, slots=True)
class _Piece:
    """One model input: a whole text, or one chunk of a long text."""

    row: int  # output row
    offset: int  # where its output tokens start among the row's tokens
    ids: list[int]  # what the model runs: context, special tokens and the text's tokens
    skip: int = 0  # leading ids run but not output (the chat form's context)
    chunks: int = 1  # pieces of its row: 1, the piece is the whole row


class _EarlyExit(Exception):
    """Raised by the hook on the deepest requested layer, so no layer above it runs."""


@dataclass
class _Staged:
    """One :meth:`HiddenStateExtractor.extract` call's exit stage and what it decided."""

    stage: ExitStage
    positions: list[int]  # output row -> input position
    chunked: frozenset[int]  # output rows made of several pieces: they never exit
    exited: dict[int, torch.Tensor] = field(default_factory=dict)  # output row -> payload


@dataclass(frozen=True, slots=True)
class _Resume:
    """Run a forward pass from hidden-state index ``layer`` on: blocks ``1..layer`` pass
    their input through and the last of them returns ``states`` (``[b, t, D]``, the rows'
    states at ``layer`` from an earlier pass), so every block above runs with the masks
    and position embeddings the model itself builds for this batch (per layer type, e.g.
    Gemma's sliding and global layers)."""

    layer: int
    states: torch.Tensor  # [b, t, D]
    as_tuple: bool  # the blocks return (states, ...) rather than a tensor


class HiddenStateExtractor:
    """Run the frozen LLM on texts and return the requested layers' hidden states.

    ``device`` and ``dtype`` are those of the returned tensors (default: the model's).
    The returned tensors are ordinary tensors (not inference-mode ones), so they can feed
    probe training directly. Forward passes are serialised by a lock; one extractor can
    be shared between threads.

    ``text_form="chat"`` puts each text into the tokenizer's chat template as a user turn
    after ``chat_system_prompt`` (None: the template's default); see the module docstring.
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
        text_form: Literal["raw", "chat"] = "raw",
        chat_system_prompt: str | None = None,
    ) -> None:
        if text_form not in ("raw", "chat"):
            raise ConfigError(f"text_form must be 'raw' or 'chat', not {text_form!r}")
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
        self._context: list[int] = []  # run before every piece, not output
        self._prefix: list[int]
        self._suffix: list[int]
        if text_form == "chat":
            self._turn = turn_ids(tokenizer, system_prompt=chat_system_prompt)
            self._context, self._prefix = list(self._turn.context), []
            self._suffix = list(self._turn.suffix)
        else:
            self._prefix, self._suffix = _special_affixes(tokenizer)
        around = len(self._context) + len(self._prefix) + len(self._suffix)
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
        # text -> its content ids, or why it has none (see _tokenize); insertion-ordered
        self._memo: dict[str | bytes, list[int] | str] = {}
        self._memo_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> HiddenStateExtractor:
        """Load ``settings.model`` and wrap it with the settings' batching and truncation."""
        return cls.for_llm(load_llm(settings), settings)

    @classmethod
    def for_llm(cls, llm: LoadedLLM, settings: Settings) -> Self:
        """Wrap a loaded ``llm`` with the settings' batching (for its device, see
        :meth:`Batching.for_device`) and truncation."""
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
        """The LLM's fingerprint, with the chat form's key as ``text_form`` (raw: None):
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
        mask = _span_mask(starts, lengths, T).to(self.device)  # [B_ok, T]
        failed: dict[int, str] = {}
        with self._lock, torch.inference_mode():
            staged = None
            if exit_stage is not None:
                chunked = {p.row for p in pieces if p.offset > 0}
                staged = _Staged(exit_stage, index, frozenset(chunked))
            for batch in self._micro_batches(pieces):
                failed.update(self._run_isolating(batch, wanted, hidden, starts, staged))
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
        """``(input position, content token ids)`` of every text that survives cleaning.

        The last :data:`_MEMO_TEXTS` texts' outcomes are remembered: the scorer counts a
        poll's tokens to cut it (:meth:`token_counts`), then extracts the same texts, and
        each text is cleaned and tokenized once."""
        known: dict[int, list[int] | str] = {}
        with self._memo_lock:
            for pos, item in enumerate(texts):
                if isinstance(item, str | bytes) and (hit := self._memo.get(item)) is not None:
                    known[pos] = hit
        todo = [pos for pos in range(len(texts)) if pos not in known]
        fresh: dict[int, str] = {}
        found = self._tokenize_all([texts[pos] for pos in todo], fresh)
        outcome: dict[int, list[int] | str] = {todo[i]: ids for i, ids in found}
        outcome.update({todo[i]: why for i, why in fresh.items()})
        with self._memo_lock:
            for pos, result in outcome.items():
                item = texts[pos]
                if isinstance(item, str | bytes):
                    self._memo[item] = result
            while len(self._memo) > _MEMO_TEXTS:
                del self._memo[next(iter(self._memo))]  # the oldest first
        outcome.update(known)
        out: list[tuple[int, list[int]]] = []
        for pos in sorted(outcome):
            result = outcome[pos]
            if isinstance(result, str):
                errors[pos] = result
            else:
                out.append((pos, result))
        return out

    def _tokenize_all(
        self, texts: Sequence[str | bytes], errors: dict[int, str]
    ) -> list[tuple[int, list[int]]]:
        """:meth:`_tokenize` without the memo."""
        char_limit = self._budget * self.max_chunks * _CHARS_PER_TOKEN
        cleaned: list[tuple[int, str]] = []
        for pos, item in enumerate(texts):
            try:
                text = canonical_text(clean_text(item, max_chars=char_limit, keep=self.truncation))
                if not text.strip():
                    raise ExtractionInputError("empty", "text is only format characters")
                cleaned.append((pos, text))
            except ExtractionInputError as exc:
                errors[pos] = str(exc)
        if not cleaned:
            return []
        try:
            ids = self._encode([text for _, text in cleaned])
        except Exception as exc:  # find the one text the tokenizer chokes on
            log.warning("batch tokenization failed (%s); tokenizing texts one by one", exc)
            ids = []
            for pos, text in cleaned:
                try:
                    ids.append(self._encode([text])[0])
                except Exception as item_exc:
                    errors[pos] = str(ExtractionInputError("failed", f"tokenizer: {item_exc}"))
                    ids.append([])
        out = []
        for (pos, _), content in zip(cleaned, ids, strict=True):
            if content:
                out.append((pos, content))
            elif pos not in errors:
                errors[pos] = str(ExtractionInputError("empty", "text yields no tokens"))
        return out

    def _encode(self, texts: list[str]) -> list[list[int]]:
        enc = self.llm.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)
        return [list(ids) for ids in enc["input_ids"]]

    def _plan(self, contents: list[list[int]]) -> tuple[list[_Piece], list[int]]:
        """Pieces to run, and each row's output token count (the context left out)."""
        pieces: list[_Piece] = []
        lengths: list[int] = []
        skip = len(self._context)
        for row, content in enumerate(contents):
            offset = 0
            chunks = self._chunks(content)
            for chunk in chunks:
                ids = self._context + self._prefix + chunk + self._suffix
                pieces.append(_Piece(row, offset, ids, skip, len(chunks)))
                offset += len(ids) - skip
            lengths.append(offset)
        return pieces, lengths

    def _chunks(self, content: list[int]) -> list[list[int]]:
        budget = self._budget
        if len(content) <= budget:
            return [content]
        content = _truncate(content, budget * self.max_chunks, self.truncation)
        n = math.ceil(len(content) / budget)
        size, extra = divmod(len(content), n)  # near-equal: the first `extra` get one more
        bounds = [i * size + min(i, extra) for i in range(n + 1)]
        return [content[a:b] for a, b in itertools.pairwise(bounds)]

    def _micro_batches(self, pieces: list[_Piece]) -> list[list[_Piece]]:
        groups = length_batches(
            [len(p.ids) for p in pieces], self.batch_tokens, self.batch_size, self.batch_min_fill
        )
        return [[pieces[i] for i in group] for group in groups]

    # --- running the model ----------------------------------------------------------------

    def _run_isolating(
        self,
        batch: list[_Piece],
        wanted: tuple[int, ...],
        hidden: torch.Tensor,
        starts: list[int],
        staged: _Staged | None = None,
    ) -> dict[int, str]:
        """Run a micro-batch; if it fails, run its pieces alone. Returns failed rows.

        A device fault is no verdict on the texts: out of memory first retries smaller
        micro-batches, then (like any other device error) raises :class:`DeviceError`.
        """
        try:
            self._run(batch, wanted, hidden, starts, staged)
            return {}
        except Exception as exc:
            fault = device_fault(exc)
            if fault == "oom" and len(batch) > 1:
                log.warning("micro-batch of %d ran out of device memory; halving it", len(batch))
                _free_device_memory()
                half = len(batch) // 2
                return {
                    **self._run_isolating(batch[:half], wanted, hidden, starts, staged),
                    **self._run_isolating(batch[half:], wanted, hidden, starts, staged),
                }
            if fault is not None:
                raise DeviceError(
                    f"device fault in the forward pass: {exc!r}", sticky=fault == "device"
                ) from exc
            if len(batch) == 1:
                log.warning("extraction failed for one text: %s", exc, exc_info=True)
                return {batch[0].row: str(ExtractionInputError("failed", repr(exc)))}
            log.warning("micro-batch of %d failed (%r); retrying one by one", len(batch), exc)
        failed: dict[int, str] = {}
        for piece in batch:
            failed.update(self._run_isolating([piece], wanted, hidden, starts, staged))
        return failed

    def _run(
        self,
        batch: list[_Piece],
        wanted: tuple[int, ...],
        hidden: torch.Tensor,
        starts: list[int],
        staged: _Staged | None = None,
    ) -> None:
        b, t = len(batch), max(len(p.ids) for p in batch)
        if self.buckets is not None:
            t = next((w for w in self.buckets if w >= t), t)
        left, pad = self._left_pad, self._pad_id
        # One tensor from nested lists: no per-row tensor and copy.
        input_ids = torch.tensor(  # [b, t]
            [
                [pad] * (t - len(p.ids)) + p.ids if left else p.ids + [pad] * (t - len(p.ids))
                for p in batch
            ],
            dtype=torch.long,
        )
        lengths = [len(p.ids) for p in batch]
        attention = _span_mask([t - n if left else 0 for n in lengths], lengths, t).long()
        # (micro-batch row, first output position there, output row, position there, length):
        # the chat form's context runs (attention covers it) but is not output.
        spans: list[tuple[int, int, int, int, int]] = []
        for r, piece in enumerate(batch):
            n = len(piece.ids)
            lo = t - n if left else 0
            first = starts[piece.row] + piece.offset
            spans.append((r, lo + piece.skip, piece.row, first, n - piece.skip))
        slot = {layer: i for i, layer in enumerate(wanted)}
        whole = all(p.chunks == 1 for p in batch)  # no row shares its output with another pass

        def sink_to(spans: list[tuple[int, int, int, int, int]]) -> _Sink:
            block = None
            if whole and self.scatter:
                block = _Block.plan(spans, hidden.device, self.llm.device)

            def sink(layer: int, states: torch.Tensor) -> None:  # states: [b, t, D]
                out = hidden[slot[layer]]  # [B_ok, T, D]
                if block is not None:
                    block.write(out, states)
                    return
                for r, lo, row, first, n in spans:  # a chunked text's piece: its own place
                    out[row, first : first + n].copy_(states[r, lo : lo + n])

            return sink

        if staged is None:
            self._forward(self._model_inputs(input_ids, attention), wanted, sink_to(spans))
            return
        k = staged.stage.layer
        low = tuple(i for i in wanted if i <= k)
        captured: list[torch.Tensor] = []
        low_sink = sink_to(spans)

        def capture(layer: int, states: torch.Tensor) -> None:
            if layer == k:
                captured.append(states)
            if layer in slot:
                low_sink(layer, states)

        as_tuple = self._forward(
            self._model_inputs(input_ids, attention), (*low, k) if k not in low else low, capture
        )
        states = captured[0]  # [b, t, D]: hidden-state index k of every row
        # The stage pools what the full probe pools: the output positions, not the context.
        output = torch.zeros(b, t, dtype=torch.bool)  # [b, t]
        for r, lo, _, _, n in spans:
            output[r, lo : lo + n] = True
        go = self._continuing(staged, batch, states, output.to(states.device))
        if not go:
            return
        # The continuing rows, without the padding only the exited rows needed.
        width = int(attention[go].sum(-1).max())
        cols = slice(t - width, t) if self._left_pad else slice(0, width)
        rows = torch.tensor(go)
        shift = t - width if self._left_pad else 0
        kept = [
            (i, lo - shift, row, first, n)
            for i, (_, lo, row, first, n) in enumerate(spans[r] for r in go)
        ]
        resume = _Resume(k, states[rows.to(states.device)][:, cols], as_tuple)
        high = tuple(i for i in wanted if i > k)
        inputs = self._model_inputs(input_ids[rows][:, cols], attention[rows][:, cols])
        self._forward(inputs, high, sink_to(kept), resume)

    def _continuing(
        self, staged: _Staged, batch: list[_Piece], states: torch.Tensor, mask: torch.Tensor
    ) -> list[int]:
        """Micro-batch rows that run on past the exit layer; records the rows that exit."""
        try:
            positions = [staged.positions[p.row] for p in batch]
            exits, payload = staged.stage.decide(states, mask, positions)  # [b] bool, [b, ...]
            leave = exits.tolist()
        except Exception:
            log.warning("exit stage failed; every row runs to full depth", exc_info=True)
            return list(range(len(batch)))
        go = []
        for r, piece in enumerate(batch):
            if leave[r] and piece.row not in staged.chunked:
                staged.exited[piece.row] = payload[r].detach().clone()
            else:
                go.append(r)
        return go

    def _model_inputs(self, input_ids: torch.Tensor, attention: torch.Tensor) -> dict[str, Any]:
        model_device = self.llm.device
        kwargs: dict[str, Any] = {"input_ids": input_ids.to(model_device)}
        kwargs["attention_mask"] = attention.to(model_device)
        if self._pass_positions:  # positions count real tokens only: left padding is harmless
            kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp_(min=0)
        if self._pass_no_cache:
            kwargs["use_cache"] = False
        return kwargs

    def _forward(
        self,
        kwargs: dict[str, Any],
        wanted: tuple[int, ...],
        sink: _Sink,
        resume: _Resume | None = None,
    ) -> bool:
        """One forward pass that hands each wanted layer to ``sink`` and stops at the deepest.

        Hooks on the blocks capture the states (no ``output_hidden_states``, which would
        keep every layer alive); the hook on the deepest wanted block raises
        :class:`_EarlyExit`. The top index is the model's own ``last_hidden_state``.
        With ``resume``, the blocks up to its layer are skipped (see :class:`_Resume`).
        Returns whether the blocks return tuples (what a later resume must mimic).
        """
        stack, top = self.llm.layer_stack, self.num_layers
        deepest = max(wanted)
        handles = []
        as_tuple = [False]

        def before_first(_module: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
            sink(0, args[0] if args else kw["hidden_states"])
            if deepest == 0:
                raise _EarlyExit

        def after(layer: int) -> Callable[..., None]:
            def hook(_module: Any, _args: Any, output: Any) -> None:
                as_tuple[0] = isinstance(output, tuple)
                sink(layer, output[0] if isinstance(output, tuple) else output)
                if layer == deepest:
                    raise _EarlyExit

            return hook

        skipped = list(stack)[: resume.layer] if resume is not None else []
        # A block may carry a forward of its own already (e.g. accelerate's device hooks).
        own = [block.__dict__.get("forward") for block in skipped]
        try:
            for i, block in enumerate(skipped):
                block.forward = _pass_through(resume, last=i == len(skipped) - 1)
            if 0 in wanted:
                handles.append(stack[0].register_forward_pre_hook(before_first, with_kwargs=True))
            handles += [stack[i - 1].register_forward_hook(after(i)) for i in wanted if 0 < i < top]
            autocast = self.llm.autocast
            try:
                with torch.autocast(
                    self.llm.device.type, dtype=autocast, enabled=autocast is not None
                ):
                    output = self.llm.model(**kwargs)
            except _EarlyExit:
                return as_tuple[0]
            if top in wanted:
                sink(top, output.last_hidden_state)
            return as_tuple[0]
        finally:
            for handle in handles:
                handle.remove()
            for block, forward in zip(skipped, own, strict=True):
                if forward is None:
                    del block.forward  # the class's forward again
                else:
                    block.forward = forward


_Sink = Callable[[int, torch.Tensor], None]


def _span_mask(starts: Sequence[int], lengths: Sequence[int], width: int) -> torch.Tensor:
    """``[len(starts), width]`` bool: row ``i`` True on ``starts[i] .. + lengths[i]``."""
    cols = torch.arange(width)  # [width]
    lo = torch.tensor(starts, dtype=torch.long)[:, None]  # [n, 1]
    hi = lo + torch.tensor(lengths, dtype=torch.long)[:, None]
    return (cols >= lo) & (cols < hi)


@dataclass(frozen=True)
class _Block:
    """A micro-batch's spans written to the output as one block per layer: one gather from
    the states and one scatter into the output rows, whatever the number of rows (a
    row-by-row copy is two kernel launches per row and layer on an accelerator).

    It applies when the spans line up in one of two ways, the micro-batch's and the
    output's: all start at one column in both (right padding), or all end at one column
    in both (left padding). The block is as wide as the longest span; the columns of a
    shorter span beyond its own tokens are written as zero, which is what the output holds
    there when each span is its row's whole output (the caller's condition).
    """

    rows: torch.Tensor  # [b] long: output rows, on the output's device
    src: slice  # the states' columns
    dst: slice  # the output's columns
    keep: torch.Tensor  # [b, w, 1] bool on the states' device: a span's own tokens

    @classmethod
    def plan(
        cls,
        spans: Sequence[tuple[int, int, int, int, int]],
        out_device: torch.device,
        states_device: torch.device,
    ) -> _Block | None:
        """The block of ``spans`` (micro-batch row, its first column, output row, the
        output's first column, length), or None when they do not line up."""
        if not spans or [s[0] for s in spans] != list(range(len(spans))):
            return None
        w = max(n for *_, n in spans)
        los = {lo for _, lo, _, _, _ in spans}
        firsts = {first for _, _, _, first, _ in spans}
        lengths = [n for *_, n in spans]
        if len(los) == 1 and len(firsts) == 1:  # starts aligned
            lo, first = los.pop(), firsts.pop()
            src, dst, starts = slice(lo, lo + w), slice(first, first + w), [0] * len(spans)
        else:
            ends = {lo + n for _, lo, _, _, n in spans}
            tails = {first + n for _, _, _, first, n in spans}
            if len(ends) != 1 or len(tails) != 1:
                return None
            end, tail = ends.pop(), tails.pop()
            src, dst = slice(end - w, end), slice(tail - w, tail)
            starts = [w - n for n in lengths]
        rows = [row for _, _, row, _, _ in spans]
        keep = _span_mask(starts, lengths, w)[:, :, None].to(states_device)
        return cls(torch.tensor(rows, dtype=torch.long, device=out_device), src, dst, keep)

    def write(self, out: torch.Tensor, states: torch.Tensor) -> None:
        """``out`` ``[B_ok, T, D]`` takes the spans of ``states`` ``[b, t, D]``."""
        block = states[:, self.src]  # [b, w, D]
        block = torch.where(
            self.keep, block, torch.zeros((), dtype=block.dtype, device=block.device)
        )
        out[self.rows, self.dst] = block.to(out.device, out.dtype)


def _pass_through(resume: _Resume | None, *, last: bool) -> Callable[..., Any]:
    """A block's forward that computes nothing: its input, or (the last skipped block) the
    resumed states, in the form the blocks return."""
    if resume is None:
        raise AssertionError("only a resumed forward skips blocks")

    def forward(*args: Any, **kwargs: Any) -> Any:
        states = resume.states if last else (args[0] if args else kwargs["hidden_states"])
        return (states,) if resume.as_tuple else states

    return forward


def length_batches(
    lengths: Sequence[int],
    budget: int | None,
    max_items: int | None = None,
    min_fill: float = 0.0,
) -> list[list[int]]:
    """Indices of ``lengths`` longest first (equal lengths keep their order), cut into
    batches: one closes at ``max_items``, when one more would pad it past ``budget``
    tokens (its width is its first, longest item), or before an item shorter than
    ``min_fill`` × that width.

    >>> length_batches([6, 100, 40, 90, 10], budget=None, min_fill=0.5)
    [[1, 3], [2], [4, 0]]
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        current = batches[-1] if batches else None
        if (
            current is None
            or (max_items is not None and len(current) >= max_items)
            or (budget is not None and lengths[current[0]] * (len(current) + 1) > budget)
            or lengths[i] < min_fill * lengths[current[0]]
        ):
            batches.append([i])
        else:
            current.append(i)
    return batches


def clean_text(item: object, *, max_chars: int | None = None, keep: Truncation = "head") -> str:
    """The text to tokenize, or :class:`ExtractionInputError` saying why there is none.

    ``bytes`` must be UTF-8; ``str`` must not hold lone surrogates; control characters
    other than tab, LF and CR are removed; texts over ``max_chars`` keep their head (or
    head and tail); what is left must not be empty or whitespace only.
    """
    if isinstance(item, bytes | bytearray | memoryview):
        try:
            text = bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ExtractionInputError(
                "invalid_utf8", f"byte {exc.start} is not UTF-8 ({exc.reason})"
            ) from exc
    elif isinstance(item, str):
        text = item
    else:
        raise ExtractionInputError("not_text", f"expected str or bytes, got {type(item).__name__}")
    if max_chars is not None and len(text) > max_chars:
        text = _truncate(text, max_chars, keep)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ExtractionInputError(
            "invalid_unicode", f"lone surrogate at character {exc.start}"
        ) from exc
    text = _CONTROL_CHARS.sub("", text)
    if not text.strip():
        raise ExtractionInputError("empty", "text is empty or only whitespace/control characters")
    return text


def _truncate(seq: _Seq, limit: int, keep: Truncation) -> _Seq:
    """At most ``limit`` items: the head, or the head (rounded up) and the tail."""
    if len(seq) <= limit:
        return seq
    if keep == "head":
        return seq[:limit]
    head = (limit + 1) // 2
    return seq[:head] + seq[len(seq) - (limit - head) :]


def _special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids the tokenizer puts before and after a text (e.g. BOS; CLS ... SEP)."""
    probe = "hello world"
    bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    raise ConfigError(f"cannot tell where {type(tokenizer).__name__} adds special tokens")


_DEVICE_ERROR = re.compile(
    r"CUDA error|CUDA out of memory|CUBLAS_STATUS|CUDNN_STATUS|device-side assert|"
    r"HIP error|MPS backend out of memory|out of memory",
    re.IGNORECASE,
)


def device_fault(exc: BaseException) -> Literal["oom", "device"] | None:
    """``"oom"`` for out of device memory, ``"device"`` for another accelerator failure
    (e.g. a sticky CUDA error), None when the exception is not about the device."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(exc, accelerator):
        return "device"
    if isinstance(exc, RuntimeError) and _DEVICE_ERROR.search(str(exc)):
        return "oom" if "out of memory" in str(exc).lower() else "device"
    return None


def _free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
