"""Does one key's long request make another key's short request wait for all of it?

One ``probeguard serve`` in this process (the settings' LLM, default SmolLM2-135M, serving
the packaged default as v0), two API keys, its own Redis key prefix (removed at the end).
Each round, key ``big`` sends one request of ``--inputs`` long texts (each over
``MAX_TOKENS``, so each costs the LLM ``MAX_TOKENS`` tokens), and ``--delay`` seconds later
key ``small`` sends one short text; both latencies are recorded. The same rounds run with
``PROBEGUARD_SERVE_PASS_TOKENS=0`` (a request is one pass, as before issue 45) and with the
default bound, side by side in one run::

    PYTHONPATH=. python bench/serve_fairness.py --rounds 3

The last line printed is one JSON object: per configuration the short request's and the
long request's median latency, and ``short_wait_ratio`` (bounded / unbounded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from typing import Any

from _shared import log

SHORT = "what time is the meeting tomorrow?"
LONG = (
    "The committee met on Tuesday to go over the budget for next year, and after a long "
    "discussion about the library, the parks and the roads, nobody could agree on much. "
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration (%(default)s)")
    p.add_argument("--inputs", type=int, default=32, help="long texts in the big request (32)")
    p.add_argument("--delay", type=float, default=0.3, help="seconds before the short one (0.3)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    return p.parse_args(argv)


def _post(url: str, key: str, texts: list[str], out: list[float]) -> None:
    import httpx2

    t0 = time.perf_counter()
    r = httpx2.post(
        f"{url}/v1/moderations",
        json={"input": texts},
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
    )
    r.raise_for_status()
    out.append((time.perf_counter() - t0) * 1000)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import httpx2

    from worker.llm.extract import HiddenStateExtractor
    from worker.serve.keys import KeyRing, new_key
    from worker.serve.server import ModerationServer
    from worker.settings import Settings
    from worker.store.redis import make_redis

    prefix = f"bench-fair-{uuid.uuid4().hex[:8]}"
    made = {name: new_key(name) for name in ("big", "small")}
    base = Settings(redis_url=args.redis_url, redis_prefix=prefix, metrics_port=0, serve_port=0)
    long_text = LONG * (4 * base.max_tokens // len(LONG.split()) + 1)  # well over MAX_TOKENS
    client = make_redis(base)
    log(f"loading {base.model} …")
    extractor = HiddenStateExtractor.from_settings(base)
    ring = KeyRing.parse(",".join(entry for _, entry in made.values()))
    results: dict[str, Any] = {}
    try:
        for name, pass_tokens in (("one_pass", 0), ("bounded", base.serve_pass_tokens)):
            settings = base.model_copy(update={"serve_pass_tokens": pass_tokens})
            server = ModerationServer(settings, extractor, client, keys=ring).start()
            short_ms: list[float] = []
            long_ms: list[float] = []
            try:
                with httpx2.Client(base_url=server.url) as h:
                    while h.get("/readyz").status_code != 200:
                        time.sleep(0.2)
                _post(server.url, made["small"][0], [SHORT], [])  # warm-up
                for r in range(args.rounds):
                    big = threading.Thread(
                        target=_post,
                        args=(server.url, made["big"][0], [long_text] * args.inputs, long_ms),
                    )
                    big.start()
                    time.sleep(args.delay)
                    _post(server.url, made["small"][0], [SHORT], short_ms)
                    big.join()
                    log(
                        f"{name} round {r + 1}: short {short_ms[-1]:.0f} ms, "
                        f"long {long_ms[-1]:.0f} ms"
                    )
            finally:
                server.stop()
            results[name] = {
                "pass_tokens": pass_tokens,
                "short_ms": round(statistics.median(short_ms), 1),
                "long_ms": round(statistics.median(long_ms), 1),
                "short_runs_ms": [round(x) for x in short_ms],
            }
    finally:
        stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for j in range(0, len(stale), 1000):
            client.delete(*stale[j : j + 1000])
        client.close()
    ratio = results["bounded"]["short_ms"] / results["one_pass"]["short_ms"]
    out = {
        "bench": "serve_fairness",
        "model": base.model,
        "max_tokens": base.max_tokens,
        "inputs": args.inputs,
        **results,
        "short_wait_ratio": round(ratio, 3),
        "long_cost_ratio": round(results["bounded"]["long_ms"] / results["one_pass"]["long_ms"], 3),
    }
    print(
        f"short request: {results['one_pass']['short_ms']:.0f} ms in one pass, "
        f"{results['bounded']['short_ms']:.0f} ms bounded ({ratio:.2f}×); long request "
        f"{results['one_pass']['long_ms']:.0f} / {results['bounded']['long_ms']:.0f} ms"
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
