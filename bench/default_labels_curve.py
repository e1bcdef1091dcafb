"""What does the packaged default become with the deployment's own labels, against the same
updater learning from zero?

The updater's learning core (:class:`worker.learning.online_learner.OnlineLearner`, with the
updater's default settings: test then train, Lion, replay, calibration and thresholds on
the prequential window at every publish) learns ToxicChat labels in a fixed shuffled
order, starting (a) from the packaged default as ``probeguard train`` fine-tunes it with
nothing published (given an attention pool: ``PROBEGUARD_DEFAULT_ATTENTION``), (b) from the
default's mean pool as shipped (``PROBEGUARD_DEFAULT_ATTENTION=false``) and (c) from zero
(``PROBEGUARD_DEFAULT_PROBE=false``: the updater's from-zero probe). After 0, 100, 300,
1,000 and all of the stream's labels, the probe it would publish is measured on ToxicChat
rows held out by id hash (``probes.offline.select.held_out``, 30 %, as
``bench/quality.py``): the toxicity head's AUPRC, the flag policy's AUPRC and the share of
held-out non-toxic prompts it flags; the share of the recipe's held-out ConvAbuse
non-abusive turns it flags (benign chat the deployment never labeled: does learning
ToxicChat cost ordinary chat?) and of its held-out unsafe prompts (AILuminate,
SimpleSafetyTests: do the heads no ToxicChat label reaches go on flagging them?); and the
replay buffer's size at the end (the updater's memory: token states for the probes that
weigh tokens).

Those weigh tokens of every layer the default reads: ToxicChat's cache is built with
``--token-layers 0-30`` (SmolLM2's 31 layers); the recipe's held-out sets are cached (every
layer's tokens and summaries) under ``--cache-root`` on the first run (the LLM loads; two
minutes). Example::

    probeguard cache build --data toxicchat-all.jsonl --out runs/cache/toxicchat-all \\
        --token-layers 0-30 --summaries mean
    python bench/default_labels_curve.py --toxicchat runs/cache/toxicchat-all \\
        --cache-root runs/labels-curve-cache --data-root ../shared/data

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import functools
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
from worker.learning.resume import default_spec, given_attention
from worker.llm.extract import HiddenStateExtractor
from worker.offline.default_probe import load_source
from worker.offline.default_recipe import SOURCES
from worker.offline.default_recipe import default_spec as default_probe_spec
from worker.offline.fit_eval import load_split
from worker.settings import Settings

from _shared import log, updater_states

POINTS = (0, 100, 300, 1000)
# Sets of unsafe prompts only: what the heads no ToxicChat label reaches must go on flagging.
UNSAFE_PROMPTS = ("ailuminate_demo", "simplesafetytests")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toxicchat", type=Path, required=True, help="ToxicChat's cache")
    p.add_argument(
        "--cache-root",
        type=Path,
        required=True,
        help="where the recipe's held-out sets are cached (every layer's tokens; built there "
        "on the first run)",
    )
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


def _figures(
    probe: Probe, tc: ProbeDataset, flag_only: dict[str, ProbeDataset]
) -> dict[str, float]:
    """ToxicChat's held-out figures, and the share of each of ``flag_only``'s rows flagged."""
    spec = probe.spec
    probs = predict_dataset(probe, tc)
    y = (tc.targets == 1).numpy()  # relabeled: 0 non-toxic, 1 toxic
    flag_cols = [spec.labels.index(x) for x in spec.flag_labels]
    margin = flag_margin(
        probs[:, flag_cols], [spec.thresholds.get(x, 0.5) for x in spec.flag_labels]
    )
    flagged = decide(spec, probs).flagged.numpy()
    return {
        "toxicity_auprc": round(
            average_precision(y, probs[:, spec.labels.index("toxic")].numpy()), 4
        ),
        "policy_auprc": round(average_precision(y, margin.numpy()), 4),
        "toxicchat_benign_flagged": round(float(flagged[~y].mean()), 4),
        "toxicchat_toxic_flagged": round(float(flagged[y].mean()), 4),
        **{
            f"{name}_flagged": round(
                float(decide(spec, predict_dataset(probe, rows)).flagged.float().mean()), 4
            )
            for name, rows in flag_only.items()
        },
    }


def run(
    name: str,
    probe: Probe,
    fresh: bool,
    stream: ProbeDataset,
    test: ProbeDataset,
    flag_only: dict[str, ProbeDataset],
    batch: int,
    config: LearningConfig,
) -> tuple[list[dict[str, Any]], OnlineLearner]:
    """Learn ``stream`` label by label as the updater does; figures at each of POINTS,
    and the learner at the end."""
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
            hidden, mask = updater_states(stream, idx)
            targets = torch.stack([encoded[i][0] for i in idx.tolist()])
            learner.learn(hidden, mask, targets, [encoded[i][1] for i in idx.tolist()])
            seen += len(idx)
        published = copy.deepcopy(learner)  # calibrate() moves thresholds: on a copy
        published.calibrate()
        probe_now = published.publishable().eval()
        figures = {"labels": stop, **_figures(probe_now, test, flag_only)}
        rows.append(figures)
        log(f"{name} after {stop} labels ({time.time() - t0:.0f} s): {figures}")
    return rows, learner


def replace_spec(spec: ProbeSpec) -> ProbeSpec:
    """The default's heads over ``spec``'s pool and layers (ConvAbuse's rows are read
    through the recipe, whose targets name the default's heads)."""
    return default_probe_spec(spec.hidden_size, list(spec.layers), pool=spec.token_pool)


@functools.cache
def _extractor() -> HiddenStateExtractor:
    return HiddenStateExtractor.from_settings(Settings())


def held_rows(dataset: str, role: str, spec: ProbeSpec, args: argparse.Namespace) -> ProbeDataset:
    """The recipe's held-out rows of ``dataset`` in ``role`` (``benign``, ``unsafe``), as
    ``spec`` reads them, from a cache of every layer's tokens and summaries under
    ``CACHE_ROOT`` (built there on the first run: the default reads every layer, the
    probes that weigh tokens need them token by token)."""
    source = next(s for s in SOURCES if s.dataset == dataset)
    extractor = None
    if not (args.cache_root / dataset / "manifest.json").is_file():
        log(f"building {dataset}'s cache of every layer's tokens under {args.cache_root}")
        extractor = _extractor()
    every = list(range(spec.layers[-1] + 1))
    loaded = load_source(
        source, replace_spec(spec), args.cache_root, args.data_root, extractor, token_layers=every
    )
    held = loaded.part("held_out")
    return held.data.subset(torch.tensor([i for i, r in enumerate(held.roles) if r == role]))


def replay_mb(learner: OnlineLearner) -> float:
    """The replay buffer's tensors, MB (what the updater holds beside the probe)."""
    return sum(e.x.nbytes for bucket in learner.replay.buckets for e in bucket) / 2**20


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
    zero = build_probe(default_spec("toxicity", llm.num_layers, llm.hidden_size), seed=0)
    starts = (
        ("from the default", given_attention(default.probe), False),
        ("default, mean pool", default.probe, False),
        ("from zero", zero, True),
    )
    for name, probe, _ in starts:
        missing = sorted(set(probe.layers) - set(cache.manifest.token_layers))
        if missing and not probe.separable:  # it weighs tokens: summaries cannot serve it
            raise SystemExit(
                f"{args.toxicchat} stores token-level states for layers "
                f"{cache.manifest.token_layers}, {name!r} reads {list(probe.layers)}: build "
                "it with `probeguard cache build --token-layers 0-30` (SmolLM2's layers)"
            )
    curves, memory = {}, {}
    for name, probe, fresh in starts:
        spec = probe.spec
        data = load_split(cache, spec.token_pool, list(spec.layers), "label")
        data = data.relabel(["non-toxic", "toxic"])
        test_rows = held_out(data.ids, 0.3)
        g = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(int((~test_rows).sum()), generator=g)
        stream = data.subset((~test_rows).nonzero().flatten()[order])
        test = data.subset(test_rows.nonzero().flatten())
        flag_only = {
            "convabuse_benign": held_rows("convabuse", "benign", spec, args),
            "unsafe_prompts": ProbeDataset.concat(
                [held_rows(d, "unsafe", spec, args) for d in UNSAFE_PROMPTS]
            ),
        }
        log(
            f"{name}: {len(stream)} labels to learn, {len(test)} held-out ToxicChat rows, "
            + ", ".join(f"{len(v)} held-out {k}" for k, v in flag_only.items())
        )
        torch.manual_seed(args.seed)  # the probe's dropout while it learns: one run repeats
        curves[name], learner = run(name, probe, fresh, stream, test, flag_only, args.batch, config)
        memory[name] = {
            "replay_mb": round(replay_mb(learner), 1),
            "probe_parameters": sum(p.numel() for p in learner.probe.parameters()),
        }
    cols = [
        "toxicity_auprc",
        "policy_auprc",
        "toxicchat_benign_flagged",
        "convabuse_benign_flagged",
        "unsafe_prompts_flagged",
    ]
    for name, m in memory.items():
        print(f"{name}: replay {m['replay_mb']} MB, {m['probe_parameters']:,} parameters")
    print(f"{'start':<20}{'labels':>8}" + "".join(f"{c:>26}" for c in cols))
    for name, rows in curves.items():
        for r in rows:
            print(f"{name:<20}{r['labels']:>8}" + "".join(f"{r[c]:>26}" for c in cols))
    print(json.dumps({"question": "labels-to-quality: the updater from the default vs from zero",
                      "operating_point": str(point), "curves": curves, "memory": memory,
                      "seconds": round(time.time() - started, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
