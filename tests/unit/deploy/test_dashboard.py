"""deploy/grafana-dashboard.json: it has the panels operators asked for, its queries name
only metrics the code exports, and (with promtool) every query parses as PromQL."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.prometheus_helpers import exposed, metric_names, promtool

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana-dashboard.json"
# Issue 27: msg/s, p99 latency, lag, stalled, versions served, flags by probe, dead
# letters, reviews, refusals, serve requests by code; drift (item 4).
WANTED = {
    "Messages scored /s": "probeguard_scorer_messages_total",
    "p99 latency": "probeguard_serve_request_seconds_bucket",
    "Consumer lag (chat topic)": "probeguard_scorer_consumer_lag",
    "Stalled batches": "probeguard_updater_stalled_seconds",
    "Probe versions served": "probeguard_scorer_probe_version",
    "Flags by probe /s": "probeguard_scorer_flags_total",
    "Dead letters /s": "probeguard_scorer_dead_letters_total",
    "Reviews /s": "probeguard_scorer_reviews_total",
    "Review backlog": "probeguard_console_review_depth",
    "Refusals": "probeguard_scorer_checkpoints_refused_total",
    "Serve requests by code /s": "probeguard_serve_requests_total",
    "Input drift": "probeguard_scorer_drift_mean_shift",
}
# Grafana's own variables, replaced by a duration before the PromQL is parsed.
GRAFANA_RANGES = re.compile(r"\$__(rate_interval|interval|range)\b")


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels() -> list[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    out: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return [p for p in out if p.get("type") != "row"]


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p.get("targets", [])]


def test_the_wanted_panels_are_there() -> None:
    by_title = {p["title"]: p for p in panels()}
    for title, metric in WANTED.items():
        assert title in by_title, title
        used = set().union(*(metric_names(t["expr"]) for t in by_title[title]["targets"]))
        assert metric in used, title


def test_panels_are_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "probeguard" and board["title"]
    (variable,) = board["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels():
        assert p["datasource"]["uid"] == "${" + variable["name"] + "}", p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
        assert p["targets"] and p.get("description"), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


@pytest.mark.parametrize("title, expr", queries(), ids=[f"{t}:{e[:40]}" for t, e in queries()])
def test_queries_name_only_metrics_the_code_exports(title: str, expr: str) -> None:
    names = metric_names(expr)
    assert names, f"{title}: no metric in {expr!r}"
    assert names <= exposed(), f"{title}: not exported by the code: {sorted(names - exposed())}"


def test_queries_parse(tmp_path: Path) -> None:
    """Each query as a recording rule, through `promtool check rules` (PromQL's parser)."""
    tool = promtool()
    rules = [
        {"record": f"dashboard:query_{i}", "expr": GRAFANA_RANGES.sub("5m", expr)}
        for i, (_, expr) in enumerate(queries())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
