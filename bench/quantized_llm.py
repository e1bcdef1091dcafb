"""Is a cheaper frozen LLM worth it on CPU? Speed of extraction, and probe quality when
probes are trained and served on its states. ``--variant``:

- ``int8``: ``PROBEGUARD_LLM_QUANTIZE=int8``, torch dynamic int8 quantization of every
  ``nn.Linear`` (its own fingerprint: float32 probes are refused there);
- ``bf16``: ``PROBEGUARD_AUTOCAST=bfloat16``, the forward pass under ``torch.autocast``
  (matmuls in bfloat16, weights and residual stream float32; the same fingerprint, so
  float32 probes serve on it as they are). ``auto``, the default, picks it on CPUs with
  AMX or AVX512-BF16.

Speed: the configured LLM (``PROBEGUARD_MODEL``, default SmolLM2-135M) loaded twice, plain
float32 (autocast off) and as the variant, extracts the same ``--limit`` texts of
``--texts`` (the scorer's defaults: length-sorted micro-batches of at most ``batch_size``
texts and ``batch_tokens`` padded tokens, reading ``--layers``). The two run alternately,
``--repeats`` times each, keeping each one's fastest run; wall and process CPU seconds are
both reported (on a shared machine the CPU-time ratio is the steadier one). Then how far
the variant's states move: the cosine of mean-pooled states float32 vs variant, and how
much a text's states depend on the texts batched with it (int8 dynamic quantization picks
one activation scale per tensor).

Quality: the rows of ``--data`` whose id hashes into ``--holdout-share`` (default 0.3,
``probes.offline.select.held_out``) are held out; on the rest each ``--kinds`` probe is chosen by
k-fold CV (as ``bench/quality.py`` does) once on float32 states and once on the variant's
(caches of the same file under ``--cache-root``, one folder per variant, reused when
present), and scored on the held-out rows of the same kind of states. The cross column
scores the float32 probe on the variant's states: what serving it there gives (for int8,
were the fingerprint not checked).

Examples (int8 on 2 cores shared with other jobs, load average 12: 16 min to build the
int8 cache, 11 and 6 min for the mean probe's CV on each kind of states)::

    D=../shared/data/toxicchat
    python bench/quantized_llm.py --texts $D/validation.jsonl --data $D/train.jsonl \\
        --cache-root runs/cache --variant int8
    python bench/quantized_llm.py --texts $D/validation.jsonl --data $D/train.jsonl \\
        --cache-root runs/cache --variant bf16 --kinds mha --folds 3

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import quality  # noqa: E402  (bench/quality.py: data loading, splits, specs, figures)

from _shared import log  # noqa: E402

# The variants' settings, and the plain float32 LLM they are compared with.
PLAIN: dict[str, str] = {"llm_quantize": "none", "autocast": "off"}
VARIANTS: dict[str, dict[str, str]] = {
    "int8": {"llm_quantize": "int8", "autocast": "off"},
    "bf16": {"llm_quantize": "none", "autocast": "bfloat16"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--texts", type=Path, required=True, help="JSONL with 'text' (speed)")
    p.add_argument("--limit", type=int, default=192, help="texts for speed (%(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="runs per config, fastest kept")
    p.add_argument("--layers", default="4,8,11,15,19,22,26,30", help="layers read (speed)")
    p.add_argument("--data", type=Path, help="labeled JSONL (quality); omit to skip quality")
    p.add_argument("--holdout-share", type=float, default=0.3)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="int8")
    p.add_argument("--cache-root", type=Path, default=Path("runs/cache"), help="caches")
    p.add_argument("--wait-cache-s", type=float, default=0, help="for a float32 cache in build")
    p.add_argument("--kinds", default="mean", help="probe kinds (gate, mha: slow on 2 cores)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=quality.FitConfig.max_epochs)
    p.add_argument("--patience", type=int, default=quality.FitConfig.patience)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- speed -------------------------------------------------------------------------------


def extractors(variant: str) -> dict[str, Any]:
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import load_settings

    out = {}
    for name, overrides in (("float32", PLAIN), (variant, VARIANTS[variant])):
        started = time.perf_counter()
        out[name] = HiddenStateExtractor.from_settings(load_settings(**overrides))
        n = sum(isinstance(m, torch.nn.Linear) for m in out[name].llm.model.modules())
        fp = out[name].fingerprint
        log(f"{name}: loaded in {time.perf_counter() - started:.1f} s, {n} float nn.Linear, "
            f"fingerprint {fp.digest} ({fp.quantization or 'not quantized'}), "
            f"autocast {out[name].autocast or 'off'}")  # fmt: skip
    return out


def speed(exs: dict[str, Any], texts: list[str], layers: list[int], repeats: int) -> dict:
    best: dict[str, dict[str, float]] = {}
    for r in range(repeats):
        for name, ex in exs.items():
            w0, c0 = time.perf_counter(), time.process_time()
            ex.extract(texts, layers)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            log(f"  run {r + 1} {name}: {len(texts) / wall:.1f} msg/s wall, {cpu:.1f} s CPU")
            prev = best.get(name)
            if prev is None or wall < prev["wall_s"]:
                best[name] = {"wall_s": wall, "cpu_s": cpu}
    return {
        name: {
            "msg_s": round(len(texts) / b["wall_s"], 2),
            "wall_s": round(b["wall_s"], 2),
            "cpu_s": round(b["cpu_s"], 2),
        }
        for name, b in best.items()
    }


def pooled(ex: Any, texts: list[str], layer: int) -> torch.Tensor:
    out = ex.extract(texts, [layer])
    h, m = out.hidden[0].float(), out.mask[..., None].float()  # [B, T, D], [B, T, 1]
    return (h * m).sum(1) / m.sum(1)


def drift(exs: dict[str, Any], variant: str, texts: list[str], layer: int) -> dict[str, Any]:
    """Cosine of mean-pooled states float32 vs the variant, and the variant alone vs
    batched."""
    f32, q = pooled(exs["float32"], texts, layer), pooled(exs[variant], texts, layer)
    alone = torch.cat([pooled(exs[variant], [t], layer) for t in texts])
    cos = torch.nn.functional.cosine_similarity
    f32_alone = torch.cat([pooled(exs["float32"], [t], layer) for t in texts])
    return {
        "layer": layer,
        "cos_f32_vs_variant_min": round(float(cos(f32, q).min()), 4),
        "cos_f32_vs_variant_mean": round(float(cos(f32, q).mean()), 4),
        "cos_variant_alone_vs_batched_min": round(float(cos(alone, q).min()), 5),
        "variant_alone_vs_batched_max_abs": round(float((alone - q).abs().max()), 5),
        "f32_alone_vs_batched_max_abs": round(float((f32_alone - f32).abs().max()), 5),
    }


# --- quality -----------------------------------------------------------------------------


def wait_for_cache(path: Path, root: Path, wait_s: float) -> None:
    """Wait up to ``wait_s`` for a float32 cache that another process is still building."""
    from probes.errors import CacheError
    from probes.offline.cache import HiddenStateCache
    from worker.offline.build_cache import cache_dir_for
    from worker.settings import load_settings

    out = cache_dir_for(path, root, str(load_settings().model))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            missing = HiddenStateCache(out).missing_shards()
        except CacheError:
            return  # no cache there: cache_for builds it
        if not missing:
            return
        log(f"waiting for {out}: {len(missing)} shard(s) still being built elsewhere …")
        time.sleep(30)


def probe_quality(kind: str, caches: dict[str, Any], args: argparse.Namespace) -> dict:
    from probes.offline.fit import FitConfig, predict_dataset
    from probes.offline.select import fit_cv

    config = FitConfig(max_epochs=args.epochs, patience=args.patience, seed=args.seed)
    held: dict[str, Any] = {}
    probes: dict[str, Any] = {}
    row: dict[str, Any] = {"kind": kind}
    for name, cache in caches.items():
        data = quality.load([cache], kind, "label")
        dev, held[name] = quality.split(data, None, args.holdout_share)
        spec = quality.spec_for(kind, dev, cache.manifest.llm.hidden_size, "label")
        started = time.perf_counter()
        result, cv = fit_cv(spec, dev, config, folds=args.folds)
        probes[name] = (result.probe, spec, cv.thresholds)
        probs = predict_dataset(result.probe, held[name])
        cv_auprc, _ = quality.spread([{"auprc": f.auprc} for f in cv.folds], "auprc")
        row[name] = {
            "cv_auprc": round(cv_auprc, 4),
            **quality.figures(spec, probs, held[name].targets, cv.thresholds),
            "seconds": round(time.perf_counter() - started, 1),
        }
        row["dev_rows"], row["test_rows"] = len(dev), len(held[name])
        log(f"  {kind} on {name}: {row[name]}")
    probe, spec, thresholds = probes["float32"]
    (variant,) = set(caches) - {"float32"}
    assert held["float32"].ids == held[variant].ids
    cross = predict_dataset(probe, held[variant])
    row["float32_probe_on_variant"] = quality.figures(
        spec, cross, held[variant].targets, thresholds
    )
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from worker.offline.labeled import read_labeled

    layers = [int(x) for x in args.layers.split(",")]
    texts = [r.text for r in read_labeled(args.texts)][: args.limit]
    variant = args.variant
    exs = extractors(variant)
    log(f"speed: {len(texts)} texts of {args.texts}, layers {layers} …")
    sp = speed(exs, texts, layers, args.repeats)
    ratio_wall = sp[variant]["msg_s"] / sp["float32"]["msg_s"]
    ratio_cpu = sp["float32"]["cpu_s"] / sp[variant]["cpu_s"]
    dr = drift(exs, variant, texts[:32], layers[-1])
    print(f"{'LLM':<10}{'msg/s':>8}{'CPU s':>8}   ({len(texts)} texts, layers {layers})")
    for name, s in sp.items():
        print(f"{name:<10}{s['msg_s']:>8.2f}{s['cpu_s']:>8.1f}")
    print(f"{variant} / float32: {ratio_wall:.2f}x msg/s (wall), {ratio_cpu:.2f}x on CPU time")
    print(f"states: {dr}")
    out: dict[str, Any] = {
        "bench": "quantized_llm",
        "variant": variant,
        "settings": VARIANTS[variant],
        "texts": str(args.texts),
        "limit": len(texts),
        "layers": layers,
        "speed": sp,
        "speedup_wall": round(ratio_wall, 2),
        "speedup_cpu": round(ratio_cpu, 2),
        "states": dr,
    }
    if args.data is not None:
        del exs
        wait_for_cache(args.data, args.cache_root, args.wait_cache_s)
        caches = {
            "float32": quality.cache_for(args.data, args.cache_root, **PLAIN),
            variant: quality.cache_for(args.data, args.cache_root, **VARIANTS[variant]),
        }
        for name, c in caches.items():
            log(f"{name} cache: {c.root if hasattr(c, 'root') else ''} {c.manifest.llm.digest}")
        rows = []
        for kind in [k for k in args.kinds.split(",") if k]:
            log(f"{kind}: {args.folds}-fold CV on the development rows, then held-out …")
            rows.append(probe_quality(kind, caches, args))
        print()
        print(f"held-out AUPRC / F1 ({args.data}, {args.holdout_share} held out by id hash)")
        print(f"{'kind':<6}{'float32':>16}{variant:>16}{'f32 probe on ' + variant:>20}")
        for r in rows:
            f, q, x = r["float32"], r[variant], r["float32_probe_on_variant"]
            print(
                f"{r['kind']:<6}{f['auprc']:>9.3f} {f['f1']:.3f}{q['auprc']:>9.3f} {q['f1']:.3f}"
                f"{x['auprc']:>13.3f} {x['f1']:.3f}"
            )
        out.update(data=str(args.data), holdout_share=args.holdout_share, quality=rows)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
