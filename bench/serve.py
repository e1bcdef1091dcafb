"""How fast does ``probeguard serve`` answer single-text requests, and how does its
throughput compare with the Kafka scorer's on the same texts?

One process, one LLM (the settings' default, SmolLM2-135M, loaded once with
:meth:`HiddenStateExtractor.from_settings`, so today's batching and autocast defaults),
the probe that serves by default (the packaged default, v0: nothing is published), Redis
(``--redis-url``, under a fresh key prefix removed at the end) and the embedded broker.
Both paths score on a thread of their own (torch's OpenMP threads behave differently on
the main thread; ``bench/serve.md``):

- ``serve``: a :class:`~worker.serve.server.ModerationServer` on a free loopback port (no
  API keys; the per-caller rate limit raised out of the way), scoring on its own thread as
  in ``probeguard serve``. A separate client process (so clients never hold the server's
  GIL) runs N closed-loop clients, each a thread with its own keep-alive connection
  (``httpx2``) sending ``POST /v1/moderations`` with ``{"input": text}``, one text per
  request, the next as soon as the answer is in. Per N in ``--clients``: a warm-up
  (``--warmup`` requests per client, not counted), then every text of the sample
  (``--passes`` times); p50/p99 of the client-side latency (send to parsed answer),
  requests/s (requests / first send to last answer) and, from the server's own histograms,
  the inputs per LLM pass (``probeguard_serve_batch_inputs``), the mean wait before a
  request's batch starts (``probeguard_serve_queue_seconds``) and the mean time of a pass
  (``probeguard_scorer_batch_seconds``).
- ``kafka``: the same texts, produced at once to a chat topic and scored by a
  :class:`~worker.scoring.scorer.Scorer` on the same extractor, on a thread as
  ``bench/score_e2e.py`` runs it (with its helpers): msg/s = messages / (last verdict -
  first produce).

``--rounds 2`` (the default) runs kafka, then serve at each N, then the same in reverse
order (ABBA), so load from other processes drifting during the run hits both alike;
requests/s and msg/s are averaged over rounds, percentiles taken over every request.
Ratio side by side: requests/s at the largest N / the Kafka backlog msg/s (and each
round's own). Targets (the serve issue): p99 <= 250 ms at 4 clients; throughput at 16
clients >= 80 % of the Kafka scorer's.

``--max-wait-ms`` and ``--max-batch`` set ``PROBEGUARD_SERVE_MAX_WAIT_MS`` /
``PROBEGUARD_SERVE_MAX_BATCH`` (default: the settings' defaults); comma lists measure every
combination in the same run, one server each, the first combination's figures being the
headline ones. The last line printed is one JSON object::

    PYTHONPATH=. python bench/serve.py --data ../shared/data/toxicchat/validation.jsonl
    PYTHONPATH=. python bench/serve.py --data ../shared/data/toxicchat/validation.jsonl \\
        --clients 4,16 --max-batch 32,4,1

Results: ``bench/serve.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _shared import load_average, log

TARGET_P99_MS = 250.0  # at 4 concurrent clients
TARGET_RATIO = 0.80  # requests/s at 16 clients / the Kafka scorer's backlog msg/s
BUCKETS = ("1.0", "2.0", "4.0", "8.0", "16.0", "32.0", "64.0", "128.0", "+Inf")
DATA = Path(__file__).resolve().parents[1] / "../shared/data/toxicchat/validation.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from worker.settings import Settings

    fields = Settings.model_fields
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--data", type=Path, default=DATA, help="JSONL with 'text' (default: %(default)s)"
    )
    p.add_argument("--limit", type=int, default=0, help="first N texts only (default: all)")
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="times each text is sent per round, per client count and to Kafka (%(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds; even ones run in reverse order (ABBA) (%(default)s)",
    )
    p.add_argument("--clients", default="1,4,16", help="concurrent clients (%(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="requests per client first (%(default)s)")
    p.add_argument(
        "--max-wait-ms",
        default=str(fields["serve_max_wait_ms"].default),
        help="PROBEGUARD_SERVE_MAX_WAIT_MS, comma list (default: the setting's, %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        default=str(fields["serve_max_batch"].default),
        help="PROBEGUARD_SERVE_MAX_BATCH, comma list (default: the setting's, %(default)s)",
    )
    p.add_argument(
        "--no-kafka", action="store_true", help="serve alone: skip the Kafka scorer's backlog"
    )
    p.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="Redis (default: %(default)s)"
    )
    return p.parse_args(argv)


# --- the clients (a process of their own) ------------------------------------------------


def _client_process(
    url: str, texts: list[str], clients: int, warmup: int, conn: Any
) -> None:  # pragma: no cover - runs in the child
    """Closed loop: ``clients`` threads, each one keep-alive connection, take the next
    text until all are sent; after ``warmup`` requests per client (not counted). Sends
    back ``(started, latency_s, status)`` per counted request."""
    import httpx2

    def run(items: list[str]) -> list[tuple[float, float, int]]:
        lock = threading.Lock()
        todo = iter(items)
        out: list[tuple[float, float, int]] = []

        def worker(http: Any) -> None:
            while True:
                with lock:
                    text = next(todo, None)
                if text is None:
                    return
                t0 = time.perf_counter()
                r = http.post("/v1/moderations", json={"input": text})
                if r.status_code == 200:
                    r.json()["results"][0]["flagged"]  # parsed, as a client would
                latency = time.perf_counter() - t0
                with lock:
                    out.append((t0, latency, r.status_code))

        threads = [threading.Thread(target=worker, args=(h,)) for h in https]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    https = [httpx2.Client(base_url=url, timeout=120) for _ in range(clients)]
    run([texts[-1 - (i % len(texts))] for i in range(warmup * clients)])
    conn.send("warm")
    conn.recv()  # the server's counters are read; go
    conn.send(run(texts))
    for h in https:
        h.close()


def _sample(service: Any) -> dict[str, float]:
    """The server's histograms' counts and sums now."""
    get = service.collector.get_sample_value
    out = {}
    for name in (
        "probeguard_serve_batch_inputs",
        "probeguard_serve_queue_seconds",
        "probeguard_scorer_batch_seconds",
    ):
        for part in ("count", "sum"):
            out[f"{name}_{part}"] = get(f"{name}_{part}") or 0.0
    for le in BUCKETS:
        out[f"le_{le}"] = get("probeguard_serve_batch_inputs_bucket", {"le": le}) or 0.0
    return out


def serve_level(server: Any, texts: list[str], clients: int, warmup: int) -> dict[str, Any]:
    """One closed-loop run of ``texts`` at ``clients``: latencies, rate, histogram deltas."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_client_process, args=(server.url, texts, clients, warmup, child), daemon=True
    )
    proc.start()
    if parent.recv() != "warm":
        raise SystemExit("client process failed")
    before, load = _sample(server.service), load_average()
    parent.send("go")
    results: list[tuple[float, float, int]] = parent.recv()
    after = _sample(server.service)
    proc.join(30)
    ok = [r for r in results if r[2] == 200]
    if len(ok) != len(results):
        codes = sorted({r[2] for r in results if r[2] != 200})
        raise SystemExit(f"{len(results) - len(ok)} requests failed at {clients} clients: {codes}")
    span = max(r[0] + r[1] for r in ok) - min(r[0] for r in ok)
    return {
        "lat_ms": [1000 * r[1] for r in ok],
        "rps": len(ok) / span,
        "delta": {k: after[k] - before[k] for k in after},
        "load_before": load,
    }


def summarize_level(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A client count's rounds together: latency percentiles over every request, the mean
    requests/s of the rounds, the server's histograms summed."""
    from probes.metrics import percentile

    lat = [x for r in runs for x in r["lat_ms"]]
    d = {k: sum(r["delta"][k] for r in runs) for k in runs[0]["delta"]}

    def mean(name: str, scale: float = 1.0) -> float:
        return round(scale * d[f"{name}_sum"] / max(1.0, d[f"{name}_count"]), 1)

    hist, prev = {}, 0.0
    for le in BUCKETS:  # inputs per pass, by histogram bucket (<= le)
        if d[f"le_{le}"] - prev:
            hist[le.removesuffix(".0")] = int(d[f"le_{le}"] - prev)
        prev = d[f"le_{le}"]
    return {
        "requests": len(lat),
        "p50_ms": round(percentile(lat, 0.5), 1),
        "p99_ms": round(percentile(lat, 0.99), 1),
        "mean_ms": round(statistics.fmean(lat), 1),
        "max_ms": round(max(lat), 1),
        "rps": round(statistics.fmean(r["rps"] for r in runs), 2),
        "rps_by_round": [round(r["rps"], 2) for r in runs],
        "passes": int(d["probeguard_serve_batch_inputs_count"]),
        "mean_batch_inputs": mean("probeguard_serve_batch_inputs"),
        "batch_inputs_hist": hist,
        "mean_queue_ms": mean("probeguard_serve_queue_seconds", 1000),
        "mean_pass_ms": mean("probeguard_scorer_batch_seconds", 1000),
        "load_before": [r["load_before"][0] for r in runs],
    }


# --- the Kafka scorer, as bench/score_e2e.py runs it ---------------------------------------


def kafka_backlog(base: Any, extractor: Any, client: Any, texts: list[str]) -> dict[str, Any]:
    from score_e2e import VerdictClock, chat_records, count_sum, produce

    from worker.kafka.clients import ensure_topics
    from worker.scoring.scorer import Scorer

    tag = uuid.uuid4().hex[:6]
    settings = base.model_copy(
        update={
            "topic_chat": f"chat-{tag}",
            "topic_verdicts": f"verdicts-{tag}",
            "topic_review": f"review-{tag}",
            "topic_dead_letter": f"dead-{tag}",
            "group_scorer": f"scorer-{tag}",
        }
    )
    ensure_topics(settings)
    scorer = Scorer(settings, extractor, client, worker_id=f"bench-{tag}")
    # On a thread, as bench/score_e2e.py runs it, and as serve scores: torch's OpenMP
    # threads behave differently on the main thread (see bench/serve.md), and both paths
    # should meet the same regime.
    thread = threading.Thread(target=scorer.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while scorer.loop is None or not scorer.loop.consumer.assignment():
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the Kafka scorer did not start")
        time.sleep(0.1)
    clock = VerdictClock(settings)
    load = load_average()
    t0 = time.time()
    sent = produce(settings, chat_records(texts, f"k{tag}"), None)
    clock.wait_for(set(sent), timeout_s=3600)
    rate = len(texts) / (max(clock.arrived[k] for k in sent) - t0)
    scorer.stop()
    thread.join(60)
    clock.stop.set()
    polls, polled = count_sum(scorer.metrics.batch_size)
    passes, seconds = count_sum(scorer.metrics.batch_seconds)
    return {
        "msg_s": round(rate, 2),
        "messages": len(texts),
        "mean_poll": round(polled / max(1.0, polls), 1),
        "mean_poll_ms": round(1000 * seconds / max(1.0, passes), 1),
        "load_before": load,
    }


# --- the run ---------------------------------------------------------------------------


def start_server(base: Any, extractor: Any, client: Any, wait_ms: float, batch: int) -> Any:
    import httpx2

    from worker.serve.server import ModerationServer

    settings = base.model_copy(
        update={"serve_max_wait_ms": wait_ms, "serve_max_batch": batch, "serve_port": 0}
    )
    server = ModerationServer(settings, extractor, client, keys=None).start()
    deadline = time.monotonic() + 120
    with httpx2.Client(base_url=server.url) as http:
        while http.get("/readyz").status_code != 200:
            if time.monotonic() > deadline:
                server.stop()
                raise SystemExit(f"serve not ready: {http.get('/readyz').text}")
            time.sleep(0.1)
    return server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from score_e2e import load_rows

    from worker.embedded import EmbeddedBroker
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import Settings
    from worker.store.redis import make_redis

    rows = load_rows(args.data)
    texts = [r["text"][:32_000] for r in rows[: args.limit or None]]
    sample = texts * args.passes
    levels = [int(x) for x in args.clients.split(",")]
    variants = list(
        itertools.product(
            [float(x) for x in args.max_wait_ms.split(",")],
            [int(x) for x in args.max_batch.split(",")],
        )
    )
    prefix = f"bench-serve-{uuid.uuid4().hex[:8]}"
    kafka: list[dict[str, Any]] = []
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {}  # (variant, clients) -> rounds
    by_round: list[dict[str, Any]] = []
    with EmbeddedBroker() as broker:
        base = Settings(
            kafka_bootstrap=broker.bootstrap,
            redis_url=args.redis_url,
            redis_prefix=prefix,
            metrics_port=0,
            review_audit_share=0.0,  # as bench/score_e2e.py: no audit sampling either way
            serve_rate_per_key=1e9,  # the per-caller limit (50/s) is not what is measured
            serve_rate_burst=1_000_000,
        )
        client = make_redis(base)
        try:
            log(f"loading {base.model} …")
            extractor = HiddenStateExtractor.from_settings(base)

            def kafka_run(r: int) -> None:
                log(f"[round {r + 1}] kafka backlog: {len(sample)} messages …")
                kafka.append(kafka_backlog(base, extractor, client, sample))
                by_round[r]["kafka_msg_s"] = kafka[-1]["msg_s"]
                log(f"  {kafka[-1]}")

            for r in range(args.rounds):
                # ABBA: odd rounds run everything in reverse, so drifting load hits all alike.
                forward = r % 2 == 0
                by_round.append({"round": r + 1, "order": "forward" if forward else "reverse"})
                if forward and not args.no_kafka:
                    kafka_run(r)
                order = list(enumerate(variants)) if forward else list(enumerate(variants))[::-1]
                for v, (wait_ms, batch) in order:
                    server = start_server(base, extractor, client, wait_ms, batch)
                    try:
                        version = server.service.engine.watcher.versions()
                        for n in levels if forward else levels[::-1]:
                            log(f"[round {r + 1}] serve (max_wait {wait_ms:g} ms, max_batch "
                                f"{batch}), {n} clients …")  # fmt: skip
                            got = serve_level(server, sample, n, args.warmup)
                            runs.setdefault((v, n), []).append(got)
                            by_round[r][f"rps_{v}_{n}"] = round(got["rps"], 2)
                            log(f"  {got['rps']:.2f} req/s, p50 "
                                f"{statistics.median(got['lat_ms']):.0f} ms")  # fmt: skip
                    finally:
                        server.stop()
                if not forward and not args.no_kafka:
                    kafka_run(r)
        finally:
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            for j in range(0, len(keys), 1000):
                client.delete(*keys[j : j + 1000])
            client.close()

    kafka_rate = round(statistics.fmean(k["msg_s"] for k in kafka), 2) if kafka else None
    top = max(levels)
    results: list[dict[str, Any]] = []
    for v, (wait_ms, batch) in enumerate(variants):
        per = {str(n): summarize_level(runs[(v, n)]) for n in levels}
        ratio = round(per[str(top)]["rps"] / kafka_rate, 3) if kafka_rate else None
        p99_4 = per["4"]["p99_ms"] if "4" in per else None
        results.append(
            {
                "max_wait_ms": wait_ms,
                "max_batch": batch,
                "clients": per,
                "ratio_vs_kafka": ratio,
                # Each round's own ratio: how far the load on the machine moves it.
                "ratio_by_round": [
                    round(rnd[f"rps_{v}_{top}"] / rnd["kafka_msg_s"], 3)
                    for rnd in by_round
                    if "kafka_msg_s" in rnd
                ],
                "meets": {
                    "p99_4_clients": None if p99_4 is None else p99_4 <= TARGET_P99_MS,
                    f"ratio_{top}_vs_kafka": None if ratio is None else ratio >= TARGET_RATIO,
                },
            }
        )
    head = results[0]
    print(f"{'wait ms':>8}{'batch':>6}{'clients':>8}{'p50 ms':>8}{'p99 ms':>8}{'req/s':>8}"
          f"{'inputs/pass':>12}{'queue ms':>9}{'pass ms':>8}")  # fmt: skip
    for res in results:
        for n, c in res["clients"].items():
            print(
                f"{res['max_wait_ms']:>8g}{res['max_batch']:>6}{n:>8}{c['p50_ms']:>8.0f}"
                f"{c['p99_ms']:>8.0f}{c['rps']:>8.2f}{c['mean_batch_inputs']:>12.1f}"
                f"{c['mean_queue_ms']:>9.0f}{c['mean_pass_ms']:>8.0f}"
            )
    if kafka_rate:
        each = ", ".join(f"{k['msg_s']:.2f}" for k in kafka)
        print(f"kafka backlog {kafka_rate:.2f} msg/s (rounds: {each}); {top} clients / kafka: "
              + ", ".join(f"{res['ratio_vs_kafka']:.2f} (rounds: {res['ratio_by_round']})"
                          for res in results))  # fmt: skip
    result = {
        "bench": "serve",
        "question": "serve latency and throughput, single-text requests, vs the Kafka scorer",
        "data": str(args.data),
        "texts": len(texts),
        "rounds": args.rounds,
        "requests_per_level": len(sample) * args.rounds,
        "probe": version,
        "clients": head["clients"],
        "kafka_backlog_msg_s": kafka_rate,
        "kafka_runs": kafka,
        f"ratio_{top}_vs_kafka": head["ratio_vs_kafka"],
        "ratio_by_round": head["ratio_by_round"],
        "targets": {"p99_ms_4_clients_max": TARGET_P99_MS, "ratio_min": TARGET_RATIO},
        "meets": head["meets"],
        "settings": {
            "model": base.model,
            "autocast": extractor.autocast,
            "batch_size": base.batch_size,
            "batch_tokens": base.batch_tokens,
            "batch_min_fill": base.batch_min_fill,
            "max_tokens": base.max_tokens,
            "serve_max_wait_ms": head["max_wait_ms"],
            "serve_max_batch": head["max_batch"],
            "cpus": os.cpu_count(),
        },
        "variants": results if len(results) > 1 else None,
        "load_end": load_average(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
