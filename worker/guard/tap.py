"""Hidden states taken from a model's own forward passes while it generates.

:class:`StateTap` hooks the layers the probes read (:func:`worker.llm.hooks.layer_hooks`,
the extractor's own hooks and indices) and keeps:

- from the prefill, the prompt's states over one span of positions (the text the probe
  judges, see :mod:`worker.guard.guard`), for those layers only;
- from each decoding step, the states of the one token it fed in (the previous reply
  token), so the reply so far can be scored without running anything again.

Nothing else is kept: no other layer, no position outside the span. One generation at a
time (batch 1): the hooks are on modules that every caller of the model shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from worker.llm.hooks import layer_hooks
from worker.llm.model import LoadedLLM

__all__ = ["StateTap"]


class StateTap:
    """The states of ``layers`` for the prompt span ``[start, end)`` and each decoded token."""

    def __init__(
        self, llm: LoadedLLM, layers: Sequence[int], span: tuple[int, int], dtype: torch.dtype
    ) -> None:
        self.llm = llm
        self.layers = tuple(layers)
        self.span = span
        self.dtype = dtype
        self.prompt: dict[int, torch.Tensor] = {}  # layer -> [n, D]
        self.steps: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self._hooks: contextlib.ExitStack | None = None  # while attached

    @property
    def decoded(self) -> int:
        """Reply tokens whose states are kept (each decoding step feeds one in)."""
        return min((len(s) for s in self.steps.values()), default=0)

    def prompt_states(self) -> torch.Tensor:
        """``[L, 1, n, D]``: the prompt span's states, in ``layers`` order."""
        return torch.stack([self.prompt[layer] for layer in self.layers]).unsqueeze(1)

    def reply_states(self) -> torch.Tensor:
        """``[L, 1, m, D]``: the states of the ``m`` reply tokens decoded so far."""
        m = self.decoded
        return torch.stack([torch.cat(self.steps[layer][:m]) for layer in self.layers]).unsqueeze(1)

    def _sink(self, layer: int, states: torch.Tensor) -> None:  # states: [1, t, D]
        if layer not in self.prompt:
            start, end = self.span
            self.prompt[layer] = states[0, start:end].detach().to(self.dtype, copy=True)
        else:
            self.steps[layer].append(states[0, -1:].detach().to(self.dtype, copy=True))

    @contextlib.contextmanager
    def attached(self) -> Iterator[StateTap]:
        """The hooks, for the duration of the block (removed however it ends)."""
        self._attach()
        try:
            yield self
        finally:
            self._detach()

    @contextlib.contextmanager
    def detached(self) -> Iterator[StateTap]:
        """No hooks in the block, attached again after it: forward passes there are not
        the generation's (the engine's own pass after a hot swap to a probe that reads
        other layers) and must neither add states nor run the turn's hooks."""
        was = self._hooks is not None
        self._detach()
        try:
            yield self
        finally:
            if was:
                self._attach()

    def _attach(self) -> None:
        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(layer_hooks(self.llm, self.layers, self._sink))

    def _detach(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.close()
