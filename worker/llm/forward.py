"""The forward pass: hooks hand each wanted layer's states to a sink and the deepest stops
the model, an exit stage decides some rows at a shallow layer and the rest resume from its
states, and a device fault is told apart from a bad text.

Layer indices are :mod:`worker.llm.extract`'s (transformers' ``output_hidden_states``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from worker.errors import DeviceError, ExtractionInputError
from worker.llm.hooks import Sink, layer_hooks
from worker.llm.plan import Padding, Piece, span_mask

if TYPE_CHECKING:
    from worker.llm.load import LoadedLLM

__all__ = [
    "Block",
    "ExitStage",
    "Resume",
    "Sink",
    "Staged",
    "continuing",
    "device_fault",
    "forward_pass",
    "free_device_memory",
    "run_isolating",
    "run_micro_batch",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExitStage:
    """Decide some rows at a shallow layer; only the others continue the forward pass.

    After hidden-state index ``layer`` (``1 <= layer < num_layers``) is computed for a
    micro-batch, ``decide(states [b, t, D], mask [b, t] bool, positions)`` (``mask``: the
    tokens of the rows' output, i.e. without the chat form's context; ``positions``: the
    rows' input positions) returns ``(exit [b] bool, payload [b, ...])``: rows with
    ``exit`` set are decided there (their payload row is kept in
    :attr:`~worker.llm.extract.Extraction.exited`), the others run on from block
    ``layer + 1`` in a smaller batch. A text cut into several chunks always continues (its
    row spans several model inputs). If ``decide`` raises, every row continues (full depth
    is never wrong).
    """

    layer: int
    decide: Callable[[torch.Tensor, torch.Tensor, list[int]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Staged:
    """One :meth:`~worker.llm.extract.HiddenStateExtractor.extract` call's exit stage and
    what it decided."""

    stage: ExitStage
    positions: list[int]  # output row -> input position
    chunked: frozenset[int]  # output rows made of several pieces: they never exit
    exited: dict[int, torch.Tensor] = field(default_factory=dict)  # output row -> payload


@dataclass(frozen=True, slots=True)
class Resume:
    """Run a forward pass from hidden-state index ``layer`` on: blocks ``1..layer`` pass
    their input through and the last of them returns ``states`` (``[b, t, D]``, the rows'
    states at ``layer`` from an earlier pass), so every block above runs with the masks
    and position embeddings the model itself builds for this batch (per layer type, e.g.
    Gemma's sliding and global layers)."""

    layer: int
    states: torch.Tensor  # [b, t, D]
    as_tuple: bool  # the blocks return (states, ...) rather than a tensor


class _EarlyExit(Exception):
    """Raised by the hook on the deepest requested layer, so no layer above it runs."""


def forward_pass(
    llm: LoadedLLM,
    kwargs: dict[str, Any],
    wanted: tuple[int, ...],
    sink: Sink,
    resume: Resume | None = None,
) -> bool:
    """One forward pass that hands each wanted layer to ``sink`` and stops at the deepest.

    Hooks capture the states (:func:`~worker.llm.hooks.layer_hooks`; no
    ``output_hidden_states``, which would keep every layer alive); the deepest wanted
    layer's raises :class:`_EarlyExit`.
    With ``resume``, the blocks up to its layer are skipped (see :class:`Resume`).
    Returns whether the blocks return tuples (what a later resume must mimic).
    """
    deepest = max(wanted)

    def stop_at_deepest(layer: int, states: torch.Tensor) -> None:
        sink(layer, states)
        if layer == deepest:
            raise _EarlyExit

    skipped = list(llm.layer_stack)[: resume.layer] if resume is not None else []
    # A block may carry a forward of its own already (e.g. accelerate's device hooks).
    own = [block.__dict__.get("forward") for block in skipped]
    try:
        for i, block in enumerate(skipped):
            block.forward = _pass_through(resume, last=i == len(skipped) - 1)
        with layer_hooks(llm, wanted, stop_at_deepest) as hooks:
            autocast = llm.autocast
            try:
                with torch.autocast(llm.device.type, dtype=autocast, enabled=autocast is not None):
                    llm.model(**kwargs)
            except _EarlyExit:
                pass
            return hooks.as_tuple
    finally:
        for block, forward in zip(skipped, own, strict=True):
            if forward is None:
                del block.forward  # the class's forward again
            else:
                block.forward = forward


def run_isolating(
    run: Callable[[list[Piece], tuple[int, ...], torch.Tensor, list[int], Staged | None], None],
    batch: list[Piece],
    wanted: tuple[int, ...],
    hidden: torch.Tensor,
    starts: list[int],
    staged: Staged | None = None,
) -> dict[int, str]:
    """``run`` a micro-batch (:func:`run_micro_batch`'s arguments); if it fails, run its
    pieces alone. Returns the failed output rows, each with why.

    A device fault is no verdict on the texts: out of memory first retries smaller
    micro-batches, then (like any other device error) raises :class:`DeviceError`.
    """
    try:
        run(batch, wanted, hidden, starts, staged)
        return {}
    except Exception as exc:
        fault = device_fault(exc)
        if fault == "oom" and len(batch) > 1:
            log.warning("micro-batch of %d ran out of device memory; halving it", len(batch))
            free_device_memory()
            half = len(batch) // 2
            return {
                **run_isolating(run, batch[:half], wanted, hidden, starts, staged),
                **run_isolating(run, batch[half:], wanted, hidden, starts, staged),
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
        failed.update(run_isolating(run, [piece], wanted, hidden, starts, staged))
    return failed


def run_micro_batch(
    llm: LoadedLLM,
    batch: list[Piece],
    wanted: tuple[int, ...],
    hidden: torch.Tensor,
    starts: list[int],
    staged: Staged | None,
    padding: Padding,
    model_inputs: Callable[[torch.Tensor, torch.Tensor], dict[str, Any]],
    *,
    scatter: bool,
) -> None:
    """Run one micro-batch of an extraction's pieces and write their output states into
    ``hidden`` ``[L_sel, B_ok, T, D]`` (row ``piece.row`` from column ``starts[row]``):
    padded as ``padding`` says, made the model's arguments by ``model_inputs``; with
    ``staged``, the rows its exit stage decides stop at its layer and the others resume
    from there in a smaller batch. ``scatter``: one gather and scatter per layer
    (:class:`Block`) rather than a copy per row, when the spans line up."""
    t = padding.width(max(len(p.ids) for p in batch))
    left, pad = padding.left, padding.pad_id
    # One tensor from nested lists: no per-row tensor and copy.
    input_ids = torch.tensor(  # [b, t]
        [
            [pad] * (t - len(p.ids)) + p.ids if left else p.ids + [pad] * (t - len(p.ids))
            for p in batch
        ],
        dtype=torch.long,
    )
    lengths = [len(p.ids) for p in batch]
    attention = span_mask([t - n if left else 0 for n in lengths], lengths, t).long()
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

    def sink_to(spans: list[tuple[int, int, int, int, int]]) -> Sink:
        block = None
        if whole and scatter:
            block = Block.plan(spans, hidden.device, llm.device)

        def sink(layer: int, states: torch.Tensor) -> None:  # states: [b, t, D]
            out = hidden[slot[layer]]  # [B_ok, T, D]
            if block is not None:
                block.write(out, states)
                return
            for r, lo, row, first, n in spans:  # a chunked text's piece: its own place
                out[row, first : first + n].copy_(states[r, lo : lo + n])

        return sink

    if staged is None:
        forward_pass(llm, model_inputs(input_ids, attention), wanted, sink_to(spans))
    else:
        _staged_pass(
            llm, staged, batch, wanted, (input_ids, attention), spans, sink_to, model_inputs, left
        )


def _staged_pass(
    llm: LoadedLLM,
    staged: Staged,
    batch: list[Piece],
    wanted: tuple[int, ...],
    inputs: tuple[torch.Tensor, torch.Tensor],
    spans: list[tuple[int, int, int, int, int]],
    sink_to: Callable[[list[tuple[int, int, int, int, int]]], Sink],
    model_inputs: Callable[[torch.Tensor, torch.Tensor], dict[str, Any]],
    left: bool,
) -> None:
    """:func:`run_micro_batch` with an exit stage: every row runs up to the stage's layer;
    the rows it decides stop there, the others resume from its states in a smaller batch
    (without the padding only the exited rows needed). ``inputs``: the micro-batch's
    ``input_ids`` and ``attention`` ``[b, t]``; ``spans`` and ``sink_to`` as there."""
    input_ids, attention = inputs
    b, t = input_ids.shape
    k = staged.stage.layer
    low = tuple(i for i in wanted if i <= k)
    captured: list[torch.Tensor] = []
    low_sink = sink_to(spans)

    def capture(layer: int, states: torch.Tensor) -> None:
        if layer == k:
            captured.append(states)
        if layer in wanted:
            low_sink(layer, states)

    as_tuple = forward_pass(
        llm,
        model_inputs(input_ids, attention),
        (*low, k) if k not in low else low,
        capture,
    )
    states = captured[0]  # [b, t, D]: hidden-state index k of every row
    # The stage pools what the full probe pools: the output positions, not the context.
    output = torch.zeros(b, t, dtype=torch.bool)  # [b, t]
    for r, lo, _, _, n in spans:
        output[r, lo : lo + n] = True
    go = continuing(staged, batch, states, output.to(states.device))
    if not go:
        return
    # The continuing rows, without the padding only the exited rows needed.
    width = int(attention[go].sum(-1).max())
    cols = slice(t - width, t) if left else slice(0, width)
    rows = torch.tensor(go)
    shift = t - width if left else 0
    kept = [
        (i, lo - shift, row, first, n)
        for i, (_, lo, row, first, n) in enumerate(spans[r] for r in go)
    ]
    resume = Resume(k, states[rows.to(states.device)][:, cols], as_tuple)
    high = tuple(i for i in wanted if i > k)
    rest = model_inputs(input_ids[rows][:, cols], attention[rows][:, cols])
    forward_pass(llm, rest, high, sink_to(kept), resume)


def _pass_through(resume: Resume | None, *, last: bool) -> Callable[..., Any]:
    """A block's forward that computes nothing: its input, or (the last skipped block) the
    resumed states, in the form the blocks return."""
    if resume is None:
        raise AssertionError("only a resumed forward skips blocks")

    def forward(*args: Any, **kwargs: Any) -> Any:
        states = resume.states if last else (args[0] if args else kwargs["hidden_states"])
        return (states,) if resume.as_tuple else states

    return forward


def continuing(
    staged: Staged, batch: list[Piece], states: torch.Tensor, mask: torch.Tensor
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


@dataclass(frozen=True)
class Block:
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
    ) -> Block | None:
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
        keep = span_mask(starts, lengths, w)[:, :, None].to(states_device)
        return cls(torch.tensor(rows, dtype=torch.long, device=out_device), src, dst, keep)

    def write(self, out: torch.Tensor, states: torch.Tensor) -> None:
        """``out`` ``[B_ok, T, D]`` takes the spans of ``states`` ``[b, t, D]``."""
        block = states[:, self.src]  # [b, w, D]
        block = torch.where(
            self.keep, block, torch.zeros((), dtype=block.dtype, device=block.device)
        )
        out[self.rows, self.dst] = block.to(out.device, out.dtype)


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


def free_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
