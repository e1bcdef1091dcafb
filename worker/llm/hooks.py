"""Hooks that hand a model's hidden states to a sink as its forward pass computes them,
for the extractor's own passes (:mod:`worker.llm.forward`) and for the inline guard's tap
on the serving model's generation (:mod:`worker.guard.tap`).

Hidden-state index ``i`` is :mod:`worker.llm.extract`'s (transformers'
``output_hidden_states``): ``0`` the input of the first block (a pre-hook), ``i`` the
output of block ``i`` for ``0 < i < num_layers``, and ``num_layers`` the base model's own
``last_hidden_state`` (after the final norm, where the model has one). Only the wanted
indices are hooked: no other layer is kept alive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from worker.llm.model import LoadedLLM

__all__ = ["LayerHooks", "Sink", "layer_hooks"]

Sink = Callable[[int, torch.Tensor], None]  # (hidden-state index, states [b, t, D])


class LayerHooks:
    """The hooks of one :func:`layer_hooks` block. ``as_tuple``: whether the hooked blocks
    return ``(states, ...)`` rather than a tensor (what a resumed pass must mimic)."""

    def __init__(self) -> None:
        self.as_tuple = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []


@contextlib.contextmanager
def layer_hooks(llm: LoadedLLM, layers: Iterable[int], sink: Sink) -> Iterator[LayerHooks]:
    """``sink(i, states)`` for each wanted index ``i`` of every forward pass of ``llm``'s
    base model in the block; the hooks are removed however it ends. An exception the sink
    raises ends the pass there (the extractor stops at its deepest layer so)."""
    stack, top = llm.layer_stack, llm.num_layers
    hooks = LayerHooks()

    def before_first(_module: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        sink(0, args[0] if args else kw["hidden_states"])

    def after(layer: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if layer == top:  # the base model's output
                last = getattr(output, "last_hidden_state", None)
                sink(layer, output[0] if last is None else last)
                return
            hooks.as_tuple = isinstance(output, tuple)
            sink(layer, output[0] if hooks.as_tuple else output)

        return hook

    try:
        for i in sorted(set(layers)):
            if i == 0:
                handle = stack[0].register_forward_pre_hook(before_first, with_kwargs=True)
            elif 0 < i < top:
                handle = stack[i - 1].register_forward_hook(after(i))
            elif i == top:
                handle = llm.model.register_forward_hook(after(i))
            else:
                raise ValueError(f"hidden-state index {i} is not in [0, {top}]")
            hooks.handles.append(handle)
        yield hooks
    finally:
        for handle in hooks.handles:
            handle.remove()
