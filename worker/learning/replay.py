"""Online-learning state of the updater: a class-balanced replay buffer and
windowed prequential ("test, then train") metrics.

Replay examples are what the probe needs and no more: for separable pools
(mean, max, first, last) the raw per-layer summaries ``[L, D]``; for the gate
and MHA pools the real tokens ``[L, T, D]``. Both are stored in ``state_dtype`` (fp16 by
default, bf16 for LLMs whose activations exceed fp16's range).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from probes.kinds.pooling import SUMMARIES
from probes.metrics import evaluate
from probes.probe import Probe
from schemas import ProbeSpec

__all__ = [
    "Example",
    "Prequential",
    "ReplayBuffer",
    "collate",
    "collate_chunks",
    "input_stats",
    "replay_examples",
    "unusable_rows",
]


@dataclass(frozen=True)
class Example:
    x: Tensor  # [L, D] summaries or [L, T, D] tokens, fp16 or bf16
    target: Tensor  # [] int64 class index, or [C] float 0/1
    bucket: int  # class used for balancing (multilabel: first positive label, else C)
    # [C] bool: cells of ``target`` holding a held head's own opinion, not a label
    # (worker.learning.anchor); None: every known cell is a label.
    anchored: Tensor | None = None


def replay_examples(
    probe: Probe,
    hidden: Tensor,
    mask: Tensor,
    targets: Tensor,
    buckets: list[int],
    dtype: torch.dtype,
) -> list[Example]:
    """What replay keeps of a batch ``hidden [L, B, T, D]``, ``mask [B, T]``: raw summaries
    ``[L, D]`` for separable pools, else the real tokens ``[L, T, D]``; in ``dtype``."""
    if probe.separable:
        with torch.no_grad():
            raw = SUMMARIES[probe.spec.token_pool](hidden, mask)  # [L, B, D]
            pooled = raw.to(dtype)
        return [
            Example(pooled[:, b].clone(), targets[b], bucket) for b, bucket in enumerate(buckets)
        ]
    out = []
    for b, bucket in enumerate(buckets):
        real = mask[b].nonzero().flatten()
        out.append(Example(hidden[:, b, real].to(dtype).clone(), targets[b], bucket))
    return out


def unusable_rows(probe: Probe, hidden: Tensor, mask: Tensor, dtype: torch.dtype) -> list[int]:
    """Rows of ``hidden [L, B, T, D]`` that cannot be learned from: NaN or inf in the
    example as replay keeps it (in ``dtype``: in fp16 values beyond 65504 count).
    Not learned from: one such row would make every later loss non-finite."""
    with torch.no_grad():
        if probe.separable:
            kept = SUMMARIES[probe.spec.token_pool](hidden, mask).to(dtype)  # [L, B, D]
            ok = torch.isfinite(kept).all(dim=2).all(dim=0)  # [B]
        else:
            finite = torch.isfinite(hidden.to(dtype)) | ~mask[None, :, :, None]  # [L,B,T,D]
            ok = finite.flatten(2).all(dim=2).all(dim=0)  # [B]
    return [int(b) for b in (~ok).nonzero().flatten().tolist()]


def input_stats(examples: list[Example]) -> tuple[Tensor, Tensor]:
    """``(mean, std)`` over the examples' rows (summaries) or tokens, for a fresh probe's
    input normalization; a constant feature gets std 1."""
    if examples[0].x.dim() == 2:
        data = torch.stack([e.x.float() for e in examples])  # [N, L, D]
    else:
        data = torch.cat([e.x.float().transpose(0, 1) for e in examples])  # [N_tok, L, D]
    mean, std = data.mean(dim=0), data.std(dim=0)
    return mean, torch.where(std > 1e-6, std, torch.ones_like(std))


def collate(examples: list[Example]) -> tuple[Tensor, Tensor | None, Tensor]:
    """Stack examples into ``(hidden, mask, targets)`` ready for ``learn_many``.

    Summaries give ``[L, B, D]`` and no mask; tokens are right-padded to
    ``[L, B, T, D]`` with a ``[B, T]`` mask.
    """
    targets = torch.stack([e.target for e in examples])
    if examples[0].x.dim() == 2:
        return torch.stack([e.x for e in examples], dim=1).float(), None, targets  # [L, B, D]
    L, _, D = examples[0].x.shape
    T = max(e.x.shape[1] for e in examples)
    hidden = torch.zeros(L, len(examples), T, D)  # [L, B, T, D]
    mask = torch.zeros(len(examples), T, dtype=torch.bool)  # [B, T]
    for b, e in enumerate(examples):
        t = e.x.shape[1]
        hidden[:, b, :t] = e.x.float()
        mask[b, :t] = True
    return hidden, mask, targets


def collate_chunks(
    examples: list[Example], chunk: int = 16
) -> list[tuple[Tensor, Tensor | None, Tensor]]:
    """:func:`collate` in pieces for ``Learner.learn_chunks``: token-level examples sorted
    by length and cut into groups of ``chunk``, each padded only to its own longest row
    (a random batch of chat messages is otherwise padded to its longest, mostly zeros);
    summaries stay one piece."""
    if not examples or examples[0].x.dim() == 2:
        return [collate(examples)] if examples else []
    ordered = sorted(examples, key=lambda e: e.x.shape[1])
    return [collate(ordered[i : i + chunk]) for i in range(0, len(ordered), chunk)]


class ReplayBuffer:
    """Bounded, class-balanced memory of past examples.

    Each class keeps at most ``capacity // buckets`` examples (oldest dropped), and
    samples draw classes round-robin, so a stream that is 90 % one class still
    replays the minority class as often as the majority.
    """

    def __init__(self, capacity: int, buckets: int, seed: int = 0) -> None:
        self.per_bucket = max(1, capacity // max(1, buckets)) if capacity else 0
        self.buckets: list[deque[Example]] = [
            deque(maxlen=self.per_bucket or 1) for _ in range(buckets)
        ]
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets) if self.per_bucket else 0

    def add(self, examples: list[Example]) -> None:
        if not self.per_bucket:
            return
        for e in examples:
            self.buckets[e.bucket].append(e)

    def release(self, columns: list[int]) -> None:
        """Forget the held opinions in ``columns`` (heads a label has since reached, which
        learn from labels alone): those cells become unknown again in every example."""
        if not columns:
            return
        cols = torch.tensor(columns, dtype=torch.long)
        for bucket in self.buckets:
            kept = []
            for e in bucket:
                if e.anchored is not None and e.anchored[cols].any():
                    target, anchored = e.target.clone(), e.anchored.clone()
                    target[cols] = torch.where(anchored[cols], torch.nan, target[cols])
                    anchored[cols] = False
                    e = replace(e, target=target, anchored=anchored)
                kept.append(e)
            bucket.clear()
            bucket.extend(kept)

    def keep_first_layers(self, keep: int) -> None:
        """Cut every stored example to its first ``keep`` layers (after the probe dropped
        its deepest ones)."""
        for bucket in self.buckets:
            cut = [replace(e, x=e.x[:keep].clone()) for e in bucket]
            bucket.clear()
            bucket.extend(cut)

    def weighted_chunks(
        self, seen: Counter[int] | None
    ) -> list[tuple[Tensor, Tensor | None, Tensor]]:
        """The stored examples as ``(hidden, mask, weights)`` chunks, each example weighted
        back to its class's share of ``seen`` (examples learned per bucket; None or empty:
        weight 1): the buffer holds every class equally, the stream does not."""
        batches: list[tuple[Tensor, Tensor | None, Tensor]] = []
        for bucket in self.buckets if self.per_bucket else []:
            if not bucket:
                continue
            examples = list(bucket)
            count = seen.get(examples[0].bucket, 0) if seen else None
            weight = 1.0 if count is None else count / len(examples)
            for hidden, mask, _ in collate_chunks(examples, chunk=64):
                batches.append((hidden, mask, torch.full((hidden.shape[1],), weight)))
        return batches

    def sample(self, n: int) -> list[Example]:
        """Up to ``n`` examples, classes in turn (random example within a class)."""
        filled = [b for b in self.buckets if b] if self.per_bucket else []
        out: list[Example] = []
        while filled and len(out) < n:
            for bucket in filled:
                if len(out) == n:
                    break
                out.append(bucket[self.rng.randrange(len(bucket))])
        return out


class Prequential:
    """The last ``window`` (probabilities, target) pairs, scored before learning from them,
    with the uncalibrated logits the probabilities came from (the updater refits a
    calibration on them: :func:`worker.learning.recalibrate.recalibrate`)."""

    def __init__(self, spec: ProbeSpec, window: int) -> None:
        self.spec = spec
        self.probs: deque[Tensor] = deque(maxlen=window)
        self.logits: deque[Tensor] = deque(maxlen=window)
        self.targets: deque[Tensor] = deque(maxlen=window)
        self.seen = 0

    def add(self, probs: Tensor, targets: Tensor, logits: Tensor) -> None:
        """``probs [B, C]`` as served, the ``logits [B, C]`` they came from, ``targets``."""
        for p, z, t in zip(probs, logits, targets, strict=True):
            self.probs.append(p.detach().float().cpu())
            self.logits.append(z.detach().float().cpu())
            self.targets.append(t.cpu())
        self.seen += len(probs)

    def window(self) -> tuple[Tensor, Tensor] | None:
        """``(probs [N, C], targets)`` of the window, or None while it is empty."""
        if not self.probs:
            return None
        return torch.stack(list(self.probs)), torch.stack(list(self.targets))

    def logit_window(self) -> tuple[Tensor, Tensor] | None:
        """``(logits [N, C], targets)`` of the window, or None while it is empty."""
        if not self.logits:
            return None
        return torch.stack(list(self.logits)), torch.stack(list(self.targets))

    def report(self) -> dict[str, float]:
        """Flat metrics for a manifest / Prometheus: f1, auprc, recall at 1 % FPR, ECE,
        accuracy, per-class f1."""
        window = self.window()
        if window is None or len(self.probs) < 2:
            return {}
        rep = evaluate(self.spec, *window)
        out = {
            "prequential_f1": rep["f1"],
            "prequential_auprc": rep["auprc"],
            "prequential_recall_at_1pct_fpr": rep["recall_at_1pct_fpr"],
            "prequential_ece": rep["ece"],
            "prequential_accuracy": rep["accuracy"],
            "prequential_n": float(rep["n"]),
        }
        for label, m in rep["per_class"].items():
            out[f"prequential_f1/{label}"] = m["f1"]
        return {k: float(v) for k, v in out.items() if v == v}  # drop NaN (no support yet)
