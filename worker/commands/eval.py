"""``probeguard eval``: score a checkpoint on a labeled file (runs the LLM) or on a cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from worker.commands._common import offline_errors, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on a labeled file or a cache",
        description=(
            "F1 at the checkpoint's thresholds, AUPRC, accuracy, per-class precision/recall, "
            "confusion matrix, and the layer weights the probe used (optionally as a PNG)."
        ),
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="labeled JSONL file (runs the LLM of the settings)")
    src.add_argument("--cache", type=Path, help="hidden-state cache of a labeled file")
    p.add_argument("--png", type=Path, help="write the layer weights as a PNG bar chart")
    p.add_argument("--batch-size", type=int, default=None, help="texts per extractor call")
    p.add_argument("--json", action="store_true", help="print the full report as one JSON line")
    p.set_defaults(func=_run)


@offline_errors
def _run(args: argparse.Namespace) -> int:
    from worker.offline.fit_eval import evaluate_on_cache, evaluate_on_rows

    if args.cache is not None:
        from probes.cache import HiddenStateCache

        probe, report = evaluate_on_cache(args.checkpoint, HiddenStateCache(args.cache))
    else:
        from worker.llm.extract import HiddenStateExtractor
        from worker.offline.labeled import read_labeled
        from worker.settings import load_settings

        overrides = {} if args.batch_size is None else {"batch_size": args.batch_size}
        settings = load_settings(**overrides)
        rows = read_labeled(args.data)
        extractor = HiddenStateExtractor.from_settings(settings)
        probe, report = evaluate_on_rows(args.checkpoint, rows, extractor, settings.batch_size)
    if args.png is not None:
        from worker.plots import plot_layer_weights

        plot_layer_weights(
            report["layers"], report["layer_weights"], args.png, title=probe.spec.name
        )
        report["png"] = str(args.png)
    if args.json:
        print_json(report)
    else:
        _print(report)
    return 0


def _print(r: dict[str, Any]) -> None:
    print(f"{r['probe']} on {r['n']} rows: {r['headline']}")
    print(f"  F1 {r['f1']:.4f}  AUPRC {r['auprc']:.4f}  accuracy {r['accuracy']:.4f}")
    print(f"  {'label':<20} {'prec':>6} {'recall':>6} {'f1':>6} {'auprc':>6} {'support':>7}")
    for label, m in r["per_class"].items():
        print(
            f"  {label:<20} {m['precision']:6.3f} {m['recall']:6.3f} {m['f1']:6.3f} "
            f"{m['auprc']:6.3f} {m['support']:7d}"
        )
    conf = r["confusion"]
    if "matrix" in conf:
        print("  confusion (rows true, columns predicted):", conf["labels"])
        for label, row in zip(conf["labels"], conf["matrix"], strict=True):
            print(f"    {label:<20} {row}")
    else:
        print("  confusion per label [[tn, fp], [fn, tp]]:")
        for label, m in conf["per_label"].items():
            print(f"    {label:<20} {m}")
    weights = ", ".join(
        f"{i}:{w:.3f}" for i, w in zip(r["layers"], r["layer_weights"], strict=True)
    )
    print(f"  layer weights {weights} (entropy {r['layer_entropy']:.3f} nats)")
