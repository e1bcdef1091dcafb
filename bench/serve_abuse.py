"""Does one hostile client of ``probeguard serve`` cost only itself?

One server (this process; the settings' LLM, default SmolLM2-135M, and the probe it serves
by default: the packaged default, v0), three API keys (``good``, whose latency is
measured; ``tenant``, a key holder who misbehaves; ``alpha``, whose name is attacked), its
own Redis key prefix (removed at the end). Two client processes (so no client holds the
server's GIL, and the attackers' Python never holds the measuring clients') run, per phase
of ``--seconds`` seconds:

- ``--valid`` closed-loop clients of key ``good`` (from 127.0.0.1), one short text per
  ``POST /v1/moderations``, each at most ``--valid-rate`` a second (together under the
  key's rate: until 2026-12-05 they were not paced, and with the tiny model a 429 ended
  each client a second or two into every phase, unseen), and a ``/healthz`` probe every
  100 ms;
- in the ``abuse`` phases, at the same time, four hostile clients, each from a loopback
  address of its own (as distinct hosts would be): ``tenant`` sending 1 MB invalid bodies
  (``{"input": [1, 1, …]}``) in a closed loop on 2 connections (127.0.0.11); a flood of junk
  keys, half not keys at all and half unknown names (127.0.0.12, 2 connections, a new
  connection and key per request); wrong keys on the real name ``alpha`` (127.0.0.13,
  likewise); and ``--stalled`` connections that send half a request line and stop,
  reopened as the server closes them (127.0.0.14).

Phases run idle, abuse, idle, abuse (``--rounds`` 2: ABAB, so drifting load from other
processes hits both alike). Each hostile client stops at ``--max-requests`` requests or
at the end of its phase, whichever comes first: the bench is bounded in count and time and
talks to loopback only. The server's RSS (``/proc/self/status``) is sampled every 100 ms.

Targets (issue 45): the valid key's p99 under abuse ≤ 2× its idle p99; ``/healthz``
answers under 200 ms (every probe, under abuse); RSS grows by under 200 MB. The last line
printed is one JSON object::

    PYTHONPATH=. python bench/serve_abuse.py
    PYTHONPATH=. python bench/serve_abuse.py --seconds 20 --valid 2 --stalled 50

``--tiny`` serves a tiny random LLM instead, so that what is measured is the server's own
work (on a busy CPU, one SmolLM2 pass takes long enough to hide it).

Results: the table in ``docs/serve.md`` ("Under hostile clients").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import socket
import sys
import threading
import time
import uuid
from typing import Any

from _shared import load_average, log, rss_mb

TARGET_P99_RATIO = 2.0
TARGET_HEALTHZ_MS = 200.0
TARGET_RSS_MB = 200.0
TEXTS = [
    "have a nice day",
    "you are an idiot",
    "what time is the meeting tomorrow?",
    "I will find you and hurt you",
    "thanks, that was helpful",
    "this is the worst thing I have ever read",
]
SOURCES = {"bodies": "127.0.0.11", "junk": "127.0.0.12", "wrong": "127.0.0.13"}
STALLED_FROM = "127.0.0.14"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="per phase (%(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="idle+abuse pairs (%(default)s)")
    p.add_argument("--valid", type=int, default=2, help="valid closed-loop clients (%(default)s)")
    p.add_argument(
        "--valid-rate",
        type=float,
        default=10.0,
        help="most requests a second per valid client (%(default)s): together under the "
        "key's PROBEGUARD_SERVE_RATE_PER_KEY (50), so that no valid request is refused",
    )
    p.add_argument("--stalled", type=int, default=50, help="stalled connections (%(default)s)")
    p.add_argument(
        "--max-requests",
        type=int,
        default=5000,
        help="most requests per hostile client per phase (%(default)s)",
    )
    p.add_argument("--warmup", type=int, default=5, help="valid requests first (%(default)s)")
    p.add_argument(
        "--kinds",
        default="bodies,junk,wrong,stalled",
        help="the hostile clients to run, comma-separated (%(default)s): one at a time "
        "says which costs the valid key most",
    )
    p.add_argument(
        "--hostile-nice",
        type=int,
        default=0,
        help="run the hostile clients' process at this nice increment (%(default)s): on "
        "loopback their own work takes the CPU the server needs, which a remote attacker's "
        "would not; 10-19 leaves the cores to the server and the valid clients",
    )
    p.add_argument(
        "--hostile-cpus",
        default="",
        help="pin the hostile clients' process to these CPUs (comma-separated, e.g. 1) and the "
        "server with the valid clients to the others, in every phase: the attackers' own "
        "work then takes none of the server's cores, as from another machine (default: "
        "no pinning)",
    )
    p.add_argument(
        "--key-scheme",
        choices=["sha256", "scrypt"],
        default="sha256",
        help="how the keys' entries are hashed (%(default)s; scrypt: entries made before, "
        "each wrong key a 16 MiB scrypt)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random LLM (worker/llm/tiny.py) and a random probe published for it: "
        "scoring costs ~nothing, so the latencies are the server's own",
    )
    p.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="Redis (default: %(default)s)"
    )
    return p.parse_args(argv)


# --- the clients (a process of their own) ------------------------------------------------


def _valid(
    url: str, key: str, stop: threading.Event, out: list[float], rate: float, failed: list[str]
) -> None:
    """One short request at a time, at most ``rate`` a second (the key's rate limit is
    not what is measured). A request that is not answered 200 ends the client and is
    reported: the run then stops with it (a thread's SystemExit would pass unseen)."""
    import httpx2

    with httpx2.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as h:
        i = 0
        due = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            r = h.post("/v1/moderations", json={"input": TEXTS[i % len(TEXTS)]})
            if r.status_code != 200:
                failed.append(f"a valid request answered {r.status_code}: {r.text[:200]}")
                return
            out.append(1000 * (time.perf_counter() - t0))
            i += 1
            due = max(due + 1.0 / rate, time.perf_counter())
            stop.wait(due - time.perf_counter())


def _healthz(url: str, stop: threading.Event, out: list[float]) -> None:
    import httpx2

    with httpx2.Client(base_url=url, timeout=60) as h:
        while not stop.is_set():
            t0 = time.perf_counter()
            h.get("/healthz")
            out.append(1000 * (time.perf_counter() - t0))
            stop.wait(0.1)


def _hostile(
    url: str, kind: str, tenant: str, stop: threading.Event, limit: int, codes: dict[int, int]
) -> None:
    import httpx2

    body = b'{"input": [' + b",".join([b"1"] * 450_000) + b"]}"  # ~0.9 MB of wrong items
    transport = httpx2.HTTPTransport(local_address=SOURCES[kind])
    with httpx2.Client(base_url=url, timeout=120, transport=transport) as h:
        for i in range(limit):
            if stop.is_set():
                return
            if kind == "bodies":
                r = h.post(
                    "/v1/moderations", content=body, headers={"Authorization": f"Bearer {tenant}"}
                )
            else:
                if kind == "junk":
                    key = f"junk-{secrets.token_hex(8)}" if i % 2 else f"pg.n{i}.{'0' * 48}"
                else:
                    key = f"pg.alpha.{secrets.token_hex(24)}"
                r = h.post(
                    "/v1/moderations",
                    json={"input": "x"},
                    headers={"Authorization": f"Bearer {key}", "Connection": "close"},
                )
            codes[r.status_code] = codes.get(r.status_code, 0) + 1  # Retry-After ignored


def _stalled(url: str, n: int, stop: threading.Event, stats: dict[str, int]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    half = b"POST /v1/moderations HTTP/1.1\r\nHost: x\r\nAuthoriz"
    open_: list[socket.socket] = []
    while not stop.is_set():
        while len(open_) < n and not stop.is_set():
            try:
                s = socket.create_connection(
                    (host, int(port)), timeout=5, source_address=(STALLED_FROM, 0)
                )
                s.sendall(half)
                s.setblocking(False)
                open_.append(s)
                stats["opened"] += 1
            except OSError:
                stats["failed"] += 1
                break
        for s in list(open_):
            try:
                if s.recv(4096) == b"":
                    raise ConnectionResetError
            except BlockingIOError:
                continue
            except OSError:
                pass
            stats["closed_by_server"] += 1
            s.close()
            open_.remove(s)
        stop.wait(0.1)
    for s in open_:
        s.close()


def _client_process(
    url: str, keys: dict[str, str], args: dict[str, Any], role: str, conn: Any
) -> None:
    """Runs each phase the parent names, as the ``valid`` clients (and the ``/healthz``
    probe) or the ``hostile`` ones (abuse phases only): two processes, so the attackers'
    Python never holds the measuring clients' GIL. Sends back its measurements."""
    import httpx2

    if role == "valid":
        with httpx2.Client(base_url=url, timeout=120) as h:  # warm-up (not counted)
            for i in range(args["warmup"]):
                h.post(
                    "/v1/moderations",
                    json={"input": TEXTS[i % len(TEXTS)]},
                    headers={"Authorization": f"Bearer {keys['good']}"},
                )
    if role == "hostile" and args["hostile_nice"]:
        os.nice(args["hostile_nice"])  # the attackers' CPU is theirs, not the server's
    if role == "hostile" and args["hostile_cpus"]:
        os.sched_setaffinity(0, args["hostile_cpus"])
    conn.send("warm")
    while (phase := conn.recv()) is not None:
        stop = threading.Event()
        latency: list[list[float]] = [[] for _ in range(args["valid"])]
        health: list[float] = []
        codes: dict[str, dict[int, int]] = {k: {} for k in ("bodies", "junk", "wrong")}
        stalled = {"opened": 0, "closed_by_server": 0, "failed": 0}
        failed: list[str] = []
        threads = []
        if role == "valid":
            threads += [
                threading.Thread(
                    target=_valid,
                    args=(url, keys["good"], stop, latency[i], args["valid_rate"], failed),
                )
                for i in range(args["valid"])
            ]
            threads.append(threading.Thread(target=_healthz, args=(url, stop, health)))
        elif phase == "abuse":
            for kind in codes:
                if kind not in args["kinds"]:
                    continue
                for _ in range(2):
                    hostile = (url, kind, keys["tenant"], stop, args["max_requests"], codes[kind])
                    threads.append(threading.Thread(target=_hostile, args=hostile))
            if "stalled" in args["kinds"]:
                threads.append(
                    threading.Thread(target=_stalled, args=(url, args["stalled"], stop, stalled))
                )
        for t in threads:
            t.daemon = True
            t.start()
        stop.wait(args["seconds"])
        stop.set()
        for t in threads:
            t.join(180)
        conn.send(
            {
                "latency_ms": [x for lat in latency for x in lat],
                "failed": failed,
                "healthz_ms": health,
                "codes": codes,
                "stalled": stalled,
            }
        )


# --- the run ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hostile_cpus = {int(c) for c in args.hostile_cpus.split(",") if c.strip()}
    if hostile_cpus:
        rest = os.sched_getaffinity(0) - hostile_cpus
        if not rest:
            raise SystemExit(f"--hostile-cpus {args.hostile_cpus} leaves the server no CPU")
        os.sched_setaffinity(0, rest)  # before any thread: the server's threads inherit it
    import httpx2

    from probes.metrics import percentile
    from worker.llm.extract import HiddenStateExtractor
    from worker.serve.keys import KeyRing, new_key
    from worker.serve.server import ModerationServer
    from worker.settings import Settings
    from worker.store.redis import make_redis

    prefix = f"bench-abuse-{uuid.uuid4().hex[:8]}"
    made = {name: new_key(name, args.key_scheme) for name in ("good", "tenant", "alpha")}
    settings = Settings(
        redis_url=args.redis_url,
        redis_prefix=prefix,
        metrics_port=0,
        serve_port=0,
        review_audit_share=0.0,
    )
    client = make_redis(settings)
    samples: list[tuple[float, float]] = []  # (time, RSS MB) of the server process
    phases: list[dict[str, Any]] = []
    try:
        if args.tiny:
            from worker.llm.tiny import make_tiny_llm, moderation_spec, publish_probe
            from worker.store.checkpoints import CheckpointRegistry
            from worker.store.redis import Keys

            extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=8)
            spec = moderation_spec(extractor.hidden_size)
            settings = settings.model_copy(update={"probes": spec.name, "default_probe": False})
            registry = CheckpointRegistry(client, Keys(prefix), spec.name)
            publish_probe(registry, extractor.fingerprint, spec=spec, seed=None)
        else:
            log(f"loading {settings.model} …")
            extractor = HiddenStateExtractor.from_settings(settings)
        ring = KeyRing.parse(",".join(entry for _, entry in made.values()))
        server = ModerationServer(settings, extractor, client, keys=ring).start()
        try:
            with httpx2.Client(base_url=server.url) as h:
                deadline = time.monotonic() + 300
                while h.get("/readyz").status_code != 200:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"serve not ready: {h.get('/readyz').text}")
                    time.sleep(0.2)
            sampling = threading.Event()

            def sample() -> None:
                while not sampling.wait(0.1):
                    samples.append((time.monotonic(), rss_mb()))

            threading.Thread(target=sample, daemon=True).start()
            ctx = multiprocessing.get_context("spawn")
            keys = {name: key for name, (key, _) in made.items()}
            options = {
                k: getattr(args, k)
                for k in ("warmup", "valid", "valid_rate", "seconds", "stalled", "hostile_nice")
            }
            options["max_requests"] = args.max_requests
            options["hostile_cpus"] = hostile_cpus
            options["kinds"] = set(args.kinds.split(","))
            pipes: list[Any] = []
            procs: list[Any] = []
            for role in ("valid", "hostile"):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_client_process,
                    args=(server.url, keys, options, role, child),
                    daemon=True,
                )
                proc.start()
                pipes.append(parent)
                procs.append(proc)
            if [pipe.recv() for pipe in pipes] != ["warm", "warm"]:
                raise SystemExit("a client process failed")
            rss_start = rss_mb()
            for r in range(args.rounds):
                for phase in ("idle", "abuse"):
                    log(f"[round {r + 1}] {phase} for {args.seconds:g} s …")
                    t0 = time.monotonic()
                    load = load_average()
                    for pipe in pipes:
                        pipe.send(phase)
                    got, hostile = (pipe.recv() for pipe in pipes)
                    if got["failed"]:
                        raise SystemExit(f"[round {r + 1}] {phase}: {got['failed'][0]}")
                    got.update(codes=hostile["codes"], stalled=hostile["stalled"])
                    got.update(phase=phase, round=r + 1, load_before=load, t0=t0)
                    got["rss_max_mb"] = max((m for t, m in samples if t >= t0), default=rss_mb())
                    phases.append(got)
                    lat = got["latency_ms"]
                    log(
                        f"  {len(lat)} valid requests, p99 {percentile(lat, 0.99):.0f} ms, "
                        f"/healthz max {max(got['healthz_ms'], default=0):.0f} ms, "
                        f"RSS {got['rss_max_mb']:.0f} MB, hostile {got['codes']}"
                    )
            for pipe, proc in zip(pipes, procs, strict=True):
                pipe.send(None)
                proc.join(60)
            sampling.set()
        finally:
            server.stop()
    finally:
        stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for j in range(0, len(stale), 1000):
            client.delete(*stale[j : j + 1000])
        client.close()

    def pooled(phase: str, field: str) -> list[float]:
        return [x for p in phases if p["phase"] == phase for x in p[field]]

    idle, abuse = pooled("idle", "latency_ms"), pooled("abuse", "latency_ms")
    h_idle, h_abuse = pooled("idle", "healthz_ms"), pooled("abuse", "healthz_ms")
    p99_idle, p99_abuse = percentile(idle, 0.99), percentile(abuse, 0.99)
    rss_growth = max(p["rss_max_mb"] for p in phases) - rss_start
    codes: dict[str, dict[str, int]] = {}
    for ph in phases:
        for kind, by_code in ph["codes"].items():
            for code, n in by_code.items():
                codes.setdefault(kind, {})
                codes[kind][str(code)] = codes[kind].get(str(code), 0) + n
    stalled = {
        k: sum(p["stalled"][k] for p in phases if p["phase"] == "abuse")
        for k in ("opened", "closed_by_server", "failed")
    }
    result = {
        "bench": "serve_abuse",
        "model": "tiny" if args.tiny else settings.model,
        "seconds_per_phase": args.seconds,
        "rounds": args.rounds,
        "valid_clients": args.valid,
        "valid_rate": args.valid_rate,
        "hostile_nice": args.hostile_nice,
        "hostile_cpus": sorted(hostile_cpus),
        "key_scheme": args.key_scheme,
        "kinds": args.kinds,
        "valid": {
            "idle": {
                "requests": len(idle),
                "p50_ms": round(percentile(idle, 0.5), 1),
                "p99_ms": round(p99_idle, 1),
            },
            "abuse": {
                "requests": len(abuse),
                "p50_ms": round(percentile(abuse, 0.5), 1),
                "p99_ms": round(p99_abuse, 1),
            },
            "p99_ratio": round(p99_abuse / p99_idle, 2),
        },
        "healthz": {
            "idle_max_ms": round(max(h_idle), 1),
            "abuse_p99_ms": round(percentile(h_abuse, 0.99), 1),
            "abuse_max_ms": round(max(h_abuse), 1),
            "probes": len(h_abuse),
        },
        "rss": {"start_mb": round(rss_start, 1), "growth_mb": round(rss_growth, 1)},
        "hostile_answers": codes,
        "stalled": stalled,
        "load_before": [p["load_before"][0] for p in phases],
        "meets": {
            "p99_within_2x": p99_abuse <= TARGET_P99_RATIO * p99_idle,
            "healthz_under_200ms": max(h_abuse) < TARGET_HEALTHZ_MS,
            "rss_growth_under_200mb": rss_growth < TARGET_RSS_MB,
        },
    }
    print(
        f"valid p99 idle {p99_idle:.0f} ms, under abuse {p99_abuse:.0f} ms "
        f"({result['valid']['p99_ratio']}×); /healthz max under abuse {max(h_abuse):.0f} ms; "
        f"RSS +{rss_growth:.0f} MB"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
