"""``probeguard up``: the embedded Kafka-protocol broker and Redis, in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "up",
        help="run the embedded Kafka-protocol broker and Redis in the foreground",
        description=(
            "Start a local Kafka-protocol broker (tansu, memory storage) and, unless "
            "PROBEGUARD_REDIS_URL/REDIS_URL is set, a local Redis server; create the "
            "probeguard topics; print the settings to use; run until Ctrl-C or SIGTERM, "
            "then stop both. Everything is in memory and gone after stopping."
        ),
    )
    p.add_argument("--kafka-port", type=int, default=None, help="broker port (default: a free one)")
    p.add_argument("--redis-port", type=int, default=None, help="Redis port (default: a free one)")
    p.add_argument(
        "--embedded-redis",
        action="store_true",
        help="start an embedded Redis even when a Redis URL is configured",
    )
    p.add_argument("--no-topics", action="store_true", help="do not create the probeguard topics")
    p.add_argument(
        "--env-file",
        type=Path,
        default=None,
        help="also write the PROBEGUARD_* settings to this file (shell `export` lines)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from worker.embedded import EmbeddedBroker, EmbeddedRedis
    from worker.kafka.clients import all_topics, ensure_topics
    from worker.settings import load_settings

    settings = load_settings()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    broker = EmbeddedBroker(port=args.kafka_port)
    redis_server: EmbeddedRedis | None = None
    try:
        broker.start()
        if settings.redis_url is None or args.embedded_redis:
            redis_server = EmbeddedRedis(port=args.redis_port).start()
            redis_url = redis_server.url
            redis_shown = redis_url
        else:
            redis_url = settings.redis_url.get_secret_value()
            redis_shown = "(configured, unchanged)"
        settings = load_settings(kafka_bootstrap=broker.bootstrap)
        if not args.no_topics:
            ensure_topics(settings)
        exports = {"PROBEGUARD_KAFKA_BOOTSTRAP": broker.bootstrap}
        if redis_server is not None:
            exports["PROBEGUARD_REDIS_URL"] = redis_url
        lines = [f"export {k}={v}" for k, v in exports.items()]
        print(f"Kafka bootstrap : {broker.bootstrap}  (tansu pid {broker.pid}, memory storage)")
        print(f"Redis URL       : {redis_shown}")
        if not args.no_topics:
            print(f"Topics          : {', '.join(all_topics(settings))}")
        print("Use these in another shell:")
        for line in lines:
            print(f"  {line}")
        if args.env_file is not None:
            from probes.files import atomic_write

            atomic_write(args.env_file, "\n".join(lines) + "\n")  # may hold a Redis password
            print(f"(written to {args.env_file})")
        print("Press Ctrl-C to stop.", flush=True)

        while not stop.wait(0.5):
            for name, proc in (("broker", broker), ("redis", redis_server)):
                if proc is not None and not proc.alive():
                    print(
                        f"probeguard up: the {name} exited unexpectedly:\n{proc.log_tail()}",
                        file=sys.stderr,
                    )
                    return 1
        print("Stopping…", flush=True)
        return 0
    finally:
        broker.stop()
        if redis_server is not None:
            redis_server.stop()
        if args.env_file is not None and args.env_file.exists():
            args.env_file.unlink()
