"""The logit lens: read any layer's hidden state as the model's next-token guess.

The LLM's own output is ``lm_head(final_norm(h_top_block))``; the lens applies the same two
maps to an intermediate layer's state. Hidden-state index ``num_layers`` is the model's
``last_hidden_state``, already after the final norm (see :mod:`worker.llm.extract`), so there
only the head is applied: the lens of the top layer *is* the model's next-token
distribution. Models that scale or cap logits after the head (e.g. Gemma's soft cap) are
shown before that step, which changes probabilities but not the ranking.

Needs a decoder LLM loaded with its head (``load_llm(settings, lm_head=True)``) and a final
norm the lens can find by name; otherwise :class:`LensUnavailable` says what is missing.

Example::

    lens = LogitLens(load_llm(settings, lm_head=True))
    lens.top_k(states, layers=(10, 30), k=5)  # states [L_sel, D] at one position
    lens.ranks(states, layers=(10, 30), targets=ids)  # states [L_sel, T, D], ids [T]
    lens.compare(states, layers=(10, 30), a=318, b=389)  # " is" vs " are" at one position

Ranks count from 1 (the layer's top guess) and are strict: a token's rank is one more than
the number of tokens with a larger logit, so tied tokens share the better rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from worker.errors import LensUnavailable

if TYPE_CHECKING:
    from worker.llm.load import LoadedLLM

__all__ = ["LensRow", "LogitLens", "TokenPair", "find_final_norm"]

# Attribute paths of the final norm on the base model, by architecture family:
# Llama/Qwen/Mistral/Gemma "norm", GPT-2/Falcon/Bloom "ln_f", GPT-NeoX "final_layer_norm",
# Phi "final_layernorm", OPT "decoder.final_layer_norm", Mamba "norm_f".
_FINAL_NORMS = (
    "norm",
    "ln_f",
    "final_layer_norm",
    "final_layernorm",
    "final_norm",
    "norm_f",
    "decoder.final_layer_norm",
)


@dataclass(frozen=True)
class LensRow:
    """One layer's top-k next tokens, most probable first."""

    layer: int
    token_ids: list[int]
    tokens: list[str]  # decoded, e.g. " the"
    probs: list[float]  # softmax over the whole vocabulary


@dataclass(frozen=True)
class TokenPair:
    """Two candidate tokens ``a`` and ``b`` under one layer's lens, at one position."""

    layer: int
    logits: tuple[float, float]  # (a, b)
    probs: tuple[float, float]  # softmax over the whole vocabulary
    ranks: tuple[int, int]  # 1 = the layer's top guess

    @property
    def difference(self) -> float:
        """``logit(a) - logit(b)``: the log of the odds of ``a`` over ``b`` at this layer."""
        return self.logits[0] - self.logits[1]


def find_final_norm(model: nn.Module) -> nn.Module:
    """The base model's final norm (see ``_FINAL_NORMS``), or :class:`LensUnavailable`."""
    for path in _FINAL_NORMS:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, nn.Module) and not isinstance(module, nn.ModuleList):
            return module
    raise LensUnavailable(
        f"cannot find the final norm of {type(model).__name__} (looked for "
        f"{', '.join(_FINAL_NORMS)}); the logit lens supports decoder LLMs"
    )


class LogitLens:
    """Final norm + LM head of ``llm``, applicable to the state of any hidden-state index."""

    def __init__(self, llm: LoadedLLM) -> None:
        if llm.lm_head is None:
            raise LensUnavailable(f"no LM head: {llm.lm_head_missing}")
        self.llm = llm
        self.head: nn.Module = llm.lm_head
        self.norm = find_final_norm(llm.model)

    @torch.no_grad()
    def logits(self, states: Tensor, layer: int) -> Tensor:
        """``[..., D]`` states of hidden-state index ``layer`` -> ``[..., V]`` float32 logits."""
        param = next(self.head.parameters())
        x = states.to(device=param.device, dtype=param.dtype)
        if layer < self.llm.num_layers:  # the top index is already normalized
            x = self.norm(x)
        return self.head(x).float()

    def top_k(self, states: Tensor, layers: tuple[int, ...], k: int) -> list[LensRow]:
        """Top-``k`` next tokens per layer from ``states`` ``[L_sel, D]`` (one position)."""
        if states.shape[0] != len(layers):
            raise ValueError(f"{states.shape[0]} states for {len(layers)} layers")
        tok = self.llm.tokenizer
        rows = []
        for state, layer in zip(states, layers, strict=True):
            probs = torch.softmax(self.logits(state, layer), dim=-1)  # [V]
            top = probs.topk(min(k, probs.shape[-1]))
            ids = [int(i) for i in top.indices.tolist()]
            rows.append(
                LensRow(
                    layer=layer,
                    token_ids=ids,
                    tokens=[str(tok.decode([i])) for i in ids],
                    probs=[float(p) for p in top.values.tolist()],
                )
            )
        return rows

    @torch.no_grad()
    def ranks(self, states: Tensor, layers: tuple[int, ...], targets: Tensor) -> Tensor:
        """Rank of ``targets[t]`` at every layer and position: ``states`` ``[L_sel, T, D]``,
        ``targets`` ``[T]`` token ids -> ``[L_sel, T]`` int64 ranks (1 = top guess)."""
        if states.shape[0] != len(layers) or states.shape[1] != targets.shape[0]:
            raise ValueError(
                f"states {tuple(states.shape)} for {len(layers)} layers, {targets.shape[0]} targets"
            )
        rows = []
        for state, layer in zip(states, layers, strict=True):
            logits = self.logits(state, layer)  # [T, V], one layer at a time: T·V floats
            own = logits.gather(-1, targets.to(logits.device, torch.long)[:, None])  # [T, 1]
            rows.append((logits > own).sum(-1) + 1)  # [T]
        return torch.stack(rows).cpu()  # [L_sel, T]

    @torch.no_grad()
    def compare(self, states: Tensor, layers: tuple[int, ...], a: int, b: int) -> list[TokenPair]:
        """Tokens ``a`` and ``b`` (ids) at every layer, from ``states`` ``[L_sel, D]``."""
        if states.shape[0] != len(layers):
            raise ValueError(f"{states.shape[0]} states for {len(layers)} layers")
        rows = []
        for state, layer in zip(states, layers, strict=True):
            logits = self.logits(state, layer)  # [V]
            probs = torch.softmax(logits, dim=-1)  # [V]
            la, lb = float(logits[a]), float(logits[b])
            rows.append(
                TokenPair(
                    layer=layer,
                    logits=(la, lb),
                    probs=(float(probs[a]), float(probs[b])),
                    ranks=(
                        int((logits > logits[a]).sum()) + 1,
                        int((logits > logits[b]).sum()) + 1,
                    ),
                )
            )
        return rows
