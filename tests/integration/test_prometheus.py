"""A real Prometheus (Debian's `prometheus`, `make prometheus-deps`) scrapes a scorer, an
updater, `probeguard serve` and the console, evaluates deploy/alerts.yml without errors,
and fires two of its alerts, rebuilt with a short window and a low threshold, on what
the test feeds the scorer: poison messages (dead letters) and reviews left unanswered
(the console's backlog)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import RedisNamespace
from tests.kafka_helpers import produce_raw
from tests.process_helpers import Threaded, wait_until
from tests.registry_helpers import publish_probe
from worker.console.auth import User, hash_password
from worker.console.server import ConsoleServer
from worker.embedded import free_port
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.scorer import Scorer
from worker.serve.server import ModerationServer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "alerts.yml"


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (.ci/run installs it: make prometheus-deps)")
        pytest.skip("needs Debian's prometheus package (make prometheus-deps)")
    return path


def extractor() -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=8)


def chat(mid: str, text: str) -> bytes:
    body = {"message_id": mid, "conversation_id": "c", "text": text}
    return json.dumps({**body, "created_at": "2026-12-01T12:00:00Z"}).encode()


def api(base: str, path: str) -> Any:
    with urllib.request.urlopen(f"{base}/api/v1/{path}", timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


def quick(alert: str, replace: dict[str, str]) -> dict[str, Any]:
    """A rule of deploy/alerts.yml with its window or threshold swapped for one a test can
    reach in seconds, firing at once; labelled ``test: quick``."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r.get("alert") == alert]
    expr = rule["expr"]
    for old, new in replace.items():
        assert old in expr, f"{alert}: {old!r} not in {expr!r}"
        expr = expr.replace(old, new)
    return {**rule, "expr": expr, "for": "0s", "labels": {**rule["labels"], "test": "quick"}}


class Prometheus:
    """``prometheus`` on a free port with a config and data of its own, 1 s scrapes."""

    def __init__(self, workdir: Path, jobs: dict[str, str], rules: list[dict[str, Any]]):
        (workdir / "quick.yml").write_text(
            yaml.safe_dump({"groups": [{"name": "quick", "rules": rules}]})
        )
        shutil.copy(ALERTS, workdir / "alerts.yml")
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": ["alerts.yml", "quick.yml"],
            "scrape_configs": [
                {
                    "job_name": job,
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": [target]}],
                }
                for job, target in jobs.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = workdir / "prometheus.log"

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.log_path.read_text()}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture
def started() -> Iterator[list[Callable[[], None]]]:
    stops: list[Callable[[], None]] = []
    yield stops
    for stop in reversed(stops):
        stop()


def test_prometheus_scrapes_every_role_and_the_alerts_fire(
    settings: Settings,
    redis_ns: RedisNamespace,
    tmp_path: Path,
    started: list[Callable[[], None]],
) -> None:
    s = settings.model_copy(
        update={
            # Every scored message goes to review, and nobody answers: a backlog.
            "review_low": 0.0,
            "review_high": 1.0,
            "group_console": f"console-{settings.group_scorer}",
            "console_port": 0,
            "console_explain": False,
            "serve_port": 0,
            "lease_ttl_ms": 2000,
        }
    )
    ensure_topics(s)
    publish_probe(
        CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity"), extractor().fingerprint
    )

    scorer_port, updater_port = free_port(), free_port()
    scorer = Scorer(s, extractor(), redis_ns.client, metrics_port=scorer_port)
    started.append(Threaded(scorer.run, scorer.stop).stop)
    updater = Updater(
        s.model_copy(update={"metrics_port": updater_port}), extractor(), redis_ns.client
    )
    started.append(Threaded(updater.run, updater.stop).stop)
    serve = ModerationServer(s, extractor(), redis_ns.client, keys=None).start()
    started.append(serve.stop)
    users = {"otto": User("otto", "operator", hash_password("otto-operates-it", n=2**10))}
    console = ConsoleServer(s, users=users, secret_key=b"k" * 32).start()
    started.append(console.stop)

    jobs = {
        "probeguard-scorer": f"127.0.0.1:{scorer_port}",
        "probeguard-updater": f"127.0.0.1:{updater_port}",
        "probeguard-serve": serve.url.removeprefix("http://"),
        "probeguard-console": console.url.removeprefix("http://"),
    }
    rules = [
        quick("ProbeguardScorerDeadLetterRate", {"[10m]": "[30s]"}),
        quick("ProbeguardReviewBacklog", {"> 500": "> 0"}),
    ]
    prometheus = Prometheus(tmp_path, jobs, rules)
    started.append(prometheus.stop)
    wait_until(prometheus.ready, "prometheus to start", timeout_s=30)

    def targets_up() -> bool:
        active = api(prometheus.url, "targets")["activeTargets"]
        return {t["labels"]["job"] for t in active if t["health"] == "up"} == set(jobs)

    wait_until(targets_up, "every role's /metrics scraped", timeout_s=20)

    # Five messages scored and put up for review, five poison ones dead-lettered.
    records = [(f"m-{i}".encode(), chat(f"m-{i}", f"hello number {i}")) for i in range(5)]
    records += [(b"poison", b"not json")] * 5
    produce_raw(s, s.topic_chat, records)
    wait_until(lambda: serve.service.ready()[0], "serve to load the probe", timeout_s=30)
    with urllib.request.urlopen(
        urllib.request.Request(
            f"{serve.url}/v1/moderations",
            data=json.dumps({"input": "hello"}).encode(),
            headers={"Content-Type": "application/json"},
        ),
        timeout=30,
    ) as response:
        assert response.status == 200

    def firing() -> set[str]:
        alerts = api(prometheus.url, "alerts")["alerts"]
        return {
            a["labels"]["alertname"]
            for a in alerts
            if a["state"] == "firing" and a["labels"].get("test") == "quick"
        }

    want = {"ProbeguardScorerDeadLetterRate", "ProbeguardReviewBacklog"}
    wait_until(lambda: firing() == want, f"{sorted(want)} firing", timeout_s=45)
    dead = [
        a
        for a in api(prometheus.url, "alerts")["alerts"]
        if a["labels"]["alertname"] == "ProbeguardScorerDeadLetterRate"
        and a["labels"].get("test") == "quick"
    ]
    assert [a["labels"]["job"] for a in dead] == ["probeguard-scorer"]  # not serve's

    # What was scraped: the serve call, the backlog, and the updater holding its lease.
    def value(query: str) -> float:
        result = api(prometheus.url, "query?query=" + urllib.parse.quote(query))["result"]
        return float(result[0]["value"][1]) if result else float("nan")

    def at_least_one(query: str) -> bool:
        return value(query) >= 1

    for query in (
        'sum(probeguard_serve_requests_total{code="200"})',
        "sum(probeguard_console_review_depth)",
        "max(probeguard_updater_lease_held)",
    ):
        wait_until(functools.partial(at_least_one, query), query, timeout_s=10)

    # Every rule of deploy/alerts.yml evaluates against the real series without error.
    groups = api(prometheus.url, "rules")["groups"]
    evaluated = [r for g in groups for r in g["rules"]]
    real = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert len(evaluated) == len(real) + len(rules)
    assert all(r["health"] == "ok" for r in evaluated), [
        r for r in evaluated if r["health"] != "ok"
    ]
