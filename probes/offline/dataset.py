"""In-memory training data for probes: cached hidden states plus targets.

Two layouts, both kept in the cache's dtype (fp16 or bf16) and cast to fp32 per mini-batch:

- summaries ``[L, N, D]``: one vector per layer and row (mean/max/first/last),
  enough for the separable pools and tiny in memory;
- tokens ``[N_tok, L, D]`` + ``offsets [N + 1]``: the real tokens of every row,
  concatenated (no padding stored); :meth:`ProbeDataset.batch` pads a
  mini-batch to ``[L, B, T, D]`` with its mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from probes.errors import ProbeError
from schemas import Task

__all__ = ["ProbeDataset"]


@dataclass(frozen=True)
class ProbeDataset:
    """Hidden states and targets of ``N`` labeled rows (see the module docstring)."""

    layers: list[int]  # hidden-state indices, in the order of the L axis
    labels: list[str]  # class (multiclass) or column (multilabel) names of the targets
    task: Task
    targets: Tensor  # [N] int64 class index, or [N, C] float 0/1 (NaN: not annotated)
    ids: list[str]
    summaries: Tensor | None = None  # [L, N, D] fp16/bf16
    tokens: Tensor | None = None  # [N_tok, L, D] fp16/bf16
    offsets: Tensor | None = None  # [N + 1] int64 into tokens

    def __post_init__(self) -> None:
        if (self.summaries is None) == (self.tokens is None):
            raise ProbeError("a ProbeDataset holds either summaries or tokens")
        if self.tokens is not None and self.offsets is None:
            raise ProbeError("token-level data needs offsets")
        n = len(self.ids)
        if self.targets.shape[0] != n or len(self) != n:
            raise ProbeError(f"{n} ids but {self.targets.shape[0]} targets / {len(self)} rows")

    def _ragged(self) -> tuple[Tensor, Tensor]:
        """``(tokens, offsets)`` of token-level data."""
        if self.tokens is None or self.offsets is None:
            raise ProbeError("this dataset holds summaries, not token-level states")
        return self.tokens, self.offsets

    def _rows(self) -> Tensor:
        """The stored states with rows first: ``[N, L, D]`` or ``[N_tok, L, D]``."""
        if self.summaries is not None:
            return self.summaries.transpose(0, 1)
        return self._ragged()[0]

    def __len__(self) -> int:
        if self.summaries is not None:
            return int(self.summaries.shape[1])
        return int(self._ragged()[1].shape[0] - 1)

    @property
    def token_level(self) -> bool:
        return self.tokens is not None

    @property
    def hidden_size(self) -> int:
        return int(self._rows().shape[-1])

    @property
    def lengths(self) -> Tensor:
        """Real tokens per row ``[N]`` (ones for summaries)."""
        if self.summaries is not None:
            return torch.ones(len(self), dtype=torch.int64)
        return self._ragged()[1].diff()

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(hidden, mask, targets)`` for rows ``index``: ``[L, B, T, D]`` + ``[B, T]`` for
        tokens, ``[L, B, D]`` + ``None`` for summaries; hidden states as fp32."""
        targets = self.targets[index]
        if self.summaries is not None:
            return self.summaries[:, index].float(), None, targets
        tokens, offsets = self._ragged()
        starts, lengths = offsets[index], self.lengths[index]  # [B]
        T = int(lengths.max())
        mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
        # Positions of every real token, row after row: matches mask's row-major order.
        within = torch.arange(T)[None, :].expand_as(mask)[mask]  # [sum(len)]
        flat = starts.repeat_interleave(lengths) + within
        L, D = tokens.shape[1], tokens.shape[2]
        # Contiguous [L, B, T, D]: the probe's einsums and elementwise ops stream through it.
        padded = torch.zeros(L, len(index), T, D)  # [L, B, T, D]
        padded[:, mask] = tokens[flat].transpose(0, 1).float()  # [L, n, D] into the real slots
        return padded, mask, targets

    def input_stats(self, chunk: int = 8192) -> tuple[Tensor, Tensor]:
        """Per-(layer, dim) mean and standard deviation ``[L, D]`` over rows (summaries) or
        over real tokens; dimensions with no spread get scale 1."""
        data = self._rows()  # [N or N_tok, L, D]
        total = torch.zeros(data.shape[1:], dtype=torch.float64)
        square = torch.zeros_like(total)
        for start in range(0, data.shape[0], chunk):
            part = data[start : start + chunk].double()
            total += part.sum(dim=0)
            square += (part * part).sum(dim=0)
        n = max(1, data.shape[0])
        mean = total / n
        std = (square / n - mean * mean).clamp_min(0).sqrt()
        scale = torch.where(std > 1e-6, std, torch.ones_like(std))
        return mean.float(), scale.float()

    def class_counts(self) -> Tensor:
        """Rows per class (multiclass) or positives per label (multilabel), ``[C]``."""
        if self.task == "multiclass":
            return torch.bincount(self.targets, minlength=len(self.labels))
        return self.targets.nansum(dim=0).round().long()  # NaN: not annotated

    def known_counts(self) -> Tensor:
        """Rows that annotate each column, ``[C]`` (all rows, but for multi-head data)."""
        if self.task == "multiclass":
            return torch.full((len(self.labels),), len(self))
        return (~self.targets.isnan()).sum(dim=0)

    def subset(self, index: Tensor) -> ProbeDataset:
        """The rows ``index`` as a new dataset (copies the selected hidden states)."""
        ids = [self.ids[i] for i in index.tolist()]
        if self.summaries is not None:
            return replace(
                self, summaries=self.summaries[:, index], targets=self.targets[index], ids=ids
            )
        tokens, offsets = self._ragged()
        lengths = self.lengths[index]  # [B]
        new_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        # Every selected token's position: its row's old start plus its place in the row.
        within = torch.arange(int(new_offsets[-1])) - new_offsets[:-1].repeat_interleave(lengths)
        flat = offsets[index].repeat_interleave(lengths) + within
        return replace(
            self, tokens=tokens[flat], offsets=new_offsets, targets=self.targets[index], ids=ids
        )

    def select_layers(self, layers: list[int]) -> ProbeDataset:
        """The same rows with only ``layers`` (a subset of :attr:`layers`, any order kept as
        given) on the L axis; copies the selected states unless nothing changes."""
        if layers == self.layers:
            return self
        missing = sorted(set(layers) - set(self.layers))
        if missing or not layers:
            raise ProbeError(f"layers {layers} are not a non-empty subset of {self.layers}")
        pick = torch.tensor([self.layers.index(i) for i in layers])
        if self.summaries is not None:
            return replace(self, layers=list(layers), summaries=self.summaries[pick])
        return replace(self, layers=list(layers), tokens=self._ragged()[0][:, pick])

    @staticmethod
    def concat(parts: list[ProbeDataset]) -> ProbeDataset:
        """The rows of ``parts`` one after the other (same layers, labels, task and layout)."""
        if not parts:
            raise ProbeError("nothing to concatenate")
        first = parts[0]
        for p in parts[1:]:
            if (p.layers, p.labels, p.task, p.token_level) != (
                first.layers,
                first.labels,
                first.task,
                first.token_level,
            ):
                raise ProbeError(
                    f"cannot concatenate datasets of layers {p.layers} / labels {p.labels} / "
                    f"{p.task} with layers {first.layers} / labels {first.labels} / {first.task}"
                )
        ids = [i for p in parts for i in p.ids]
        targets = torch.cat([p.targets for p in parts])
        if first.summaries is not None:
            summaries = torch.cat([p.summaries for p in parts if p.summaries is not None], dim=1)
            return replace(first, summaries=summaries, targets=targets, ids=ids)
        ragged = [p._ragged() for p in parts]
        lengths = torch.cat([o.diff() for _, o in ragged])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        tokens = torch.cat([t for t, _ in ragged])
        return replace(first, tokens=tokens, offsets=offsets, targets=targets, ids=ids)

    def relabel(self, names: list[str]) -> ProbeDataset:
        """Targets re-expressed over ``names`` (a probe's label order).

        A class of the data missing from ``names`` is an error for multiclass
        targets; for multilabel targets the column is dropped only if it has
        no positive, else it is an error too.
        """
        if names == self.labels:
            return self
        where = {name: i for i, name in enumerate(names)}
        if self.task == "multiclass":
            present = set(torch.unique(self.targets).tolist())
            unknown = [self.labels[i] for i in sorted(present) if self.labels[i] not in where]
            if unknown:
                raise ProbeError(
                    f"data has classes {unknown} that the probe does not know: {names}"
                )
            lut = torch.tensor([where.get(name, -1) for name in self.labels])
            return replace(self, targets=lut[self.targets], labels=list(names))
        out = torch.zeros(len(self), len(names))
        for j, name in enumerate(self.labels):
            if name in where:
                out[:, where[name]] = self.targets[:, j]
            elif self.targets[:, j].any():
                raise ProbeError(f"data has label {name!r} that the probe does not know: {names}")
        return replace(self, targets=out, labels=list(names))
