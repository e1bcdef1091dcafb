"""How many labels does a custom head need, and should the shared part stay frozen?

One question: an operator adds head ``jailbreak`` (label ``jailbreaking``) to the packaged
default (:func:`probes.heads.add_head`), then labels N ToxicChat messages for it; the
updater's learning core (:class:`~worker.learning.online_learner.OnlineLearner`, its
default settings) trains the head, either with the shared token pooling and layer mix
frozen (``PROBEGUARD_LEARN_FREEZE_SHARED=true``: the linear head alone) or fine-tuned with
it. Reported per N: the new head's AUPRC on held-out rows, the labels needed to reach 90 %
of the AUPRC with all labels, and how far the toxicity head's held-out AUPRC drifts (does
training the new head hurt the others?).

Data: the hidden-state cache of ToxicChat train + validation (``probeguard cache build``),
split by :func:`worker.offline.default_recipe.split_of`: N labels drawn from the ``train``
rows, AUPRC on the ``held_out`` rows. ``jailbreaking`` marks a positive; every other row
is a negative for the head. Positives are rare (about 2 %), so a draw of N labels takes
half positives (all of them when there are fewer) and the rest negatives, as an operator
labeling examples of a new category would; "all" is every train positive plus a random
``--all-negatives`` of the train negatives (a subsample, to keep the bench cheap). Each
draw is fed in shuffled passes until ``--steps`` Lion steps were taken (at least one
pass: "all" takes more), ``--seeds`` draws per N (one for "all").

Fine-tuned, the default starts as the updater's does (given an attention pool over its
layers where ``PROBEGUARD_DEFAULT_ATTENTION`` says so; the other heads held by the anchor):
it reads every layer's tokens (``--token-layers 0-30``) and costs seconds per Lion step
on a CPU, so it runs on ``--finetune-ns`` only. The frozen mode computes every row's mixed
features once with the default's pooling and mix (eval mode) and trains the same linear
head on them: the same computation as freezing the shared part of the real probe (dropout
on the same features, the same head and Lion steps), except that replay keeps those
features (fp16) rather than the tokens.

    probeguard cache build --data toxicchat-all.jsonl --out TC31 --token-layers 0-30 \\
        --summaries mean
    python bench/custom_head.py --cache TC31

Without a packaged default for the cache's LLM (or with ``--probe random``) the start is a
random probe of the default's spec: a stand-in for developing the bench, not a result.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probes import Probe, build_probe, encode_target
from probes.heads import add_head, remove_head
from probes.metrics import average_precision
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from schemas import HeadSpec, ProbeSpec
from worker.defaults import find_default
from worker.learning.config import LearningConfig
from worker.learning.online_learner import OnlineLearner
from worker.learning.resume import attend, given_attention
from worker.offline.default_recipe import default_spec, split_of
from worker.settings import Settings

from _shared import updater_states

HEAD = HeadSpec(name="jailbreak", task="multilabel", labels=["jailbreaking"])
NS = [8, 16, 32, 64, 128, 256]


def passes(n: int, batch: int, steps: int, per_batch: int) -> int:
    """Passes over ``n`` labels until ``steps`` Lion steps (at least one pass)."""
    return max(1, math.ceil(steps / (per_batch * math.ceil(n / batch))))


def feature_probe(probe: Probe) -> Probe:
    """``probe``'s linear head over inputs that are its mixed features ``[1, B, D]``."""
    spec = ProbeSpec.model_validate(
        {**probe.spec.model_dump(), "token_pool": "mean", "layer_mix": "single", "layers": [1]}
    )
    out = Probe(spec)
    out.head.load_state_dict(probe.head.state_dict())
    return out


@torch.no_grad()
def mixed(probe: Probe, data: ProbeDataset, rows: torch.Tensor) -> torch.Tensor:
    """The shared part's output ``[len(rows), D]`` (eval mode), for the frozen mode."""
    probe.eval()
    out = torch.empty(len(rows), probe.spec.hidden_size)
    order = torch.argsort(data.lengths[rows])
    for start in range(0, len(rows), 64):
        part = order[start : start + 64]
        hidden, mask, _ = data.batch(rows[part])
        out[part] = probe.mix(probe.summarize(hidden, mask))
    return out


def start_probe(cache: HiddenStateCache, which: str) -> tuple[Probe, str]:
    llm = cache.manifest.llm
    if which == "default":
        found = find_default(llm, "toxicity")
        if found is not None:
            probe = found.probe
            if "jailbreak" in {h.name for h in probe.spec.head_specs}:
                probe = remove_head(probe, "jailbreak")  # the non-commercial build has it
            return probe, f"packaged default {found.folder}"
        print("no packaged default for this LLM: a random stand-in", file=sys.stderr)
    layers = [x for x in cache.manifest.token_layers]
    spec = default_spec(llm.hidden_size, layers, name="toxicity")
    return build_probe(spec, seed=0), "random stand-in (not a result)"


def load(cache: HiddenStateCache, probe: Probe) -> ProbeDataset:
    features = "tokens" if not probe.separable else probe.spec.token_pool
    layers = list(probe.layers)
    return cache.dataset(features, layers, "label")  # type: ignore[arg-type]


@torch.no_grad()
def scores(probe: Probe, data: ProbeDataset, rows: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """Probabilities ``[len(rows), C]``, rows sorted by length so padding stays small."""
    order = rows[torch.argsort(data.lengths[rows])]
    out = torch.empty(len(rows), len(probe.spec.labels))
    where = {int(r): i for i, r in enumerate(rows.tolist())}
    for start in range(0, len(order), batch):
        part = order[start : start + batch]
        hidden, mask, _ = data.batch(part)
        probs = probe.predict_proba_many(hidden, mask)
        for j, r in enumerate(part.tolist()):
            out[where[r]] = probs[j]
    return out


def draw(pos: np.ndarray, neg: np.ndarray, n: int | None, rng: np.random.Generator, cap: int):
    """Half positives (all when fewer), the rest negatives; ``n=None``: all positives and
    ``cap`` negatives."""
    if n is None:
        return np.concatenate([pos, rng.choice(neg, size=min(cap, len(neg)), replace=False)])
    k = min(len(pos), n // 2)
    picked = np.concatenate(
        [rng.choice(pos, size=k, replace=False), rng.choice(neg, size=n - k, replace=False)]
    )
    return picked


def train(
    probe: Probe,
    batches: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    rows: np.ndarray,
    jail: np.ndarray,
    *,
    freeze: bool,
    seed: int,
    batch: int,
    steps: int,
) -> tuple[Probe, int]:
    """``probe`` (with the new head) trained online on ``rows``; ``batches(rows)`` gives
    their ``[L, B, T, D]`` hidden states and mask."""
    torch.manual_seed(seed)
    config = LearningConfig(freeze_shared=freeze, batch_size=batch)
    learner = OnlineLearner(probe, config)
    spec = probe.spec
    rng = np.random.default_rng(seed)
    targets = {
        int(r): encode_target(spec, ["jailbreaking"] if jail[r] else [], "jailbreak") for r in rows
    }
    for _ in range(passes(len(rows), batch, steps, config.steps_per_batch)):
        order = rng.permutation(rows)
        for start in range(0, len(order), batch):
            part = torch.as_tensor(order[start : start + batch])
            hidden, mask = batches(part)
            got = [targets[int(r)] for r in part]
            learner.learn(hidden, mask, torch.stack([t for t, _ in got]), [b for _, b in got])
    return learner.publishable(), learner.lion.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cache", type=Path, required=True, help="ToxicChat's cache (train + validation)"
    )
    ap.add_argument("--probe", choices=["default", "random"], default="default")
    ap.add_argument("--ns", default=",".join(map(str, NS)), help="label counts (comma-separated)")
    ap.add_argument("--finetune-ns", default="16,64,256", help="label counts, fine-tuned mode")
    ap.add_argument("--seeds", type=int, default=3, help="draws per N (frozen mode)")
    ap.add_argument("--steps", type=int, default=32, help="Lion steps per draw (at least)")
    ap.add_argument("--all-negatives", type=int, default=300, help="negatives in 'all'")
    ap.add_argument("--batch", type=int, default=16, help="new labels per Lion step batch")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cache = HiddenStateCache(args.cache)
    base, source = start_probe(cache, args.probe)
    base.eval()
    data = load(cache, base)
    names = cache.row_labels()
    ids = data.ids
    split = np.array([split_of(i) for i in ids])
    jail = np.array(["jailbreaking" in x for x in names])
    toxic = np.array(["toxic" in x for x in names])
    train_rows, held = np.flatnonzero(split == "train"), np.flatnonzero(split == "held_out")
    pos, neg = train_rows[jail[train_rows]], train_rows[~jail[train_rows]]
    if source.startswith("random"):  # a stand-in needs an input normalization
        base.set_input_stats(*data.subset(torch.as_tensor(train_rows)).input_stats())
    held_t = torch.as_tensor(held)
    tox_col = base.spec.labels.index("toxic")
    base_probs = scores(base, data, held_t)
    tox_base = average_precision(toxic[held], base_probs[:, tox_col].numpy())
    print(
        f"{source}: {len(train_rows)} train rows ({len(pos)} jailbreaking), {len(held)} "
        f"held-out ({int(jail[held].sum())} jailbreaking); toxicity AUPRC {tox_base:.3f}; "
        f"load {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    grown = add_head(base, HEAD)
    col = grown.spec.labels.index("jailbreaking")
    all_rows = torch.as_tensor(np.concatenate([train_rows, held]))
    where = {int(r): i for i, r in enumerate(all_rows.tolist())}
    feats = mixed(base, data, all_rows)  # [rows, D]
    held_feats = feats[torch.as_tensor([where[int(r)] for r in held])][None]  # [1, H, D]
    print(
        f"mixed features of {len(all_rows)} rows [{time.perf_counter() - t0:.0f} s]",
        file=sys.stderr,
    )

    def feature_batches(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = feats[torch.as_tensor([where[int(r)] for r in part])]  # [B, D]
        return x[None, :, None], torch.ones(len(part), 1, dtype=torch.bool)

    # Fine-tuned, the shared part starts as the updater's does from the default (given an
    # attention pool where PROBEGUARD_DEFAULT_ATTENTION says so), reading what it reads.
    tuned = given_attention(base) if attend(Settings(), base) else base
    tuned_data: ProbeDataset | None = None

    def tuned_batches(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert tuned_data is not None
        return updater_states(tuned_data, part)

    grids: dict[str, list[int | None]] = {
        "frozen": [*(int(x) for x in args.ns.split(",") if x), None],
        "finetuned": [*(int(x) for x in args.finetune_ns.split(",") if x), None],
    }
    results: dict[str, Any] = {}
    for mode, ns in grids.items():
        rows_out = []
        for n in ns:
            aps, drifts, steps = [], [], 0
            picked = np.array([], dtype=np.int64)
            seeds = args.seeds if n is not None and mode == "frozen" else 1
            for seed in range(seeds):
                rng = np.random.default_rng(1000 * seed + (n or 0))
                picked = draw(pos, neg, n, rng, args.all_negatives)
                if mode == "frozen":
                    trained, steps = train(
                        feature_probe(grown),
                        feature_batches,
                        picked,
                        jail,
                        freeze=True,
                        seed=seed,
                        batch=args.batch,
                        steps=args.steps,
                    )
                    trained.eval()
                    with torch.no_grad():
                        probs = trained.probabilities(trained(held_feats))
                else:
                    if tuned_data is None:
                        tuned_data = data if tuned is base else load(cache, tuned)
                    trained, steps = train(
                        add_head(tuned, HEAD),
                        tuned_batches,
                        picked,
                        jail,
                        freeze=False,
                        seed=seed,
                        batch=args.batch,
                        steps=args.steps,
                    )
                    probs = scores(trained, tuned_data, held_t)
                aps.append(average_precision(jail[held], probs[:, col].numpy()))
                tox = average_precision(toxic[held], probs[:, tox_col].numpy())
                drifts.append(tox - tox_base)
            row: dict[str, Any] = {
                "n": "all" if n is None else n,
                "labels": len(picked),
                "positives": int(jail[picked].sum()),
                "steps": steps,
                "auprc": float(np.mean(aps)),
                "auprc_runs": [round(a, 4) for a in aps],
                "toxicity_drift": float(np.mean(drifts)),
            }
            rows_out.append(row)
            print(
                f"{mode:9s} N={row['n']!s:>4} ({row['positives']} pos) AUPRC {row['auprc']:.3f} "
                f"{row['auprc_runs']} toxicity drift {row['toxicity_drift']:+.4f} "
                f"[{time.perf_counter() - t0:.0f} s]",
                file=sys.stderr,
            )
        full = rows_out[-1]["auprc"]
        reach = next((r["n"] for r in rows_out[:-1] if r["auprc"] >= 0.9 * full), None)
        results[mode] = {"rows": rows_out, "all_auprc": full, "labels_to_90pct": reach}
    print(
        json.dumps(
            {
                "question": "labels a custom head needs; frozen vs fine-tuned shared part",
                "start": source,
                "head": HEAD.name,
                "train_rows": len(train_rows),
                "train_positives": len(pos),
                "held_out_rows": len(held),
                "held_out_positives": int(jail[held].sum()),
                "toxicity_auprc_before": tox_base,
                "seeds": args.seeds,
                "steps": args.steps,
                "ns_finetuned": args.finetune_ns,
                "all_negatives": args.all_negatives,
                "seconds": round(time.perf_counter() - t0, 1),
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
