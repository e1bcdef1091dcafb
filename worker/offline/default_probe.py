"""The packaged default probe: one multi-head probe trained on public labeled data, so a
deployment moderates on day one and learns from its own moderators from there.

::

    probeguard default build --data-root ../shared/data            # the Apache-2.0 default
    probeguard default build --data-root ../shared/data --noncommercial   # + ToxicChat

The recipe is data: :data:`HEADS` (the taxonomy, named after OpenAI's moderation
categories where the data has them) and :data:`SOURCES` (which dataset annotates which
heads, under which license). Every source's ``train.jsonl`` is split by a hash of the row
id into train (70 %), validation (10 %: early stopping and thresholds) and held-out (20 %:
the numbers in the data card, which no choice saw). The shipped probe is exactly the one
measured. Sources under a non-commercial license go in only with ``--noncommercial``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from probes import build_probe, load_checkpoint, save_checkpoint
from probes.files import atomic_write
from probes.metrics import evaluate
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, drift_reference, fit, predict_dataset
from probes.offline.multitask import SourceHeads, as_multitask, multitask_targets
from schemas import CheckpointManifest, HeadSpec, ProbeSpec, TrainingCounters
from worker.errors import OfflineError
from worker.offline.build_cache import ExtractorLike, build_cache, default_token_layers
from worker.offline.fit_eval import load_split

__all__ = [
    "CATEGORIES",
    "FLAG_LABELS",
    "HEADS",
    "SOURCES",
    "BuildResult",
    "Source",
    "build_default",
    "default_spec",
    "split_of",
]

log = logging.getLogger(__name__)
NAME = "moderation"
SALT = "probeguard-default-v1"

# OpenAI's moderation categories: (head name, label = the category's own name).
CATEGORIES = [
    ("sexual", "sexual"),
    ("hate", "hate"),
    ("harassment", "harassment"),
    ("violence", "violence"),
    ("self-harm", "self-harm"),
    ("sexual-minors", "sexual/minors"),
    ("hate-threatening", "hate/threatening"),
    ("violence-graphic", "violence/graphic"),
]
_OPENAI = [label for _, label in CATEGORIES]

# The taxonomy: OpenAI's moderation categories (each a binary head whose label is the
# category's own name, so scores read as OpenAI's category_scores), toxicity as a
# two-class head (the labels single-head deployments already send), offensive language,
# unsafe requests, and jailbreaks (only the non-commercial build has data for it).
HEADS: list[HeadSpec] = [
    HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
    *(HeadSpec(name=h, task="multilabel", labels=[label]) for h, label in CATEGORIES),
    HeadSpec(name="offensive", task="multilabel", labels=["offensive"]),
    HeadSpec(name="unsafe", task="multilabel", labels=["unsafe"]),
    HeadSpec(name="jailbreak", task="multilabel", labels=["jailbreaking"]),
]
# What flags a verdict by default (a deployment narrows it with PROBEGUARD_FLAG_HEADS):
# toxicity, every OpenAI category and unsafe requests; offensive language (profanity in
# tweets) scores but does not flag.
FLAG_LABELS = ["toxic", *_OPENAI, "unsafe", "jailbreaking"]


@dataclass(frozen=True)
class Source:
    """One dataset of the recipe: where its rows go and why it may be used."""

    dataset: str  # folder under the data root; its train.jsonl is read
    license: str
    why_shippable: str
    heads: Mapping[str, Mapping[str, Sequence[str]]]
    noncommercial: bool = False
    # Keep at most this many rows of a label (the first by a hash of the id), e.g. to keep
    # one large, lopsided source from drowning the others.
    cap: Mapping[str, int] = field(default_factory=dict)

    @property
    def source_heads(self) -> SourceHeads:
        return SourceHeads(self.dataset, self.heads)


def _categories() -> dict[str, dict[str, list[str]]]:
    # A row annotates every category: its own labels are its positives (a category key
    # missing from OpenAI's source row is not recoverable from the converted file, so
    # "not flagged in this category" is taken as a negative there).
    return {h: {label: [label], "flagged": [], "not-flagged": []} for h, label in CATEGORIES}


SOURCES: list[Source] = [
    Source(
        "openai_moderation",
        "MIT (Copyright (c) 2022 OpenAI)",
        "MIT allows use, modification and distribution, weights included, with the notice.",
        {"toxicity": {"flagged": ["toxic"], "not-flagged": ["non-toxic"]}, **_categories()},
    ),
    Source(
        "xstest",
        "CC-BY-4.0",
        "CC-BY-4.0 allows any use, commercial included, with attribution (this card).",
        {
            "unsafe": {"unsafe": ["unsafe"], "safe": []},
            "toxicity": {"unsafe": ["toxic"], "safe": ["non-toxic"]},
        },
    ),
    Source(
        "davidson_hate_offensive",
        "MIT (Copyright (c) 2017 Tom Davidson)",
        "MIT allows use, modification and distribution, weights included, with the notice.",
        {
            "offensive": {
                "hate_speech": ["offensive"],
                "offensive_language": ["offensive"],
                "neither": [],
            },
            "toxicity": {
                "hate_speech": ["toxic"],
                "offensive_language": ["toxic"],
                "neither": ["non-toxic"],
            },
        },
        # 77.6 % of its rows are offensive_language: keep every other row and 1,800 of those.
        cap={"offensive_language": 1800},
    ),
    Source(
        "toxicchat",
        "CC-BY-NC-4.0",
        "Non-commercial only: never in the Apache-2.0 default; built with --noncommercial.",
        {
            "toxicity": {"toxic": ["toxic"], "non-toxic": ["non-toxic"]},
            "jailbreak": {"jailbreaking": ["jailbreaking"], "toxic": [], "non-toxic": []},
        },
        noncommercial=True,
    ),
]


def default_spec(
    hidden_size: int, layers: list[int], *, noncommercial: bool = False, name: str = NAME
) -> ProbeSpec:
    """The default's spec: MHA pooling, scalar mix over ``layers``, the heads the chosen
    sources annotate (``jailbreak`` only with the non-commercial data)."""
    heads = [h for h in HEADS if noncommercial or h.name != "jailbreak"]
    labels = [x for h in heads for x in h.labels]
    return ProbeSpec(
        name=name,
        token_pool="mha",
        layer_mix="scalar_mix",
        layers=layers,
        hidden_size=hidden_size,
        task="multilabel",
        labels=labels,
        heads=heads,
        flag_labels=[x for x in FLAG_LABELS if x in labels],
        dropout=0.1,
    )


def split_of(row_id: str) -> str:
    """``train`` (70 %), ``validation`` (10 %) or ``held_out`` (20 %), by a hash of the id."""
    b = int.from_bytes(hashlib.sha256(f"{SALT}\n{row_id}".encode()).digest()[:8], "big") % 10
    return "held_out" if b < 2 else "validation" if b == 2 else "train"


def _source_file(source: Source, data_root: Path, cache_root: Path) -> Path:
    path = data_root / source.dataset / "train.jsonl"
    if not path.is_file():
        raise OfflineError(f"{path} not found: --data-root must hold {source.dataset}/train.jsonl")
    if not source.cap:
        return path
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    order = sorted(rows, key=lambda r: hashlib.sha256(f"{SALT}\n{r['id']}".encode()).digest()[:8])
    keep: set[str] = set()
    taken: dict[str, int] = {}
    for r in order:
        cap = source.cap.get(r["label"])
        if cap is None or taken.get(r["label"], 0) < cap:
            keep.add(r["id"])
            taken[r["label"]] = taken.get(r["label"], 0) + 1
    out = cache_root / "sources" / f"{source.dataset}.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows if r["id"] in keep)
    if not out.exists() or out.read_text() != text:
        atomic_write(out, text)  # owner-only: the texts of the capped source
    return out


def _load(
    source: Source,
    spec: ProbeSpec,
    cache_root: Path,
    data_root: Path,
    extractor: ExtractorLike,
    key: bytes | None,
) -> ProbeDataset:
    directory = cache_root / source.dataset
    build_cache(_source_file(source, data_root, cache_root), directory, extractor, key=key)
    cache = HiddenStateCache(directory, key=key)
    data = load_split(cache, spec.token_pool, list(spec.layers), "label")
    targets = multitask_targets(spec, source.source_heads, cache.row_labels())
    return as_multitask(data, spec, targets)


def _part(data: ProbeDataset, split: str) -> ProbeDataset:
    return data.subset(torch.tensor([i for i, r in enumerate(data.ids) if split_of(r) == split]))


@dataclass
class BuildResult:
    """What ``build`` wrote: the checkpoint directory and its data card."""

    directory: Path
    card: dict[str, Any]


def _held_out_report(spec: ProbeSpec, probs: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    report = evaluate(spec, probs, y)
    heads = {}
    for name, r in report["heads"].items():
        view = spec.head_view(name)
        flag = view.flag_labels or view.labels[-1:]
        m = r["flagged"] if "flagged" in r else r["per_class"][flag[0]]
        heads[name] = {
            "rows": r["n"],
            "positives": m["support"],
            "f1": _rounded(m["f1"]),
            "auprc": _rounded(m["auprc"]),
            "recall_at_1pct_fpr": _rounded(m["recall_at_1pct_fpr"]),
        }
    return heads


def _rounded(x: float) -> float | None:
    """JSON has no NaN: an undefined figure (no positives, or no negatives) is null."""
    return round(x, 4) if x == x else None


def build_default(
    data_root: Path,
    out: Path,
    extractor: ExtractorLike,
    *,
    cache_root: Path,
    noncommercial: bool = False,
    config: FitConfig = FitConfig(max_epochs=25, patience=5),
    key: bytes | None = None,
) -> BuildResult:
    """Build caches for the recipe's sources (resuming; encrypted with ``key`` when given),
    fit the multi-head default with a fixed seed, measure it per source on the held-out
    rows, and write it to ``out`` (``manifest.json``, ``tensors.safetensors``,
    ``card.json``)."""
    started = time.time()
    sources = [s for s in SOURCES if noncommercial or not s.noncommercial]
    layers = default_token_layers(extractor.num_layers)
    hidden_size = extractor.fingerprint.hidden_size
    spec = default_spec(hidden_size, layers, noncommercial=noncommercial)
    loaded = {s.dataset: _load(s, spec, cache_root, data_root, extractor, key) for s in sources}
    train = ProbeDataset.concat([_part(d, "train") for d in loaded.values()])
    val = ProbeDataset.concat([_part(d, "validation") for d in loaded.values()])
    log.info("default: %d train rows, %d validation rows", len(train), len(val))
    result = fit(build_probe(spec, seed=config.seed), train, val, config, _progress)
    probe = result.probe
    measured = {}
    for s in sources:
        held = _part(loaded[s.dataset], "held_out")
        measured[s.dataset] = _held_out_report(
            probe.spec, predict_dataset(probe, held), held.targets
        )
    card = {
        "name": spec.name,
        "llm": extractor.fingerprint.model_id,
        "noncommercial": noncommercial,
        "license": "CC-BY-NC-4.0" if noncommercial else "Apache-2.0",
        "heads": [h.model_dump() for h in spec.heads],
        "flag_labels": probe.spec.flag_labels,
        "sources": [
            {
                "dataset": s.dataset,
                "license": s.license,
                "why": s.why_shippable,
                "heads": sorted(s.heads),
                "rows": {split: len(_part(loaded[s.dataset], split)) for split in _SPLITS},
            }
            for s in sources
        ],
        "fit": {
            "best_epoch": result.best_epoch,
            "epochs": result.epochs,
            "seconds": round(result.seconds, 1),
            "seed": config.seed,
        },
        "held_out": measured,
        "built_seconds": round(time.time() - started, 1),
    }
    counters = TrainingCounters(labels_seen=len(train), steps=result.steps)
    save_checkpoint(
        probe,
        out,
        llm=extractor.fingerprint,
        counters=counters,
        weights="fp32",
        drift=result.drift,  # what scorers compare live traffic with (drift monitoring)
    )
    atomic_write(out / "card.json", json.dumps(card, indent=1) + "\n")
    return BuildResult(out, card)


def refresh_drift(
    data_root: Path,
    directory: Path,
    extractor: ExtractorLike,
    *,
    cache_root: Path,
    key: bytes | None = None,
) -> CheckpointManifest:
    """Recompute a built default's drift statistics on its train rows (the caches of
    :func:`build_default`, built or resumed), keeping its weights and data card: for a
    default built before checkpoints carried them. Rewrites ``manifest.json``."""
    probe, manifest = load_checkpoint(directory, extractor.fingerprint)
    card = json.loads((directory / "card.json").read_text())
    sources = [s for s in SOURCES if card.get("noncommercial") or not s.noncommercial]
    spec = probe.spec
    train = ProbeDataset.concat(
        [_part(_load(s, spec, cache_root, data_root, extractor, key), "train") for s in sources]
    )
    drift = drift_reference(probe, train)
    updated = manifest.model_copy(update={"drift": drift})
    atomic_write(directory / "manifest.json", updated.encode())
    log.info("default %s: drift statistics of %d train rows", directory.name, len(train))
    return updated


_SPLITS = ("train", "validation", "held_out")


def _progress(row: dict[str, float]) -> None:
    log.info(
        "epoch %d: train loss %.4f, validation AUPRC %.4f",
        row["epoch"],
        row["train_loss"],
        row.get("val_auprc", float("nan")),
    )
