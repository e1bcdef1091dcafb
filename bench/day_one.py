"""How long from starting `probeguard score` on a fresh stack, with nothing published and
no label anywhere, to the first verdict, and does it carry a score per category?

Runs exactly what a new user runs: `probeguard up` (embedded broker and Redis, in memory),
then `probeguard score` as a separate process with the settings `up` wrote; one chat
message is produced the moment the scorer starts. Measured: seconds from the scorer's
start to the verdict on the verdicts topic (the LLM's load included), the probe version
(0: the packaged default) and the heads and categories the verdict carries; then the
same with `PROBEGUARD_DEFAULT_PROBE=false` for contrast (no verdict within the wait).
``--runs`` scorer starts with the default (the median is reported, each run's seconds
beside it, and the 1-minute load average: the cores may be shared), each with the seconds
from its start to its phases' log lines (``breakdown_s``: imports done, LLM loaded, group
joined, scoring)::

    python bench/day_one.py --wait 60 --runs 3

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer

from schemas import ChatMessage, Verdict, utcnow

from _shared import log

BIN = Path(sys.executable).parent / "probeguard"


def read_env(path: Path, timeout_s: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            env = {}
            for line in path.read_text().splitlines():
                if line.startswith("export "):
                    key, _, value = line.removeprefix("export ").partition("=")
                    env[key] = shlex.split(value)[0] if value else ""
            if "PROBEGUARD_KAFKA_BOOTSTRAP" in env:
                return env
        time.sleep(0.2)
    raise SystemExit("probeguard up did not write its settings")


def first_verdict(env: dict[str, str], default_probe: bool, wait_s: float) -> dict[str, Any]:
    run_env = {**os.environ, **env, "PROBEGUARD_DEFAULT_PROBE": str(default_probe).lower()}
    run_env["PROBEGUARD_GROUP_SCORER"] = f"bench-{uuid.uuid4().hex[:6]}"
    bootstrap = env["PROBEGUARD_KAFKA_BOOTSTRAP"]
    consumer = KafkaConsumer(
        "moderation.verdicts", bootstrap_servers=bootstrap, auto_offset_reset="latest",
        consumer_timeout_ms=200, fetch_max_wait_ms=50,
    )  # fmt: skip
    consumer.poll(timeout_ms=1000)  # join: only verdicts from now on
    started = time.monotonic()
    wall_started = time.time()
    scorer = subprocess.Popen([str(BIN), "score"], env=run_env, stderr=subprocess.PIPE, text=True)
    mid = f"day-one-{uuid.uuid4().hex[:8]}"
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    msg = ChatMessage(message_id=mid, conversation_id="c", text="I will find you and hurt you",
                      created_at=utcnow())  # fmt: skip
    producer.send("chat.messages", key=mid.encode(), value=msg.encode()).get(30)
    producer.close()
    got: Verdict | None = None
    while got is None and time.monotonic() - started < wait_s:
        for record in consumer:
            v = Verdict.decode(record.value)
            if v.message_id == mid:
                got = v
                break
    seconds = time.monotonic() - started
    scorer.terminate()
    try:
        _, err = scorer.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        scorer.kill()
        _, err = scorer.communicate()
    consumer.close()
    said = [line for line in err.splitlines() if "packaged default" in line or "waiting" in line]
    if got is None:
        return {"verdict": False, "waited_s": round(seconds, 1), "log": said[:2]}
    result = got.results[0]
    return {
        "verdict": True,
        "seconds": round(seconds, 2),
        "breakdown_s": breakdown(err, wall_started),
        "version": result.version,
        "decision": got.decision,
        "heads": sorted(result.heads or {}),
        "categories": len(result.scores),
        "top": sorted(result.scores.items(), key=lambda kv: -kv[1])[:4],
        "log": said[:1],
    }


# Log lines of the scorer that mark its phases (the first match of each), by name.
PHASES = {
    "imports": "hashing 1 weight file",  # the first log line: Python, torch, the CLI
    "llm_loaded": " ready in ",
    "group_joined": "worker.kafka.early_join: joined",
    "scoring": "worker.scoring.scorer: scoring ",
}


def breakdown(err: str, wall_started: float) -> dict[str, float]:
    """Seconds from the scorer's start to each phase's log line (its timestamp)."""
    from datetime import datetime

    out: dict[str, float] = {}
    for line in err.splitlines():
        for name, marker in PHASES.items():
            if name not in out and marker in line:
                try:
                    at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                out[name] = round(at - wall_started, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wait", type=float, default=60.0, help="most seconds to wait for a verdict")
    p.add_argument("--runs", type=int, default=3, help="scorer starts with the default (median)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "env.sh"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PROBEGUARD_")}
        up = subprocess.Popen(
            [str(BIN), "up", "--embedded-redis", "--env-file", str(env_file)],
            env=clean, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            env = read_env(env_file)
            log("stack up; starting the scorer with the packaged default")
            runs = []
            for _ in range(args.runs):
                runs.append(first_verdict(env, True, args.wait))
                log(f"default on: {runs[-1]}")
            timed = sorted((r for r in runs if r["verdict"]), key=lambda r: r["seconds"])
            on = timed[len(timed) // 2] if timed else runs[0]
            on = {**on, "runs_s": [r.get("seconds") for r in runs], "load_avg": os.getloadavg()[0]}
            off = first_verdict(env, False, min(args.wait, 30.0))
            log(f"default off: {off}")
        finally:
            up.terminate()
            up.wait(30)
    print(json.dumps({"question": "seconds from `probeguard score` to a first verdict",
                      "default_on": on, "default_off": off}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
