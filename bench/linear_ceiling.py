"""How far does a linear read of the LLM's hidden states transfer to text unlike its
training data (ToxicChat), next to MiniLM sentence embeddings read the same way?

The packaged default's toxicity head ranks ToxicChat at AUPRC ~0.37 where MiniLM + LR
trained on the same rows reads ~0.55 (``bench/default_probe.py``). This bench asks whether
that is the recipe or the states: one binary logistic regression (unsafe vs benign rows of
every shippable source, the roles the recipe gives them; development rows only, as
:func:`worker.offline.default_probe.split_of` splits them) per feature set:

- one layer's summary (``--pool``: the mean over the text's tokens, the last token, or both),
  standardized, for each of ``--layers``;
- every listed layer's summary side by side (``concat``);
- all-MiniLM-L6-v2 embeddings of the same rows (``--no-minilm`` skips them).

Regularization ``C`` is chosen by **leave one dataset out** (each source with benign and
unsafe rows in turn held out, the mean of their AUPRCs): the choice rewards transfer to a
source the fit never saw, which is what ToxicChat is. ToxicChat's AUPRC is reported at the
chosen ``C`` and at every ``C`` (so a reader sees how much the choice matters); ToxicChat
never takes part in a choice.

``--invariant`` reads each feature set a second time with the directions between the
sources' unsafe rows projected out (:func:`probes.offline.fit.source_directions`, from the
training rows of each fit): what the recipe's ``--source-invariant`` heads do.

Example (the caches ``probeguard default build --cache-root CACHES`` made, and ToxicChat's
``probeguard cache build --data toxicchat-all.jsonl --out TC --token-layers none``)::

    python bench/linear_ceiling.py --cache-root CACHES --data-root ../shared/data --toxicchat TC

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from default_probe import TOXICCHAT, texts_of  # bench/default_probe.py
from quality import peer_features  # bench/quality.py: all-MiniLM-L6-v2 embeddings

from probes.offline.cache import HiddenStateCache
from probes.offline.fit import source_directions
from worker.offline.default_recipe import SOURCES, Source, split_of

from _shared import log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cache-root", type=Path, required=True, help="the default build's caches")
    p.add_argument("--data-root", type=Path, required=True, help="<dataset>/train.jsonl texts")
    p.add_argument("--toxicchat", type=Path, required=True, help="ToxicChat's cache (all rows)")
    p.add_argument("--layers", default="6,14,22,30", help="layers read one at a time")
    p.add_argument(
        "--pool",
        choices=["mean", "last", "mean+last"],
        default="mean",
        help="the summary read (mean+last: both side by side; in the prompt form the last "
        "token is the end of the prompt, where the model has read the whole message)",
    )
    p.add_argument("--c-grid", default="1e-4,3e-4,1e-3,1e-2,1e-1,1", help="C values tried")
    p.add_argument("--no-minilm", action="store_true", help="skip the MiniLM embeddings")
    p.add_argument(
        "--invariant",
        action="store_true",
        help="also read each feature set held off the directions between the sources' unsafe rows",
    )
    return p.parse_args(argv)


def rows_of(source: Source, directory: Path, pool: str, layers: list[int], dev: bool) -> dict:
    """The cached rows of ``source`` with a role (benign 0, unsafe 1): their ids,
    targets and ``pool`` summaries of ``layers`` ([L, N, D] float32)."""
    cache = HiddenStateCache(directory)
    pools = pool.split("+")
    summaries = []
    for one in pools:
        data = cache.dataset(one, layers)  # type: ignore[arg-type]
        assert data.summaries is not None
        summaries.append(data.summaries)
    benign, unsafe = set(source.benign), set(source.unsafe)
    keep, y = [], []
    for i, (rid, names) in enumerate(zip(data.ids, cache.row_labels(), strict=True)):
        role = 0 if names & benign else 1 if names & unsafe else None
        if role is not None and (not dev or split_of(rid) != "held_out"):
            keep.append(i)
            y.append(role)
    x = torch.cat(summaries, dim=-1)[:, keep].float().numpy()
    return {"ids": [data.ids[i] for i in keep], "y": np.array(y), "x": x}


def auprc(y: np.ndarray, score: np.ndarray) -> float:
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(y, score))


def read(
    x: np.ndarray,
    y: np.ndarray,
    group: np.ndarray,
    x_tc: np.ndarray,
    y_tc: np.ndarray,
    grid: list,
    invariant: bool = False,
) -> dict[str, Any]:
    """Standardize on the training rows, choose C by leave one dataset out, measure
    ToxicChat at every C (``invariant``: each fit's features held off the directions
    between its training sources' unsafe rows)."""
    from sklearn.linear_model import LogisticRegression

    mu, sd = x.mean(0), x.std(0) + 1e-3
    x, x_tc = (x - mu) / sd, (x_tc - mu) / sd
    held = [g for g in sorted(set(group)) if len(set(y[group == g])) == 2]

    def model(c: float, rows: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        basis = np.zeros((0, x.shape[1]), np.float32)
        if invariant:
            found = source_directions(
                torch.from_numpy(x[rows]), torch.from_numpy(y[rows] == 1), list(group[rows])
            )
            basis = basis if found is None else found.numpy()

        def held_off(a: np.ndarray) -> np.ndarray:
            return a - (a @ basis.T) @ basis

        m = LogisticRegression(C=c, max_iter=3000, class_weight="balanced")
        m.fit(held_off(x[rows]), y[rows])
        return lambda a: m.decision_function(held_off(a))

    lodo, tc = {}, {}
    for c in grid:
        scores = [auprc(y[group == g], model(c, group != g)(x[group == g])) for g in held]
        lodo[c] = float(np.mean(scores))
        tc[c] = auprc(y_tc, model(c, np.ones(len(y), bool))(x_tc))
    best = max(grid, key=lambda c: lodo[c])
    return {
        "chosen_c": best,
        "lodo_auprc": round(lodo[best], 4),
        "toxicchat_auprc": round(tc[best], 4),
        "toxicchat_by_c": {str(c): round(v, 4) for c, v in tc.items()},
        "lodo_by_c": {str(c): round(v, 4) for c, v in lodo.items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    layers = [int(x) for x in args.layers.split(",")]
    grid = [float(x) for x in args.c_grid.split(",")]
    parts = []
    for source in SOURCES:
        if source.noncommercial or not (source.benign or source.unsafe):
            continue
        got = rows_of(source, args.cache_root / source.dataset, args.pool, layers, dev=True)
        log(f"{source.dataset}: {len(got['y'])} rows ({int(got['y'].sum())} unsafe)")
        parts.append((source, got))
    tc = rows_of(TOXICCHAT, args.toxicchat, args.pool, layers, dev=False)
    log(f"toxicchat: {len(tc['y'])} rows ({int(tc['y'].sum())} toxic)")
    y = np.concatenate([g["y"] for _, g in parts])
    group = np.array([source.dataset for source, g in parts for _ in g["y"]])
    x = np.concatenate([g["x"] for _, g in parts], axis=1)  # [L, N, D]
    results: dict[str, Any] = {}
    flat = np.concatenate(list(x), axis=1)
    flat_tc = np.concatenate(list(tc["x"]), axis=1)
    reads = [("", False), (" held", True)] if args.invariant else [("", False)]
    for suffix, held in reads:
        for k, layer in enumerate(layers):
            name = f"{args.pool} L{layer}{suffix}"
            results[name] = read(x[k], y, group, tc["x"][k], tc["y"], grid, held)
            log(f"{name}: {results[name]}")
        name = f"{args.pool} concat{suffix}"
        results[name] = read(flat, y, group, flat_tc, tc["y"], grid, held)
        log(f"{name}: {results[name]}")
    if not args.no_minilm:
        log("MiniLM embeddings ...")
        texts = [
            t for src, g in parts for t in texts_of(args.data_root, args.cache_root, src, g["ids"])
        ]
        mini = np.asarray(peer_features("minilm", texts))
        mini_tc = np.asarray(
            peer_features("minilm", texts_of(args.data_root, args.cache_root, TOXICCHAT, tc["ids"]))
        )
        results["minilm"] = read(mini, y, group, mini_tc, tc["y"], grid)
    print(f"{'features':<22}{'chosen C':>10}{'LODO AUPRC':>12}{'ToxicChat AUPRC':>17}")
    for name, r in results.items():
        print(
            f"{name:<22}{r['chosen_c']:>10g}{r['lodo_auprc']:>12.3f}{r['toxicchat_auprc']:>17.3f}"
        )
    summary = {
        "question": "linear read of the LLM's states vs MiniLM, C by leave one dataset out",
        "pool": args.pool,
        "invariant": args.invariant,
        "rows": len(y),
        "toxicchat_rows": len(tc["y"]),
        "results": results,
        "seconds": round(time.time() - started, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
