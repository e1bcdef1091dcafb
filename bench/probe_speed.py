"""Probe time per message: the scorer's probes on a batch of hidden states, without the LLM.

The question: does scoring a message with a pooling or gate probe cost under 1 ms on CPU,
and what did reading only each row's real tokens (``real_spans``) buy over masking a copy
of the whole ``[L, B, T, D]`` tensor? Both paths are timed in the
same run, on the same tensors, for the default probe's 6 layers and for all 31 layers of
SmolLM2 (d=576), batch 16 padded to 256 tokens, with real-token counts drawn uniformly
from ``--min-tokens``..256 (ToxicChat messages average ~100 SmolLM2 tokens).

Example::

    python bench/probe_speed.py --threads 2

Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--batch", type=int, default=16, help="messages per batch (default: 16)")
    p.add_argument("--max-tokens", type=int, default=256, help="padded length (default: 256)")
    p.add_argument("--min-tokens", type=int, default=16, help="shortest message (default: 16)")
    p.add_argument("--repeats", type=int, default=5, help="timed batches per case (default: 5)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from probes.probe import build_probe
    from schemas import ProbeSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, T, D = args.batch, args.max_tokens, 576
    lengths = torch.randint(args.min_tokens, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]

    def masked_reference(probe, hidden):
        """The pre-span formula: mask a copy of the whole tensor, then pool."""
        pool = probe.pool
        keep = mask[None, :, :, None]
        if probe.spec.token_pool == "mean":
            raw = hidden.masked_fill(~keep, 0.0).sum(2) / mask.sum(1)[None, :, None]
        elif probe.spec.token_pool == "max":
            raw = hidden.masked_fill(~keep, float("-inf")).amax(2)
        else:  # gate
            zeroed = hidden.masked_fill(~keep, 0.0)
            w = pool.scores(zeroed, mask, probe.shift, probe.scale)
            raw = torch.einsum("lbt,lbtd->lbd", w, zeroed)
        return (raw - probe.shift[:, None]) / probe.scale[:, None]

    def timed(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        return (time.perf_counter() - start) / args.repeats / B * 1000.0  # ms per message

    rows = []
    for n_layers in (6, 31):
        hidden = torch.randn(n_layers, B, T, D, generator=g)
        for pool in ("mean", "max", "gate"):
            spec = ProbeSpec(
                name="toxicity",
                token_pool=pool,
                layer_mix="scalar_mix",
                layers=list(range(n_layers)),
                hidden_size=D,
                task="multiclass",
                labels=["ok", "toxic"],
                flag_labels=["toxic"],
            )
            probe = build_probe(spec, seed=0).eval()
            with torch.no_grad():
                full = timed(lambda p=probe, h=hidden: p.predict_proba_many(h, mask))
                span = timed(lambda p=probe, h=hidden: p.pool(h, mask, p.shift, p.scale))
                ref = timed(lambda p=probe, h=hidden: masked_reference(p, h))
                same = torch.allclose(
                    probe.pool(hidden, mask, probe.shift, probe.scale),
                    masked_reference(probe, hidden),
                    atol=1e-4,
                )
            rows.append(
                {
                    "pool": pool,
                    "layers": n_layers,
                    "probe_ms_per_msg": round(full, 3),
                    "pool_span_ms_per_msg": round(span, 3),
                    "pool_masked_ms_per_msg": round(ref, 3),
                    "speedup": round(ref / span, 2),
                    "same_result": bool(same),
                }
            )
            r = rows[-1]
            print(
                f"{pool:5} {n_layers:3} layers  whole probe {full:7.3f} ms/msg   pooling: "
                f"spans {span:7.3f}  masked {ref:7.3f}  ×{r['speedup']:.1f}  same={same}",
                flush=True,
            )
    out = {
        "bench": "probe_speed",
        "threads": torch.get_num_threads(),
        "batch": B,
        "padded_tokens": T,
        "mean_real_tokens": round(float(lengths.float().mean()), 1),
        "rows": rows,
        "target_ms_per_msg": 1.0,
        "meets_default_6_layers": all(
            float(r["probe_ms_per_msg"]) < 1.0 for r in rows if r["layers"] == 6
        ),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
