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

from worker.llm.hooks import Sink, layer_hooks
from worker.llm.plan import Piece, span_mask

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
