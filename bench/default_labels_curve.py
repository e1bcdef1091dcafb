"""What does the packaged default become with the deployment's own labels, against the same
updater learning from zero?

The updater's learning core (:class:`worker.learning.online_learner.OnlineLearner`, with the
updater's default settings: test then train, Lion, replay, calibration and thresholds on
the prequential window at every publish) learns ToxicChat labels in a fixed shuffled
order, starting (a) from the packaged default (what ``probeguard train`` does with
nothing published) and (b) from zero (``PROBEGUARD_DEFAULT_PROBE=false``: the updater's
from-zero probe). After 0, 100, 300, 1,000 and all of the stream's labels, the probe it
would publish is measured on ToxicChat rows held out by id hash
(``probes.offline.select.held_out``, 30 %, as ``bench/quality.py``): the toxicity head's
AUPRC, the flag policy's AUPRC and the share of held-out non-toxic prompts it flags; and
the share of the recipe's held-out ConvAbuse non-abusive turns it flags (benign chat the
deployment never labeled: does learning ToxicChat cost ordinary chat?).

Example (ToxicChat's cache from ``probeguard cache build`` of its train + validation
rows; the recipe's caches from ``probeguard default build``)::

    python bench/default_labels_curve.py --toxicchat runs/cache/toxicchat-all \\
        --cache-root runs/default-cache --data-root ../shared/data

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import torch

from probes import Probe, build_probe
from probes.budget import flag_margin
from probes.decision import decide
from probes.metrics import average_precision
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import predict_dataset
from probes.offline.select import held_out
from probes.targets import encode_target
from schemas import OperatingPoint, ProbeSpec
from worker.defaults import find_default
from worker.learning.config import LearningConfig
from worker.learning.online_learner import OnlineLearner
from worker.learning.resume import default_spec
from worker.offline.default_probe import load_source
from worker.offline.default_recipe import SOURCES
from worker.offline.default_recipe import default_spec as default_probe_spec
from worker.offline.fit_eval import load_split

from _shared import log

POINTS = (0, 100, 300, 1000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toxicchat", type=Path, required=True, help="ToxicChat's cache")
    p.add_argument("--cache-root", type=Path, required=True, help="the recipe's caches")
    p.add_argument("--data-root", type=Path, default=Path("../shared/data"))
    p.add_argument("--batch", type=int, default=16, help="labels per updater batch (16)")
    p.add_argument(
        "--seed", type=int, default=0, help="order of the label stream and the dropout's draws"
    )
    p.add_argument(
        "--operating-point",
        default=str(LearningConfig().operating_point),
        help="where the updater puts flag thresholds at each publish "
        "(PROBEGUARD_OPERATING_POINT; default: the updater's, %(default)s)",
    )
    return p.parse_args(argv)


def _figures(probe: Probe, tc: ProbeDataset, benign_chat: ProbeDataset) -> dict[str, float]:
    spec = probe.spec
    probs = predict_dataset(probe, tc)
    y = (tc.targets == 1).numpy()  # relabeled: 0 non-toxic, 1 toxic
    flag_cols = [spec.labels.index(x) for x in spec.flag_labels]
    margin = flag_margin(
        probs[:, flag_cols], [spec.thresholds.get(x, 0.5) for x in spec.flag_labels]
    )
    flagged = decide(spec, probs).flagged.numpy()
    chat = decide(spec, predict_dataset(probe, benign_chat)).flagged
    return {
        "toxicity_auprc": round(
            average_precision(y, probs[:, spec.labels.index("toxic")].numpy()), 4
        ),
        "policy_auprc": round(average_precision(y, margin.numpy()), 4),
        "toxicchat_benign_flagged": round(float(flagged[~y].mean()), 4),
        "toxicchat_toxic_flagged": round(float(flagged[y].mean()), 4),
        "convabuse_benign_flagged": round(float(chat.float().mean()), 4),
    }


def _states(data: ProbeDataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [L, B, T, D], mask [B, T])`` of rows ``idx``, as the updater's extractor
    gives them. Per-layer mean summaries come as one token each: a mean over one token is
    the summary itself, so a mean-pool probe learns exactly what it would from the tokens
    (the cache stores every layer's summary, and tokens of eight layers only)."""
    hidden, mask, _ = data.batch(idx)
    if mask is None:  # summaries [L, B, D]
        return hidden[:, :, None, :], torch.ones(hidden.shape[1], 1, dtype=torch.bool)
    return hidden, mask


def run(
    name: str,
    probe: Probe,
    fresh: bool,
    stream: ProbeDataset,
    test: ProbeDataset,
    chat: ProbeDataset,
    batch: int,
    config: LearningConfig,
) -> list[dict[str, Any]]:
    """Learn ``stream`` label by label as the updater does; figures at each of POINTS."""
    spec = probe.spec
    learner = OnlineLearner(probe, config, fresh=fresh)
    names = ["toxic" if t == 1 else "non-toxic" for t in stream.targets.tolist()]
    encoded = [encode_target(spec, [n]) for n in names]
    points = [p for p in POINTS if p <= len(stream)] + [len(stream)]
    rows, seen = [], 0
    t0 = time.time()
    for stop in points:
        while seen < stop:
            idx = torch.arange(seen, min(stop, seen + batch))
            hidden, mask = _states(stream, idx)
            targets = torch.stack([encoded[i][0] for i in idx.tolist()])
            learner.learn(hidden, mask, targets, [encoded[i][1] for i in idx.tolist()])
            seen += len(idx)
        published = copy.deepcopy(learner)  # calibrate() moves thresholds: on a copy
        published.calibrate()
        probe_now = published.publishable().eval()
        figures = {"labels": stop, **_figures(probe_now, test, chat)}
        rows.append(figures)
        log(f"{name} after {stop} labels ({time.time() - t0:.0f} s): {figures}")
    return rows


def replace_spec(spec: ProbeSpec) -> ProbeSpec:
    """The default's heads over ``spec``'s pool and layers (ConvAbuse's rows are read
    through the recipe, whose targets name the default's heads)."""
    return default_probe_spec(spec.hidden_size, list(spec.layers), pool=spec.token_pool)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        point = OperatingPoint.parse(args.operating_point)
    except ValueError as exc:
        raise SystemExit(f"--operating-point: {exc}") from exc
    config = LearningConfig(operating_point=point)
    started = time.time()
    cache = HiddenStateCache(args.toxicchat)
    llm = cache.manifest.llm
    default = find_default(llm, "moderation")
    if default is None:
        raise SystemExit("this release ships no packaged default for the cache's LLM")
    zero = default_spec("toxicity", llm.num_layers, llm.hidden_size)
    missing = sorted(set(zero.layers) - set(cache.manifest.token_layers))
    if missing:  # the from-zero probe weighs tokens: a summaries-only cache cannot serve it
        raise SystemExit(
            f"{args.toxicchat} stores token-level states for layers "
            f"{cache.manifest.token_layers}, the from-zero probe reads {zero.layers}: build it "
            "with `probeguard cache build` and the default --token-layers auto"
        )
    convabuse = next(s for s in SOURCES if s.dataset == "convabuse")
    curves = {}
    for name, probe, fresh in (
        ("from the default", default.probe, False),
        ("from zero", build_probe(zero, seed=0), True),
    ):
        spec = probe.spec
        data = load_split(cache, spec.token_pool, list(spec.layers), "label")
        data = data.relabel(["non-toxic", "toxic"])
        test_rows = held_out(data.ids, 0.3)
        g = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(int((~test_rows).sum()), generator=g)
        stream = data.subset((~test_rows).nonzero().flatten()[order])
        test = data.subset(test_rows.nonzero().flatten())
        chat_spec = replace_spec(spec)
        held = load_source(convabuse, chat_spec, args.cache_root, args.data_root, None)
        held = held.part("held_out")
        chat = held.data.subset(
            torch.tensor([i for i, r in enumerate(held.roles) if r == "benign"])
        )
        log(f"{name}: {len(stream)} labels to learn, {len(test)} held-out ToxicChat rows, "
            f"{len(chat)} held-out ConvAbuse benign turns")  # fmt: skip
        torch.manual_seed(args.seed)  # the probe's dropout while it learns: one run repeats
        curves[name] = run(name, probe, fresh, stream, test, chat, args.batch, config)
    cols = [
        "toxicity_auprc",
        "policy_auprc",
        "toxicchat_benign_flagged",
        "convabuse_benign_flagged",
    ]
    print(f"{'start':<18}{'labels':>8}" + "".join(f"{c:>26}" for c in cols))
    for name, rows in curves.items():
        for r in rows:
            print(f"{name:<18}{r['labels']:>8}" + "".join(f"{r[c]:>26}" for c in cols))
    print(json.dumps({"question": "labels-to-quality: the updater from the default vs from zero",
                      "operating_point": str(point), "curves": curves,
                      "seconds": round(time.time() - started, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
