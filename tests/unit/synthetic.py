"""Small builders shared by the probe tests (synthetic tensors, no LLM)."""

from __future__ import annotations

import torch
from torch import Tensor

from probes import Probe, build_probe
from schemas import HeadSpec, LLMFingerprint, ProbeSpec

D = 16  # hidden size of the synthetic "LLM"
NUM_LAYERS = 4  # hidden-state indices 0..4

FINGERPRINT = LLMFingerprint(
    model_id="synthetic/tiny",
    source_sha256="a" * 64,
    num_layers=NUM_LAYERS,
    hidden_size=D,
    tokenizer_sha256="b" * 64,
)


def make_spec(pool: str, mix: str, task: str = "multiclass", **extra: object) -> ProbeSpec:
    """A spec of the kind; ``task="multihead"``: a binary head ``toxicity`` (``toxic``)
    and a multiclass head ``topic`` (``ok`` / ``spam``) over one pooling and mix."""
    layers = [2] if mix == "single" else [1, 2, 4]
    labels = ["ok", "toxic", "spam"]
    if task == "multihead":
        extra = {
            "heads": [
                HeadSpec(name="toxicity", task="multilabel", labels=["toxic"]),
                HeadSpec(name="topic", task="multiclass", labels=["ok", "spam"]),
            ],
            **extra,
        }
        task, labels = "multilabel", ["toxic", "ok", "spam"]
    return ProbeSpec(
        name="contract",
        token_pool=pool,  # type: ignore[arg-type]
        layer_mix=mix,  # type: ignore[arg-type]
        layers=layers,
        hidden_size=D,
        task=task,  # type: ignore[arg-type]
        labels=labels,
        flag_labels=["toxic"],
        d_inner=8,
        num_heads=2,
        **extra,  # type: ignore[arg-type]
    )


def random_batch(
    layers: int, batch: int = 6, tokens: int = 7, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Hidden states ``[L, B, T, D]`` and a right-padded mask with varied lengths."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(layers, batch, tokens, D, generator=g)
    lengths = torch.randint(1, tokens + 1, (batch,), generator=g)
    lengths[0] = tokens
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    return hidden, mask


def toy_task(
    layers: int, task: str, n: int = 48, tokens: int = 6, seed: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    """A learnable task: each class shifts every real token along its own direction."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(layers, n, tokens, D, generator=g)
    lengths = torch.randint(2, tokens + 1, (n,), generator=g)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    # The same class directions for every seed, so two seeds are two splits of one task.
    directions = 1.5 * torch.randn(3, D, generator=torch.Generator().manual_seed(99))
    if task == "multiclass":
        y = torch.randint(0, 3, (n,), generator=g)
        hidden += directions[y][None, :, None, :]
        return hidden, mask, y
    if task == "multihead":  # columns toxic | ok, spam; each head unknown on a third of rows
        toxic = (torch.rand(n, generator=g) < 0.4).float()
        spam = torch.randint(0, 2, (n,), generator=g)
        y = torch.stack([toxic, 1.0 - spam, spam.float()], dim=1)
        hidden += (toxic[:, None] * directions[0] + spam[:, None] * directions[2])[None, :, None, :]
        row = torch.arange(n) % 3
        y[row == 1, 0] = float("nan")
        y[row == 2, 1:] = float("nan")
        return hidden, mask, y
    y = (torch.rand(n, 3, generator=g) < 0.4).float()
    hidden += (y @ directions)[None, :, None, :]
    return hidden, mask, y


def task_of(spec: ProbeSpec) -> str:
    """The :func:`toy_task` for ``spec``."""
    return "multihead" if spec.heads else spec.task


def trained(pool: str, mix: str, task: str = "multihead") -> Probe:
    """A probe of the kind whose weights and normalization are not their initial values."""
    probe = build_probe(make_spec(pool, mix, task), seed=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in probe.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
        L, D = probe.shift.shape
        probe.set_input_stats(torch.randn(L, D, generator=g), torch.rand(L, D, generator=g) + 0.5)
    return probe
