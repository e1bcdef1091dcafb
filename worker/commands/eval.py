"""``probeguard eval``: score a checkpoint on a labeled file (runs the LLM) or on a cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.commands._common import offline_errors, print_json

if TYPE_CHECKING:
    from probes.offline.cache import HiddenStateCache

__all__ = ["register"]

# worker.offline.label_map has the rules.
HEADS_MAP_HELP = (
    "what the file's labels mean for heads: 'HEAD=[LABEL:]NAME,...' entries joined by ';' "
    "(rows naming a NAME are positives of the head's LABEL, by default its only label or "
    "only flag label; every other row a negative), e.g. 'toxicity=toxic:flagged,unsafe;"
    "hate=hate'; or a JSON file (PATH.json or @PATH) {head: {file label: [head labels]}} "
    "as the default's recipe writes them ([] a negative; rows naming none of a head's file "
    "labels leave it unknown); or 'recipe:DATASET', the default's recipe's map of that "
    "dataset. Heads not named keep the defaults: a head whose labels the file names is "
    "measured on every row (rows naming none of them are negatives), the others not at all"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on a labeled file or a cache",
        description=(
            "F1 at the checkpoint's thresholds, AUPRC, recall at 1% false positives, expected "
            "calibration error (ECE: 15 equal-width bins of the flag score), accuracy, "
            "per-class precision/recall, confusion matrix, and the layer weights the probe used "
            "(optionally as a PNG). A row's label names are its 'label' and its 'labels' "
            "together. A multi-head probe is measured head by head on the rows that annotate "
            "each head, and its verdict's 'flagged' policy (any head of "
            "PROBEGUARD_FLAG_HEADS, unset: any flagging head) as one more row, with the "
            "share of benign rows (negative for every head they annotate) it flags."
        ),
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="checkpoint directory, or 'default': the packaged default for the LLM",
    )
    p.add_argument(
        "--head",
        help="measure this head of a multi-head probe alone: the file's label names in the "
        "head's label space (and those --heads-map gives it) are its positives, every other "
        'row a negative (e.g. --head sexual on a file with labels: ["sexual", ...])',
    )
    p.add_argument("--heads-map", metavar="MAP", help=HEADS_MAP_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="labeled JSONL file (runs the LLM of the settings)")
    src.add_argument(
        "--cache",
        type=Path,
        action="append",
        help="hidden-state cache of a labeled file; for an ensemble (fit with several "
        "--cache), once per member LLM, each a cache of the same file",
    )
    p.add_argument("--png", type=Path, help="write the layer weights as a PNG bar chart")
    science = p.add_argument_group(
        "what the probe knows and where (with --cache)",
        "--per-layer fits the checkpoint's kind on each cached layer alone (on --train-cache, "
        "early stopping and thresholds on 15% of it) and measures it on --cache; --control "
        "adds a control task (labels from each message's first word, same balance) and "
        "selectivity = task - control, per layer and for the checkpoint's kind with all its "
        "layers; --class-layers splits each class's logit by layer (cheap: no fitting). "
        "Costs: mean/max, 31 layers, ~2.5k rows: a few minutes on 2 cores; gate/mha fit on "
        "the 8 token layers and take much longer (lower --curve-epochs).",
    )
    science.add_argument("--per-layer", action="store_true", help="per-layer probing curve")
    science.add_argument("--train-cache", type=Path, help="cache the per-layer probes train on")
    science.add_argument("--control", action="store_true", help="control task and selectivity")
    science.add_argument(
        "--texts",
        type=Path,
        action="append",
        default=[],
        help="labeled files with the texts of both caches (default: the caches' source files)",
    )
    science.add_argument("--class-layers", action="store_true", help="per-class layer-use heat map")
    science.add_argument("--plot-dir", type=Path, help="write layer-curve.png, class-layers.png")
    science.add_argument("--curve-epochs", type=int, default=20, help="max epochs per layer (20)")
    p.add_argument("--batch-size", type=int, default=None, help="texts per extractor call")
    p.add_argument("--json", action="store_true", help="print the full report as one JSON line")
    p.set_defaults(func=_run)


def _check_science(args: argparse.Namespace) -> None:
    if (args.per_layer or args.control or args.class_layers) and args.cache is None:
        raise SystemExit("probeguard eval: --per-layer, --control and --class-layers need --cache")
    if args.per_layer and args.train_cache is None:
        raise SystemExit("probeguard eval: --per-layer needs --train-cache (where probes train)")
    if args.control and not args.per_layer:
        raise SystemExit("probeguard eval: --control goes with --per-layer")
    if args.curve_epochs < 1:
        raise SystemExit(f"probeguard eval: --curve-epochs must be >= 1, got {args.curve_epochs}")


def _open_cache(path: Path) -> HiddenStateCache:
    """The cache at ``path``, with ``PROBEGUARD_CACHE_KEY`` for an encrypted one."""
    from probes.offline.cache import HiddenStateCache
    from worker.settings import load_settings

    return HiddenStateCache(path, key=load_settings().cache_key_bytes)


@offline_errors
def _run(args: argparse.Namespace) -> int:
    from probes.ensemble import is_ensemble
    from worker.offline.evaluate import evaluate_on_cache, evaluate_on_rows

    _check_science(args)
    if is_ensemble(args.checkpoint):
        return _run_ensemble(args)
    if args.cache is not None and len(args.cache) > 1:
        raise SystemExit(
            f"probeguard eval: {args.checkpoint} is one probe over one LLM; give one --cache"
        )
    from worker.offline.label_map import parse_heads_map
    from worker.settings import load_settings

    heads_map = parse_heads_map(args.heads_map) if args.heads_map is not None else None
    overrides = {} if args.batch_size is None else {"batch_size": args.batch_size}
    settings = load_settings(**overrides)
    read = {"head": args.head, "heads_map": heads_map, "flag_heads": settings.flag_head_names}
    if args.cache is not None:
        probe, report = evaluate_on_cache(args.checkpoint, _open_cache(args.cache[0]), **read)
    else:
        from worker.llm.extract import HiddenStateExtractor
        from worker.offline.labeled import read_labeled

        rows = read_labeled(args.data)
        extractor = HiddenStateExtractor.from_settings(settings)
        probe, report = evaluate_on_rows(
            args.checkpoint, rows, extractor, settings.batch_size, name=str(args.data), **read
        )
    if args.png is not None:
        from worker.plots import plot_layer_weights

        plot_layer_weights(
            report["layers"], report["layer_weights"], args.png, title=probe.spec.name
        )
        report["png"] = str(args.png)
    if args.per_layer or args.class_layers:
        _science(args, probe, report)
    if args.json:
        print_json(report)
    else:
        _print(report)
        _print_science(report)
    return 0


def _run_ensemble(args: argparse.Namespace) -> int:
    from worker.offline.evaluate import evaluate_ensemble_on_caches

    if args.cache is None:
        raise SystemExit(
            f"probeguard eval: {args.checkpoint} is an ensemble; measure it on caches, one "
            "--cache per member LLM (cache build with each PROBEGUARD_MODEL)"
        )
    given = (("--head", args.head), ("--heads-map", args.heads_map), ("--png", args.png))
    asked = [f for f, v in given if v is not None]
    asked += ["--per-layer"] * bool(args.per_layer) + ["--class-layers"] * bool(args.class_layers)
    if asked:
        raise SystemExit(
            f"probeguard eval: {', '.join(asked)} read(s) one probe; measure an ensemble "
            "member alone by pointing --checkpoint at its folder"
        )
    from worker.settings import load_settings

    key = load_settings().signing_key  # keyed, an ensemble's signatures are checked too
    report = evaluate_ensemble_on_caches(
        args.checkpoint, [_open_cache(c) for c in args.cache], signing_key=key
    )
    if args.json:
        print_json(report)
    else:
        _print(report)
    return 0


def _science(args: argparse.Namespace, probe: Any, report: dict[str, Any]) -> None:
    import logging

    from probes.offline.fit import FitConfig
    from worker.offline import probe_science as ps

    cache = _open_cache(args.cache[0])
    name = probe.spec.name
    if args.class_layers:
        report["class_layers"] = ps.class_layers(probe, cache)
        if args.plot_dir is not None:
            from worker.plots import plot_class_layers

            use = report["class_layers"]
            path = plot_class_layers(
                use["labels"],
                use["layers"],
                use["shares"],
                args.plot_dir / "class-layers.png",
                title=f"{name}: each layer's share of each class's logit gap on its rows",
            )
            report["class_layers_png"] = str(path)
    if not args.per_layer:
        return
    train = _open_cache(args.train_cache)
    texts = ps.texts_by_id([train, cache], args.texts) if args.control else None
    config = FitConfig(max_epochs=args.curve_epochs, patience=min(6, args.curve_epochs))
    log = logging.getLogger("probeguard.eval")
    rows, info = ps.layer_curve(
        probe.spec,
        train,
        cache,
        config,
        control=texts,
        progress=lambda r: log.info("layer %s: %s", r["layer"], _fmt_row(r)),
    )
    report["per_layer"] = rows
    report.update(info)
    if texts is not None:
        report["selectivity"] = ps.kind_selectivity(probe.spec, train, cache, config, texts)
    if args.plot_dir is not None:
        from worker.plots import plot_layer_curve

        path = plot_layer_curve(
            rows,
            args.plot_dir / "layer-curve.png",
            mix_layers=report["layers"],
            mix_weights=report["layer_weights"],
            title=f"{name} ({probe.spec.token_pool}), one probe per layer, on "
            f"{cache.directory.name}",
        )
        report["layer_curve_png"] = str(path)


def _fmt_row(r: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float) and k != "seconds"
    )


def _print_science(r: dict[str, Any]) -> None:
    if "per_layer" in r:
        control = "control_f1" in r["per_layer"][0]
        head = "  per layer: layer  F1     AUPRC" + (
            "  ctl F1 ctl AUPRC  sel F1 sel AUPRC" if control else ""
        )
        print(head)
        for row in r["per_layer"]:
            line = f"             {row['layer']:>5}  {row['f1']:.3f}  {row['auprc']:.3f}"
            if control:
                line += (
                    f"  {row['control_f1']:.3f}  {row['control_auprc']:.3f}      "
                    f"{row['selectivity_f1']:+.3f}  {row['selectivity_auprc']:+.3f}"
                )
            print(line)
    if "selectivity" in r:
        s = r["selectivity"]
        print(
            f"  selectivity of {s['kind']} ({s['parameters']} parameters, all its layers): "
            f"F1 {s['f1']:.3f} - control {s['control_f1']:.3f} = {s['selectivity_f1']:+.3f}; "
            f"AUPRC {s['auprc']:.3f} - control {s['control_auprc']:.3f} = "
            f"{s['selectivity_auprc']:+.3f}"
        )
        print(
            f"  control labels from the real label: accuracy {s['control_from_label_accuracy']:.3f}"
            f" vs majority {s['control_majority_accuracy']:.3f}"
        )
    if "class_layers" in r:
        use = r["class_layers"]
        print("  per-class layer use (share of the class's logit gap; top 3 layers):")
        for label, shares in zip(use["labels"], use["shares"], strict=True):
            top = sorted(zip(use["layers"], shares, strict=True), key=lambda x: -abs(x[1]))[:3]
            print(f"    {label:<20} " + ", ".join(f"L{layer} {v:+.2f}" for layer, v in top))
    for key in ("layer_curve_png", "class_layers_png"):
        if key in r:
            print(f"  wrote {r[key]}")


def _print_policy(p: dict[str, Any]) -> None:
    if p["n"]:
        print(
            f"  policy {'flagged':<16} F1 {p['f1']:.4f}  AUPRC {p['auprc']:.4f}  recall at 1% "
            f"FPR {p['recall_at_1pct_fpr']:.4f}  flags {p['flag_rate']:.1%}  rows {p['n']} "
            f"({p['positives']} positive)"
        )
    b = p["benign"]
    heads = ", ".join(p["heads"]) or "none"
    if b["n"]:
        names = ", ".join(f"{k} {v}" for k, v in b["labels"].items())
        print(
            f"  benign rows (negative for every head they annotate): {b['n']} ({names}); the "
            f"policy (any of {heads}) flags {b['flagged']}: benign flag rate {b['rate']:.1%}"
        )
    else:
        print(f"  no benign rows (negative for every head they annotate); policy: any of {heads}")


def _print(r: dict[str, Any]) -> None:
    print(f"{r['probe']} on {r['n']} rows: {r['headline']}")
    print(
        f"  F1 {r['f1']:.4f}  AUPRC {r['auprc']:.4f}  recall at 1% FPR "
        f"{r['recall_at_1pct_fpr']:.4f}  ECE {r['ece']:.4f}  accuracy {r['accuracy']:.4f}"
    )
    for head, h in r.get("heads", {}).items():
        print(
            f"  head {head:<18} F1 {h['f1']:.4f}  AUPRC {h['auprc']:.4f}  recall at 1% FPR "
            f"{h['recall_at_1pct_fpr']:.4f}  ECE {h['ece']:.4f}  rows {h['n']}"
        )
    if "policy" in r:
        _print_policy(r["policy"])
    if r.get("unannotated"):
        print(f"  {r['unannotated']} row(s) annotate no head: not measured")
    if r.get("unread_labels"):
        print(f"  labels no head reads: {', '.join(r['unread_labels'])} (see --heads-map)")
    print(
        f"  {'label':<20} {'prec':>6} {'recall':>6} {'f1':>6} {'auprc':>6} {'r@1%':>6} "
        f"{'ece':>6} {'support':>7}"
    )
    for label, m in r["per_class"].items():
        print(
            f"  {label:<20} {m['precision']:6.3f} {m['recall']:6.3f} {m['f1']:6.3f} "
            f"{m['auprc']:6.3f} {m['recall_at_1pct_fpr']:6.3f} {m['ece']:6.3f} "
            f"{m['support']:7d}"
        )
    conf = r.get("confusion", {})  # per head for a multi-head probe (in --json)
    if "matrix" in conf:
        print("  confusion (rows true, columns predicted):", conf["labels"])
        for label, row in zip(conf["labels"], conf["matrix"], strict=True):
            print(f"    {label:<20} {row}")
    elif "per_label" in conf:
        print("  confusion per label [[tn, fp], [fn, tp]]:")
        for label, m in conf["per_label"].items():
            print(f"    {label:<20} {m}")
    for m in r.get("members", []):
        print(
            f"  member {m['llm']:<30} F1 {m['f1']:.4f}  AUPRC {m['auprc']:.4f}  recall at 1% "
            f"FPR {m['recall_at_1pct_fpr']:.4f}  ECE {m['ece']:.4f}"
        )
    if "layers" in r:
        weights = ", ".join(
            f"{i}:{w:.3f}" for i, w in zip(r["layers"], r["layer_weights"], strict=True)
        )
        print(f"  layer weights {weights} (entropy {r['layer_entropy']:.3f} nats)")
