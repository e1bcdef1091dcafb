"""`probeguard up` starts a real broker and Redis, and stops both on SIGTERM / Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from kafka import KafkaConsumer

pytestmark = pytest.mark.integration


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); check its state.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_and_stops_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    env_file = tmp_path / "stack.env"
    env = {k: v for k, v in os.environ.items() if not k.endswith("REDIS_URL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "up", "--env-file", str(env_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not env_file.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in env_file.read_text().split()
            if "=" in line
        )
        bootstrap = exports["PROBEGUARD_KAFKA_BOOTSTRAP"]
        redis_url = exports["PROBEGUARD_REDIS_URL"]

        consumer = KafkaConsumer(bootstrap_servers=bootstrap)
        try:
            assert "chat.messages" in consumer.topics()
            assert consumer.partitions_for_topic("chat.messages") == set(range(6))
        finally:
            consumer.close()
        with redis.Redis.from_url(redis_url) as r:
            assert r.ping()
            info = r.info("server")
        redis_pid = int(info["process_id"])
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        broker_pid = int(children[0])  # tansu is started first

        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "Kafka bootstrap" in out and "Stopping" in out
        assert not env_file.exists()
        time.sleep(0.2)
        assert not _pid_alive(redis_pid) and not _pid_alive(broker_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
