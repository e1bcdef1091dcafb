"""Online (the updater, through Kafka) vs offline (``fit``) on the same labeled data.

Question: does the probe a user gets from the updater's defaults, learned online from
zero out of a stream of human labels, end as good as the probe ``probeguard fit`` makes
offline from the same labels? Both are the default kind (``default_spec``: downcast MHA
over 8 spread layers) and are scored on the same held-out rows, which neither saw.

One run on the embedded broker and Redis:

1. Data: the rows of every ``--data`` file whose id hashes into ``--holdout-share`` (0.3,
   ``probes.offline.select.held_out``, as in ``bench/quality.py``) are held out; the rest are the
   training labels. Hidden states come from caches under ``--cache-root`` (built with the
   configured LLM when missing; the same caches as ``bench/quality.py``).
2. Offline: ``fit``'s default selection (``probes.offline.select.fit_cv``, 5 folds) on the training
   rows, then a refit on all of them.
3. Online: every training row becomes a ``HumanLabel`` (with its text) on the labels topic,
   in file order; one ``Updater`` with default settings learns from the stream (test then
   train, publishing versions, thresholds calibrated on its prequential window). Its
   extractor serves the cached hidden states of the label's text instead of running the
   LLM a second time: Kafka, Redis, the updater and its learning are the real ones.
4. Both probes score the held-out rows: each at its own thresholds (offline: chosen out of
   fold; online: calibrated by the updater, never on held-out rows), and both at arg-max.

Prints the prequential F1 curve (per published version) and the final figures; the last
line is one JSON object.

Example (about 30 min on 2 busy cores once the caches exist)::

    D=../shared/data/toxicchat
    python bench/online_vs_offline.py --data $D/train.jsonl --data $D/validation.jsonl \\
        --cache-root runs/cache
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from probes.offline.dataset import ProbeDataset
from schemas import LLMFingerprint
from worker.llm.extract import Extraction

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import cache_for  # bench/quality.py: the cache of a data file

from _shared import log

TARGET_GAP_F1_POINTS = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, action="append", required=True, help="labeled JSONL")
    p.add_argument("--holdout-share", type=float, default=0.3, help="held out by id hash (0.3)")
    p.add_argument("--cache-root", type=Path, default=Path("runs/cache"))
    p.add_argument("--folds", type=int, default=5, help="offline cross-validation folds (5)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N training rows")
    return p.parse_args(argv)


class CachedExtractor:
    """The LLM's hidden states of known texts, from a cache: what the updater's
    ``extract`` would compute, without a second forward pass."""

    def __init__(self, data: ProbeDataset, texts: list[str], fp: LLMFingerprint) -> None:
        self.data = data  # token-level, rows aligned with `texts`
        self.row = {t: i for i, t in enumerate(texts)}
        self._fp = fp

    @property
    def fingerprint(self) -> LLMFingerprint:
        return self._fp

    @property
    def num_layers(self) -> int:
        return self._fp.num_layers

    @property
    def hidden_size(self) -> int:
        return self._fp.hidden_size

    @property
    def model_type(self) -> str:
        return ""  # the updater's replay dtype is the cache's (Settings.state_dtype, below)

    def extract(self, texts: Sequence[str], layers: Sequence[int]) -> Extraction:
        index = [b for b, t in enumerate(texts) if t in self.row]
        errors = {
            b: "unknown_text: not in the cache" for b, t in enumerate(texts) if b not in index
        }
        pick = torch.tensor([self.data.layers.index(i) for i in layers])
        rows = torch.tensor([self.row[texts[b]] for b in index], dtype=torch.int64)
        hidden, mask, _ = self.data.batch(rows)
        assert mask is not None
        return Extraction(hidden[pick], mask, tuple(layers), index, errors)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from probes.metrics import evaluate
    from probes.offline.fit import FitConfig, predict_dataset
    from probes.offline.select import fit_cv, held_out
    from schemas import HumanLabel, utcnow
    from worker.embedded import EmbeddedBroker, EmbeddedRedis
    from worker.kafka.clients import ensure_topics, make_producer
    from worker.learning.updater import Updater, default_spec
    from worker.offline.fit_eval import load_split
    from worker.offline.labeled import read_labeled
    from worker.settings import Settings
    from worker.store.redis import make_redis

    caches = [cache_for(p, args.cache_root) for p in args.data]
    fp = caches[0].manifest.llm
    spec = default_spec("toxicity", fp.num_layers, fp.hidden_size)
    parts = [load_split(c, spec.token_pool, list(spec.layers), "label") for c in caches]
    data = ProbeDataset.concat([p.relabel(list(spec.labels)) for p in parts])
    texts = {r.id: r.text[:32_000] for p in args.data for r in read_labeled(p)}
    mask = held_out(data.ids, args.holdout_share)
    train = data.subset((~mask).nonzero().flatten())
    test = data.subset(mask.nonzero().flatten())
    if args.limit:
        train = train.subset(torch.arange(min(args.limit, len(train))))
    log(f"{len(train)} training labels, {len(test)} held-out rows; probe {spec.token_pool} "
        f"over layers {spec.layers}")  # fmt: skip

    log(f"offline: fit with {args.folds}-fold cross-validation …")
    t0 = time.perf_counter()
    result, cv = fit_cv(spec, train, FitConfig(), folds=args.folds)
    offline_s = time.perf_counter() - t0
    off_probs = predict_dataset(result.probe, test)
    off_rep = evaluate(result.probe.spec, off_probs, test.targets)
    off_argmax = evaluate(spec.model_copy(update={"thresholds": {}}), off_probs, test.targets)

    extractor = CachedExtractor(train, [texts[i] for i in train.ids], fp)
    with EmbeddedBroker() as broker, EmbeddedRedis() as redis_server:
        settings = Settings(
            kafka_bootstrap=broker.bootstrap,
            redis_url=redis_server.url,
            redis_prefix=f"bench-{uuid.uuid4().hex[:6]}",
            metrics_port=0,
            state_dtype=caches[0].manifest.dtype,
        )
        log(f"online: {len(train)} labels through Kafka into the updater …")
        ensure_topics(settings)
        updater = Updater(settings, extractor, make_redis(settings), worker_id="bench-updater")  # type: ignore[arg-type]
        thread = threading.Thread(target=updater.run, daemon=True)
        thread.start()
        producer = make_producer(settings)
        label_of = {i: train.labels[int(y)] for i, y in zip(train.ids, train.targets, strict=True)}
        for row_id in train.ids:
            label = HumanLabel(
                message_id=f"m-{row_id}"[:120].replace(" ", "_"),
                label=label_of[row_id],
                labeler_id="bench",
                created_at=utcnow(),
                text=texts[row_id],
            )
            producer.send(settings.topic_labels, value=label.encode())
        producer.flush(60)
        producer.close()
        t0 = last = time.perf_counter()
        while updater.labels_seen < len(train) or updater.unpublished:
            time.sleep(1.0)
            if time.perf_counter() - last > 30:
                last = time.perf_counter()
                log(f"  online: {updater.labels_seen}/{len(train)} labels learned")
            if time.perf_counter() - t0 > 7200:
                raise SystemExit("online learning did not finish in 2 hours")
        online_s = time.perf_counter() - t0
        manifests = [updater.registry.manifest(v) for v in updater.registry.versions()]
        curve = [(m.counters.labels_seen, m.metrics.get("prequential_f1")) for m in manifests]
        entropy = [m.metrics.get("layer_entropy") for m in manifests]
        online = updater.learner.probe if updater.learner else None
        if online is None:
            raise SystemExit("the updater never started learning")
        on_probs = predict_dataset(online, test)
        on_rep = evaluate(online.spec, on_probs, test.targets)
        on_argmax = evaluate(
            online.spec.model_copy(update={"thresholds": {}}), on_probs, test.targets
        )
        updater.stop()
        thread.join(60)

    print(f"{'held-out':28}{'F1':>8}{'AUPRC':>8}")
    print(f"{'offline (CV thresholds)':28}{off_rep['f1']:>8.3f}{off_rep['auprc']:>8.3f}")
    print(f"{'offline (argmax)':28}{off_argmax['f1']:>8.3f}{off_argmax['auprc']:>8.3f}")
    print(f"{'online (own thresholds)':28}{on_rep['f1']:>8.3f}{on_rep['auprc']:>8.3f}")
    print(f"{'online (argmax)':28}{on_argmax['f1']:>8.3f}{on_argmax['auprc']:>8.3f}")
    print(
        "prequential F1 by labels seen: "
        + ", ".join(f"{n}:{f:.3f}" for n, f in curve if f is not None)
    )
    gap = 100 * (off_rep["f1"] - on_rep["f1"])
    out = {
        "bench": "online_vs_offline",
        "llm": fp.model_id,
        "llm_digest": fp.digest,
        "train_rows": len(train),
        "test_rows": len(test),
        "layers": spec.layers,
        "pool": spec.token_pool,
        "offline_fit_s": round(offline_s, 1),
        "online_s": round(online_s, 1),
        "offline": {
            "f1": round(off_rep["f1"], 4),
            "auprc": round(off_rep["auprc"], 4),
            "f1_argmax": round(off_argmax["f1"], 4),
            "cv": {k: round(v, 4) for k, v in cv.summary().items()},
        },
        "online": {
            "f1": round(on_rep["f1"], 4),
            "auprc": round(on_rep["auprc"], 4),
            "f1_argmax": round(on_argmax["f1"], 4),
            "thresholds": online.spec.thresholds,
            "versions": len(curve),
            "layer_entropy_min": round(min(e for e in entropy if e is not None), 3),
        },
        "gap_f1_points": round(gap, 2),
        "target_gap_f1_points_max": TARGET_GAP_F1_POINTS,
        "prequential_curve": [[n, round(f, 4)] for n, f in curve if f is not None],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
