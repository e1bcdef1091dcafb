"""How good is the packaged default with no labels of the deployment, beside the fair peer
(all-MiniLM-L6-v2 + logistic regression trained on the same shippable data with the same
operating-point rule), on rows no choice saw? And what does each training set add?

Rows: every recipe source's ``train.jsonl`` is split by
:func:`worker.offline.default_probe.split_of` (a hash of the id): the default and the peer
develop on 80 % (train + validation) and are measured on the held-out 20 %. ToxicChat
(non-commercial, in neither) is measured on all of its train + validation rows
(``--toxicchat``: its cache, built with ``probeguard cache build``).

Per dataset: the flag policy's AUPRC (benign vs unsafe rows, ranked by how far the most
flagging head is past its threshold: :func:`probes.budget.flag_margin`), the share of
benign rows it flags and the share of unsafe rows it flags, and the AUPRC of the head that
names the dataset's task. The peer: one balanced logistic regression per head on the
development rows that annotate it; its thresholds by equal shares
(:func:`probes.budget.budget_thresholds` on 4-fold out-of-fold probabilities of the
benign development rows, the budget for every source: not the default's greedy
``recall_thresholds`` with its multiples for contrastive suites, so its flag rates are
not at the default's operating rule; AUPRC does not depend on thresholds).

``--ablate``: the default's recipe fitted again without each source in turn (the same
folds, seed, budget, held heads, price and rule; ``--ablate-seeds`` seeds, one by
default), every dataset measured again: what each set adds.

Example (the caches ``probeguard default build --cache-root runs/default-cache`` made)::

    python bench/default_probe.py --cache-root runs/default-cache \\
        --data-root ../shared/data --toxicchat runs/cache/toxicchat-all [--ablate]

The caches' LLM fingerprint decides which packaged default is measured: caches built with
``PROBEGUARD_TEXT_FORM=chat`` measure the chat-form default (``--default DIR``: a
checkpoint folder not packaged yet, e.g. a ``default build --out``).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probes import load_checkpoint
from probes.budget import budget_thresholds, flag_margin
from probes.metrics import average_precision
from probes.offline.cache import HiddenStateCache
from probes.offline.fit import FitConfig
from probes.offline.select import stratified_folds
from schemas import ProbeSpec
from worker.defaults import find_default, missing
from worker.offline.default_probe import (
    BUDGET,
    SOLVER,
    Loaded,
    fit_default,
    load_source,
    measure,
    recipe_rule,
)
from worker.offline.default_recipe import SOURCES, Source, default_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import peer_features  # bench/quality.py: all-MiniLM-L6-v2 embeddings

from _shared import log

# The head that names each dataset's own task (its AUPRC is reported beside the policy's).
TASK_HEAD = {
    "openai_moderation": "toxicity",
    "xstest": "unsafe",
    "convabuse": "toxicity",
    "hatecheck": "hate",
    "toxigen_demonstrations": "hate",
    "ailuminate_demo": "unsafe",
    "simplesafetytests": "unsafe",
    "davidson_hate_offensive": "offensive",
    "self_harm_statements": "self-harm",
    "toxicchat": "toxicity",
}
TOXICCHAT = Source(
    "toxicchat",
    "CC-BY-NC-4.0",
    "measured only: never trained on",
    {"toxicity": {"toxic": ["toxic"], "non-toxic": ["non-toxic"]}},
    benign=("non-toxic",),
    unsafe=("toxic",),
)


def add_row_args(p: argparse.ArgumentParser, *, toxicchat: bool = False) -> None:
    """The arguments naming the rows measured (:func:`_load`); ``toxicchat``: required."""
    p.add_argument("--cache-root", type=Path, required=True, help="the recipe's caches")
    p.add_argument("--data-root", type=Path, required=True, help="<dataset>/train.jsonl texts")
    p.add_argument(
        "--toxicchat", type=Path, required=toxicchat, help="ToxicChat's cache (all rows)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_row_args(p)
    p.add_argument(
        "--default",
        type=Path,
        default=None,
        help="measure this checkpoint folder (a `default build --out`) instead of the packaged "
        "default for the caches' LLM and text form",
    )
    p.add_argument("--budget", type=float, default=BUDGET)
    p.add_argument("--no-minilm", action="store_true", help="skip the MiniLM + LR peer")
    p.add_argument(
        "--budgets",
        action="store_true",
        help="also measure the default at every operating point its card ships "
        "(PROBEGUARD_DEFAULT_FLAG_BUDGET)",
    )
    p.add_argument("--ablate", action="store_true", help="refit without each source in turn")
    p.add_argument("--ablate-pool", default="mean", help="the ablation's probe kind (mean)")
    p.add_argument(
        "--ablate-solver",
        choices=["lion", "logistic", "lion+logistic"],
        default=SOLVER,
        help=f"the ablation's solver (the recipe's: {SOLVER}; lion for token-level pools)",
    )
    p.add_argument(
        "--ablate-seeds",
        type=int,
        default=1,
        metavar="N",
        help="each ablation fit the soup of N seeds' (default 1: twelve fits of the raw "
        "recipe's fifteen would take a day on 2 cores)",
    )
    p.add_argument("--folds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=25)
    return p.parse_args(argv)


def _sources() -> list[Source]:
    return [s for s in SOURCES if not s.noncommercial]


def _summary(m: dict[str, Any], dataset: str) -> dict[str, Any]:
    """The row of one (probe, dataset) in the table."""
    head = m["heads"].get(TASK_HEAD.get(dataset, ""), {})
    return {**m["policy"], "task_head_auprc": head.get("auprc")}


def texts_of(root: Path, cache_root: Path, source: Source, ids: list[str]) -> list[str]:
    """The texts of ``source``'s rows ``ids`` (ToxicChat: its train and validation files;
    a recipe source: the file its cache was built from)."""
    from worker.offline.default_probe import _source_file

    name = source.dataset
    if name == "toxicchat":
        files = [root / name / "train.jsonl", root / name / "validation.jsonl"]
    else:
        files = [_source_file(source, root, cache_root)]
    texts = {}
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            texts[row["id"]] = row["text"]
    return [texts[i] for i in ids]


class MiniLMPeer:
    """One balanced logistic regression per head over MiniLM embeddings; flag thresholds by
    equal shares of the budget on out-of-fold benign probabilities."""

    def __init__(self, spec: ProbeSpec, dev: list[Loaded], x: list[np.ndarray], budget: float):
        from sklearn.linear_model import LogisticRegression

        self.spec, self.models = spec, {}
        X = np.concatenate(x)
        data = [d.data for d in dev]
        y = torch.cat([d.targets for d in data]).numpy()
        folds = torch.cat([stratified_folds(d, 4, 0) for d in data]).numpy()
        oof = np.full(y.shape, np.nan)
        for j, label in enumerate(spec.labels):
            known = ~np.isnan(y[:, j])
            if y[known, j].sum() < 2:
                continue

            def model() -> Any:
                return LogisticRegression(C=1.0, class_weight="balanced", max_iter=3000)

            self.models[label] = model().fit(X[known], y[known, j] > 0.5)
            for k in range(4):
                fit_rows, out_rows = known & (folds != k), folds == k
                oof[out_rows, j] = (
                    model().fit(X[fit_rows], y[fit_rows, j] > 0.5).predict_proba(X[out_rows])[:, 1]
                )
        roles = [r for d in dev for r in d.roles]
        groups = [d.source.dataset for d in dev for r in d.roles if r == "benign"]
        benign = np.array([r == "benign" for r in roles])
        flag = [x for x in spec.flag_labels if x in self.models]
        cols = [spec.labels.index(x) for x in flag]
        self.flag = flag
        self.thresholds = budget_thresholds(
            torch.from_numpy(oof[benign][:, cols]).float(), groups, flag, budget=budget
        )

    def measure(self, item: Loaded, x: np.ndarray, dataset: str) -> dict[str, Any]:
        probs = np.column_stack([self.models[x_].predict_proba(x)[:, 1] for x_ in self.flag])
        t = [self.thresholds[x_] for x_ in self.flag]
        margin = flag_margin(torch.from_numpy(probs).float(), t).numpy()
        roles = np.array(item.roles)
        benign, unsafe = roles == "benign", roles == "unsafe"
        flagged = margin >= 0
        out: dict[str, Any] = {"benign": int(benign.sum()), "unsafe": int(unsafe.sum())}
        if benign.any():
            out["benign_flagged"] = round(float(flagged[benign].mean()), 4)
        if unsafe.any():
            out["unsafe_flagged"] = round(float(flagged[unsafe].mean()), 4)
        if benign.any() and unsafe.any():
            rows = benign | unsafe
            out["auprc"] = round(average_precision(unsafe[rows], margin[rows]), 4)
        head = TASK_HEAD.get(dataset)
        label = next((h.labels[-1] for h in self.spec.heads if h.name == head), None)
        if label in self.models:
            j = self.spec.labels.index(label)
            y = item.data.targets[:, j].numpy()
            known = ~np.isnan(y)
            if known.any() and 0 < y[known].sum() < known.sum():
                p = self.models[label].predict_proba(x[known])[:, 1]
                out["task_head_auprc"] = round(average_precision(y[known] > 0.5, p), 4)
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    llm = HiddenStateCache(args.cache_root / "convabuse").manifest.llm
    if args.default is not None:
        probe, _ = load_checkpoint(args.default, llm)
        card = json.loads((args.default / "card.json").read_text())
    elif (found := find_default(llm, "moderation")) is not None:
        probe, card = found.probe, found.card
    else:
        raise SystemExit(missing(llm))
    spec = default_spec(llm.hidden_size, list(probe.spec.layers), pool=probe.spec.token_pool)
    loaded, held = _load(spec, args)
    table: dict[str, dict[str, Any]] = {"default": {}}
    for name, item in held.items():
        table["default"][name] = _summary(measure(probe, item), name)
        log(f"default on {name}: {table['default'][name]}")
    if args.budgets:
        shipped = dict(probe.spec.thresholds)
        for budget, points in card.get("operating_points", {}).items():
            probe.set_thresholds({**shipped, **points})
            row = {n: _summary(measure(probe, i), n) for n, i in held.items()}
            table[f"default at budget {budget}"] = row
            log(f"default at budget {budget}: measured")
        probe.set_thresholds(shipped)
    if not args.no_minilm:
        dev = [Loaded.concat([x.part("train"), x.part("validation")]) for x in loaded]
        log("MiniLM embeddings of the development rows ...")
        x_dev = [
            peer_features("minilm", texts_of(args.data_root, args.cache_root, d.source, d.data.ids))
            for d in dev
        ]
        peer = MiniLMPeer(spec, dev, x_dev, args.budget)
        table["minilm_lr"] = {}
        for name, item in held.items():
            x = peer_features(
                "minilm", texts_of(args.data_root, args.cache_root, item.source, item.data.ids)
            )
            table["minilm_lr"][name] = peer.measure(item, x, name)
            log(f"MiniLM + LR on {name}: {table['minilm_lr'][name]}")
    if args.ablate:
        table |= ablation(args, llm.hidden_size, llm.num_layers, llm.form)
    _print(table)
    print(json.dumps({"question": "default vs MiniLM + LR vs ablations, held out",
                      "budget": args.budget, "table": table,
                      "seconds": round(time.time() - started, 1)}))  # fmt: skip
    return 0


def _load(spec: ProbeSpec, args: argparse.Namespace) -> tuple[list[Loaded], dict[str, Loaded]]:
    """Every shippable source's rows for ``spec``, and the rows each probe is measured on:
    the held-out part of each, and all of ToxicChat's."""
    loaded = [load_source(s, spec, args.cache_root, args.data_root, None) for s in _sources()]
    held = {x.source.dataset: x.part("held_out") for x in loaded}
    if args.toxicchat is not None:
        tc = load_source(replace(TOXICCHAT, dataset=args.toxicchat.name), spec,
                         args.toxicchat.parent, args.data_root, None)  # fmt: skip
        held["toxicchat"] = Loaded(TOXICCHAT, tc.data, tc.names)
    return loaded, held


def ablation(
    args: argparse.Namespace, hidden_size: int, num_layers: int, form: str | None
) -> dict[str, Any]:
    """The recipe fitted on every source, then without each in turn: the probe kind is
    ``--ablate-pool`` over every layer (a mean pool fits in a minute or two where the
    shipped gate takes twenty: ten fits); the held heads, price, rule, folds and budget
    the recipe's for the caches' text form; ``--ablate-seeds`` seeds (the recipe's raw
    form ships fifteen)."""
    spec = default_spec(hidden_size, list(range(num_layers + 1)), pool=args.ablate_pool)
    loaded, held = _load(spec, args)
    config = FitConfig(max_epochs=args.epochs, patience=4, seeds=args.ablate_seeds)
    recipe = recipe_rule(form)
    log(f"ablation: {args.ablate_solver}, {args.ablate_seeds} seed(s), {recipe}")
    out = {}
    for left_out in [None, *(s.dataset for s in _sources())]:
        t0 = time.time()
        rest = [x for x in loaded if x.source.dataset != left_out]
        fitted = fit_default(
            rest, spec, config, budget=args.budget, folds=args.folds,
            solver=args.ablate_solver, **recipe,
        )  # fmt: skip
        key = f"{args.ablate_pool}, {args.ablate_solver}: " + (
            "every source" if left_out is None else f"without {left_out}"
        )
        out[key] = {n: _summary(measure(fitted.result.probe, i), n) for n, i in held.items()}
        log(f"{key}: {time.time() - t0:.0f} s")
    return out


def _print(table: dict[str, dict[str, Any]]) -> None:
    names = list(next(iter(table.values())))
    cols = ["auprc", "benign_flagged", "unsafe_flagged", "task_head_auprc"]
    print(f"{'dataset':<24}{'probe':<32}" + "".join(f"{c:>18}" for c in cols))
    for name in names:
        for probe, rows in table.items():
            r = rows.get(name, {})
            cells = "".join(f"{'' if r.get(c) is None else r[c]:>18}" for c in cols)
            print(f"{name:<24}{probe:<32}{cells}")


if __name__ == "__main__":
    raise SystemExit(main())
