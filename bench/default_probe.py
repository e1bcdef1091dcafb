"""How good is the packaged default with no user labels, beside a probe fitted on each
dataset and all-MiniLM-L6-v2 + logistic regression, on the same held-out rows?

Every dataset's rows are split by :func:`worker.offline.default_probe.split_of` (a hash
of the id): the default trained on 70 % of the Apache-2.0 sources and never saw the
held-out 20 % (nor any of ToxicChat); the per-dataset ``fit`` (the default's recipe on
that dataset's heads alone) and MiniLM + LR train on the same 70 % and pick epochs and
thresholds on the same 10 %. Reported per (dataset, head): F1 at the chosen thresholds,
AUPRC and recall at 1 % false positives; for XSTest also the share of safe prompts the
default flags (over-flagging). The caches are the ones ``probeguard default build``
makes under ``--cache-root`` (ToxicChat's: ``probeguard cache build``)::

    python bench/default_probe.py --cache-root runs/default-cache --data-root ../shared/data

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from quality import peer_features

from probes import build_probe
from probes.metrics import average_precision, best_f1_threshold, recall_at_fpr
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, fit, predict_dataset
from probes.offline.multitask import as_multitask, multitask_targets
from schemas import ProbeSpec
from worker.defaults import find_default
from worker.offline.default_probe import CATEGORIES, SOURCES, Source, default_spec, split_of
from worker.offline.fit_eval import load_split

# (dataset, head, the head's positive label) measured; ToxicChat is never in the default.
MEASURED = [
    ("toxicchat", "toxicity", "toxic"),
    ("openai_moderation", "toxicity", "toxic"),
    *(("openai_moderation", h, label) for h, label in CATEGORIES),
    ("xstest", "unsafe", "unsafe"),
    ("davidson_hate_offensive", "offensive", "offensive"),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-root", type=Path, required=True, help="caches named by dataset")
    p.add_argument("--data-root", type=Path, required=True, help="<dataset>/train.jsonl texts")
    p.add_argument("--epochs", type=int, default=25, help="per-dataset fit: most epochs")
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--no-minilm", action="store_true", help="skip the MiniLM + LR peer")
    p.add_argument(
        "--datasets", default=None, help="comma-separated subset of the measured datasets"
    )
    return p.parse_args(argv)


def source(name: str) -> Source:
    return next(s for s in SOURCES if s.dataset == name)


def part(data: ProbeDataset, split: str) -> ProbeDataset:
    return data.subset(torch.tensor([i for i, r in enumerate(data.ids) if split_of(r) == split]))


def load(name: str, spec: ProbeSpec, root: Path) -> ProbeDataset:
    cache = HiddenStateCache(root / name)
    data = load_split(cache, spec.token_pool, list(spec.layers), "label")
    return as_multitask(data, spec, multitask_targets(spec, source(name).source_heads,
                                                      cache.row_labels()))  # fmt: skip


def heads_only(full: ProbeSpec, heads: Any) -> ProbeSpec:
    """``full`` with only ``heads`` (the per-dataset fit's spec)."""
    own = [h for h in full.heads if h.name in heads]
    labels = {x for h in own for x in h.labels}
    base = full.model_dump(exclude={"labels", "heads", "flag_labels", "thresholds"})
    return ProbeSpec.model_validate(
        {
            **base,
            "heads": [h.model_dump() for h in own],
            "flag_labels": [x for x in full.flag_labels if x in labels],
        }
    )


def figures(y: np.ndarray, score: np.ndarray, threshold: float) -> dict[str, float]:
    pred = score >= threshold
    tp, fp, fn = (pred & y).sum(), (pred & ~y).sum(), (~pred & y).sum()
    f1 = 2 * tp / max(1, 2 * tp + fp + fn)
    return {
        "f1": round(float(f1), 4),
        "auprc": round(average_precision(y, score), 4),
        "r_at_1pct_fpr": round(recall_at_fpr(y, score), 4),
        "n": len(y),
        "positives": int(y.sum()),
    }


def column(spec: ProbeSpec, data: ProbeDataset, label: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``data`` that annotate ``label``'s head: ``(row mask, truth)``."""
    j = spec.labels.index(label)
    known = ~data.targets[:, j].isnan()
    return known.numpy(), (data.targets[known, j] > 0.5).numpy()


def probe_rows(name: str, spec: ProbeSpec, probe: Any, held: ProbeDataset) -> dict[str, dict]:
    """The (``name``, head) rows of MEASURED for ``probe`` on ``name``'s held-out rows."""
    probs = predict_dataset(probe, held).numpy()
    out = {}
    for ds, head, label in MEASURED:
        if ds != name or label not in spec.labels or head not in {h.name for h in spec.heads}:
            continue
        rows, y = column(spec, held, label)
        if rows.any():
            t = probe.spec.thresholds.get(label, 0.5)
            out[f"{name}/{head}"] = figures(y, probs[rows, spec.labels.index(label)], t)
    return out


def minilm_rows(
    name: str, spec: ProbeSpec, data: ProbeDataset, texts: dict[str, str]
) -> dict[str, dict]:
    from sklearn.linear_model import LogisticRegression

    x = peer_features("minilm", [texts[i] for i in data.ids])
    split = np.array([split_of(i) for i in data.ids])
    out = {}
    for ds, head, label in MEASURED:
        if ds != name:
            continue
        j = spec.labels.index(label)
        known = ~data.targets[:, j].isnan().numpy()
        y = data.targets[:, j].nan_to_num(0).numpy() > 0.5
        fit_rows, val_rows, held_rows = (known & (split == s) for s in _SPLITS)
        if y[fit_rows].sum() == 0:
            continue
        lr = LogisticRegression(C=1.0, class_weight="balanced", max_iter=3000)
        lr.fit(x[fit_rows], y[fit_rows])
        threshold = best_f1_threshold(y[val_rows], lr.predict_proba(x[val_rows])[:, 1])[0]
        out[f"{name}/{head}"] = figures(
            y[held_rows], lr.predict_proba(x[held_rows])[:, 1], threshold
        )
    return out


_SPLITS = ("train", "validation", "held_out")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    default = None
    datasets = sorted({ds for ds, _, _ in MEASURED})
    if args.datasets:
        datasets = [d for d in datasets if d in args.datasets.split(",")]
    for name in datasets:
        llm = HiddenStateCache(args.cache_root / name).manifest.llm
        default = default or find_default(llm, "moderation")
    if default is None:
        raise SystemExit("this release ships no packaged default for the caches' LLM")
    full = default_spec(
        default.probe.spec.hidden_size, list(default.probe.layers), noncommercial=True
    )  # fmt: skip (every head, for the targets)
    rows: dict[str, dict[str, dict]] = {"default": {}, "fit": {}, "minilm": {}}
    over_flagging: dict[str, float] = {}
    for name in datasets:
        data = load(name, full, args.cache_root)
        held = part(data, "held_out")
        log(f"{name}: {len(data)} rows, {len(held)} held out")
        # The default (no labels of this dataset, or of any user).
        rows["default"] |= probe_rows(name, full, _aligned(default.probe, full), held)
        if name == "xstest":
            safe = (held.targets[:, full.labels.index("unsafe")] == 0).nonzero().flatten()
            flagged = _flagged(default.probe, held.subset(safe))
            over_flagging["default"] = round(float(flagged.float().mean()), 4)
        # The default's recipe fitted on this dataset's heads alone.
        spec = heads_only(full, source(name).heads)
        mine = load(name, spec, args.cache_root)
        config = FitConfig(max_epochs=args.epochs, patience=args.patience)
        t0 = time.time()
        result = fit(build_probe(spec, seed=0), part(mine, "train"), part(mine, "validation"),
                     config)  # fmt: skip
        log(f"{name}: fit {result.epochs} epochs in {time.time() - t0:.0f} s")
        rows["fit"] |= probe_rows(name, spec, result.probe, part(mine, "held_out"))
        if name == "xstest":
            safe_rows = part(mine, "held_out")
            safe = (safe_rows.targets[:, spec.labels.index("unsafe")] == 0).nonzero().flatten()
            flagged = _flagged(result.probe, safe_rows.subset(safe))
            over_flagging["fit"] = round(float(flagged.float().mean()), 4)
        if not args.no_minilm:
            texts = _texts(args.data_root, name, data.ids)
            rows["minilm"] |= minilm_rows(name, full, data, texts)
    _print(rows, over_flagging)
    openai = [
        k for k in rows["default"] if k.startswith("openai_moderation/") and "toxicity" not in k
    ]
    summary = {
        "question": "packaged default vs per-dataset fit vs MiniLM+LR on held-out rows",
        "rows": rows,
        "xstest_safe_flagged": over_flagging,
        "openai_macro_auprc": {
            k: round(float(np.mean([v[x]["auprc"] for x in openai if x in v])), 4)
            for k, v in rows.items()
            if v
        },
        "seconds": round(time.time() - started, 1),
    }
    print(json.dumps(summary))
    return 0


def _aligned(probe: Any, full: ProbeSpec) -> Any:
    """The default's probabilities laid out over ``full``'s labels (it may lack heads)."""

    class Aligned(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = probe
            self.spec = full.model_copy(update={"thresholds": probe.spec.thresholds})

        def predict_proba_many(self, hidden: torch.Tensor, mask: Any = None) -> torch.Tensor:
            p = self.inner.predict_proba_many(hidden, mask)
            out = torch.full((p.shape[0], len(full.labels)), float("nan"))
            for j, label in enumerate(self.inner.spec.labels):
                out[:, full.labels.index(label)] = p[:, j]
            return out

    return Aligned()


def _flagged(probe: Any, data: ProbeDataset) -> torch.Tensor:
    from probes.decision import decide

    return decide(probe.spec, predict_dataset(probe, data)).flagged


def _texts(root: Path, name: str, ids: list[str]) -> dict[str, str]:
    want, out = set(ids), {}
    files = [root / name / "train.jsonl", root / name / "validation.jsonl"]
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["id"] in want:
                out[row["id"]] = row["text"]
    return out


def _print(rows: dict[str, dict[str, dict]], over: dict[str, float]) -> None:
    keys = list(rows["default"])
    print(f"{'dataset/head':<36} {'default F1/AUPRC/R@1%':>24} {'fit':>24} {'MiniLM+LR':>24}")
    for k in keys:
        cells = []
        for who in ("default", "fit", "minilm"):
            m = rows[who].get(k)
            cells.append(f"{m['f1']:.3f}/{m['auprc']:.3f}/{m['r_at_1pct_fpr']:.3f}" if m else "-")
        n = rows["default"][k]
        name = f"{k} ({n['n']}, {n['positives']}+)"
        print(f"{name:<36} {cells[0]:>24} {cells[1]:>24} {cells[2]:>24}")
    print(f"XSTest safe prompts flagged: {over}")


if __name__ == "__main__":
    raise SystemExit(main())
