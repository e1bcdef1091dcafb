"""How much of the forward pass does a cascade's exit save, by threshold: the share of the
messages it decides, or the share of their tokens?

A forward pass costs about its tokens, and the messages an exit head is sure of are mostly
the short ones, so the share of messages decided early overstates the saving. For a
checkpoint with an exit head (``fit --exit``) and a JSONL of texts: the exit layer's
states of every text (one pass to that layer), the exit head's calibrated flag risk, and
per ``allow_below`` threshold the share of messages and of tokens below it, with the ideal
speedup each implies (``1 / probes.offline.exit.exit_cost``, the exit search's cost
model). The last line printed is one JSON object.

    PYTHONPATH=. python bench/exit_tokens.py --probe runs/fit/cascade \\
        --data ../shared/data/toxicchat/validation.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from _shared import log

THRESHOLDS = (0.005, 0.02, 0.05, 0.1, 0.2, 0.3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--probe", type=Path, required=True, help="checkpoint with an exit head")
    p.add_argument("--data", type=Path, required=True, help="JSONL with a 'text' field")
    p.add_argument("--model", help="the LLM (default: the settings' PROBEGUARD_MODEL)")
    p.add_argument("--batch", type=int, default=32, help="texts per pass (%(default)s)")
    p.add_argument(
        "--thresholds",
        default=",".join(map(str, THRESHOLDS)),
        help="allow_below values (default: %(default)s); the checkpoint's own is added",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from probes import load_checkpoint
    from probes.exit import exit_probabilities, flag_risk
    from probes.offline.exit import exit_cost
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import Settings

    overrides = {"model": args.model} if args.model else {}
    ex = HiddenStateExtractor.from_settings(Settings(metrics_port=0, **overrides))
    probe, _ = load_checkpoint(args.probe, ex.fingerprint)
    if probe.spec.exit is None:
        raise SystemExit(f"{args.probe} has no exit head (fit --exit)")
    k, deepest = probe.spec.exit.layer, probe.spec.deepest_layer
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    texts = [str(r["text"]) for r in rows]
    log(f"{len(texts)} texts to layer {k} …")
    risks: list[float] = []
    for i in range(0, len(texts), args.batch):
        chunk = texts[i : i + args.batch]
        out = ex.extract(chunk, [k])
        probs = exit_probabilities(probe, out.layer(k).float(), out.mask)
        row_risk = dict(zip(out.index, flag_risk(probe.spec, probs).tolist(), strict=True))
        risks += [row_risk.get(j, float("inf")) for j in range(len(chunk))]  # failed: never
    risk = torch.tensor(risks, dtype=torch.float64)
    tokens = torch.tensor(ex.token_counts(texts), dtype=torch.float64)
    given = {float(t) for t in args.thresholds.split(",") if t.strip()}
    thresholds = sorted({*given, probe.spec.exit.allow_below})
    table = []
    print(f"exit layer {k} of {deepest}; {len(texts)} texts, {int(tokens.sum())} tokens")
    print(f"{'allow_below':>11}{'messages':>10}{'tokens':>8}{'x msgs':>8}{'x tokens':>9}")
    for t in thresholds:
        early = risk < t
        share = float(early.double().mean())
        token_share = float(tokens[early].sum() / tokens.sum().clamp_min(1))
        row = {
            "allow_below": t,
            "chosen": t == probe.spec.exit.allow_below,
            "messages": round(share, 4),
            "tokens": round(token_share, 4),
            "ideal_x_messages": round(1 / exit_cost(k, deepest, share), 3),
            "ideal_x_tokens": round(1 / exit_cost(k, deepest, token_share), 3),
        }
        table.append(row)
        mark = "  <- checkpoint" if row["chosen"] else ""
        print(
            f"{t:>11.3f}{share:>10.2f}{token_share:>8.2f}{row['ideal_x_messages']:>8.2f}"
            f"{row['ideal_x_tokens']:>9.2f}{mark}"
        )
    quantiles = {f"p{int(q * 100)}": int(tokens.quantile(q)) for q in (0.5, 0.9, 0.99)}
    summary = {
        "bench": "exit_tokens",
        "texts": len(texts),
        "tokens": int(tokens.sum()),
        "tokens_per_text": quantiles,
        "exit_layer": k,
        "deepest": deepest,
        "rows": table,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
