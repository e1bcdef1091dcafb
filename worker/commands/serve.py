"""``probeguard serve``: OpenAI- and Perspective-compatible moderation over HTTP.

    probeguard serve [run] [--host H] [--port P] [--probes NAMES] [--no-auth]
    probeguard serve key NAME      # a new API key, then its PROBEGUARD_SERVE_API_KEYS entry

Endpoints: ``POST /v1/moderations`` (OpenAI), ``POST /v1alpha1/comments:analyze``
(Perspective), ``/openapi.json``, ``/metrics``, ``/healthz``, ``/readyz``. The probes,
hot swaps, canary rules and evidence are the Kafka scorer's (``docs/serve.md``).
"""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="OpenAI- and Perspective-compatible moderation endpoints over HTTP",
        description=(
            "Serve POST /v1/moderations (OpenAI's request and response) and POST "
            "/v1alpha1/comments:analyze (Perspective's) with the live probe(s) from the "
            "Redis registry on the frozen LLM: the Kafka scorer's engine, so versions "
            "hot-swap, canaries get their share by conversation (X-Probeguard-Conversation "
            "or Perspective's sessionId), and a label given later credits the version that "
            "judged the call. Concurrent requests are scored together "
            "(PROBEGUARD_SERVE_MAX_WAIT_MS, PROBEGUARD_SERVE_MAX_BATCH). API keys come from "
            "PROBEGUARD_SERVE_API_KEYS (`probeguard serve key NAME` makes one); without "
            "keys it refuses to start unless --no-auth, and then listens on loopback only. "
            "SIGTERM/Ctrl-C: finish the requests in hand and exit 0."
        ),
    )
    p.set_defaults(func=_run, host=None, port=None, probes=None, no_auth=False)
    acts = p.add_subparsers(dest="action", metavar="ACTION")
    a = acts.add_parser("run", help="serve the endpoints (the default)")
    for parser in (p, a):
        parser.add_argument("--host", help="listen address (default: PROBEGUARD_SERVE_HOST)")
        parser.add_argument("--port", type=int, help="port (default: PROBEGUARD_SERVE_PORT, 8400)")
        parser.add_argument("--probes", help="comma-separated probe names (PROBEGUARD_PROBES)")
        parser.add_argument(
            "--no-auth",
            action="store_true",
            help="serve without API keys (loopback addresses only)",
        )
    a.set_defaults(func=_run)
    a = acts.add_parser(
        "key",
        help="print a new API key and its PROBEGUARD_SERVE_API_KEYS entry",
        description=(
            "Prints a new random API key on the first line (give it to the client; it is "
            "stored nowhere) and its settings entry NAME:sha256$... on the second (join "
            "entries with commas into PROBEGUARD_SERVE_API_KEYS)."
        ),
    )
    a.add_argument("name", help="the key's name (letters, digits, _ -): its rate-limit bucket")
    a.set_defaults(func=_key)


def _run(args: argparse.Namespace) -> int:
    from worker.commands._common import registry_redis, settings_with, until_signalled
    from worker.errors import ConfigError
    from worker.llm.extract import HiddenStateExtractor
    from worker.serve.keys import KeyRing
    from worker.serve.server import ModerationServer

    settings = settings_with(serve_host=args.host, serve_port=args.port, probes=args.probes)
    raw = settings.serve_api_keys
    keys = KeyRing.parse(None if raw is None else raw.get_secret_value())
    if not len(keys) and not args.no_auth:
        raise ConfigError(
            "no API keys: set PROBEGUARD_SERVE_API_KEYS (`probeguard serve key NAME` prints "
            "an entry), or pass --no-auth to serve without keys on loopback"
        )
    client = registry_redis(settings)  # a missing Redis is said before the LLM loads
    extractor = HiddenStateExtractor.from_settings(settings)
    server = ModerationServer(
        settings, extractor, client, keys=None if args.no_auth else keys
    ).start()
    print(f"serve: {server.url} (Ctrl-C stops)", flush=True)
    try:
        until_signalled()
    finally:
        server.stop()
    return 0


def _key(args: argparse.Namespace) -> int:
    from worker.serve.keys import new_key

    key, entry = new_key(args.name)
    print(key)
    print(entry)
    return 0
