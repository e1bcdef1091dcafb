"""deploy/alerts.yml: promtool accepts it and its unit tests pass (deploy/alerts_test.yml),
every rule is complete (for, severity, what to do), each alert is tested firing and
quiet, and every metric it names is one the code exports.

promtool comes with Debian's `prometheus` package (`make prometheus-deps`, which `make
test` and .ci/run run); without it those two tests skip, except under CI.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from tests.unit.prometheus_helpers import (
    defined,
    drift_thresholds,
    exposed,
    metric_names,
    promtool,
)
from worker.console.metrics import console_metrics
from worker.kafka.runtime import RoleRuntime
from worker.learning.metrics import UpdaterMetrics
from worker.scoring.metrics import ScorerMetrics
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "alerts.yml"
RULE_TESTS = DEPLOY / "alerts_test.yml"
SEVERITIES = {"critical", "warning"}


def run_promtool(*args: str) -> str:
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


# --- promtool ---------------------------------------------------------------------------


def test_promtool_accepts_the_rules() -> None:
    out = run_promtool("check", "rules", str(RULES))
    assert f"SUCCESS: {len(rules())} rules found" in out


def test_promtool_accepts_the_compose_config_with_its_rule_files() -> None:
    out = run_promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    assert "SUCCESS: 1 rule files found" in out


def test_promtool_unit_tests_pass() -> None:
    out = run_promtool("test", "rules", str(RULE_TESTS))
    assert "SUCCESS" in out


# --- the rules, read ----------------------------------------------------------------------


@pytest.mark.parametrize("rule", alerts(), ids=lambda r: r["alert"])
def test_every_alert_waits_says_how_bad_and_what_to_do(rule: dict[str, Any]) -> None:
    assert rule["alert"].startswith("Probeguard")
    assert "for" in rule, "a `for:` keeps one bad scrape from paging"
    assert rule["labels"]["severity"] in SEVERITIES
    notes = rule["annotations"]
    assert notes["summary"].strip() and "\n" not in notes["summary"]
    assert len(notes["description"]) > 150, "the description says what to do"


def test_every_alert_is_tested_firing_and_quiet() -> None:
    config = yaml.safe_load(RULE_TESTS.read_text())
    assert config["rule_files"] == [RULES.name]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in config["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {r["alert"] for r in alerts()}
    assert names - fired == set(), "never seen firing"
    assert names - quiet == set(), "never seen quiet"
    assert (fired | quiet) <= names, "a test of an alert that does not exist"


def test_the_issue_asks_for_these_alerts() -> None:
    """Issue 27: stalls, lag, layer collapse, refusals, rollback, review backlog, dead
    letters and latency each have an alert on the metric that measures it."""
    used = {r["alert"]: metric_names(r["expr"]) for r in alerts()}
    wanted = {
        "ProbeguardPartitionStalled": "probeguard_scorer_stalled_seconds",
        "ProbeguardConsumerLagGrowing": "probeguard_scorer_consumer_lag",
        "ProbeguardLayerWeightCollapse": "probeguard_updater_layer_collapse_alarm",
        "ProbeguardCheckpointRefused": "probeguard_scorer_checkpoints_refused_total",
        "ProbeguardStagePointerRefused": "probeguard_scorer_stage_pointers_refused_total",
        "ProbeguardCanaryRolledBack": "probeguard_updater_stage_changes_total",
        "ProbeguardReviewBacklog": "probeguard_console_review_depth",
        "ProbeguardScorerDeadLetterRate": "probeguard_scorer_dead_letters_total",
        "ProbeguardUpdaterDeadLetterRate": "probeguard_updater_dead_letters_total",
        "ProbeguardScorerLatencyHigh": "probeguard_scorer_verdict_seconds_bucket",
        "ProbeguardServeLatencyHigh": "probeguard_serve_request_seconds_bucket",
        "ProbeguardInputDrift": "probeguard_scorer_drift_mean_shift",
    }
    for alert, metric in wanted.items():
        assert metric in used[alert], alert
    assert "probeguard_updater_stalled_seconds" in used["ProbeguardPartitionStalled"]
    assert "probeguard_scorer_drift_score_psi" in used["ProbeguardInputDrift"]


def test_the_console_marks_drift_where_the_alert_fires() -> None:
    """The console's drift plot marks what ProbeguardInputDrift alerts on: the settings'
    defaults are the rule's thresholds (the fault suite reads them from the rule too)."""
    defaults = Settings()
    assert drift_thresholds() == (defaults.drift_alert_shift, defaults.drift_alert_psi)


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rules_name_only_metrics_the_code_exports(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    assert names, f"no metric found in {rule['expr']!r}"
    assert names <= exposed(), f"not exported by the code: {sorted(names - exposed())}"


# --- the name check itself -------------------------------------------------------------------


def _families(registry: CollectorRegistry) -> dict[str, str]:
    return {m.name: m.type for m in registry.collect()}


def test_the_static_names_match_what_the_registries_export() -> None:
    """The source reading finds what the roles' registries really hold, with the types
    that decide the suffixes (Counter's ``_total``, Histogram's ``_bucket``)."""
    kinds = {"counter": "Counter", "gauge": "Gauge", "histogram": "Histogram"}
    live = _families(ScorerMetrics().collector) | _families(UpdaterMetrics().collector)
    runtime = CollectorRegistry()
    RoleRuntime(Settings(), runtime, role="scorer", worker_id="t", metrics_port=0)
    live |= _families(runtime)
    queue = SimpleNamespace(stats=lambda: SimpleNamespace(depth=3))
    console = console_metrics(queue)  # type: ignore[arg-type]
    assert b"\nprobeguard_console_review_depth 3.0\n" in generate_latest(console)
    assert _families(console_metrics(None)) == {}  # a console without a review queue
    live |= _families(console)
    for name, kind in live.items():
        assert defined().get(name) == kinds[kind], name
    assert "probeguard_updater_stalled_seconds" in defined()  # role="updater" expanded
    assert {"probeguard_serve_requests", "probeguard_serve_request_seconds"} <= set(defined())


def test_the_name_check_bites() -> None:
    names = exposed()
    assert "probeguard_scorer_messages_total" in names
    assert "probeguard_scorer_messages" not in names  # a counter is read as ..._total
    assert "probeguard_scorer_batch_seconds_bucket" in names
    assert "probeguard_scorer_consumer_lag_total" not in names  # a gauge has no suffix
    expr = (
        'histogram_quantile(0.99, sum by (job, le) (rate(probeguard_x_bucket{le="+Inf",'
        ' job=~"a|b"}[5m]))) > 1 and on (instance) probeguard_y offset 1h or vector(0)'
        " unless deriv(sum(probeguard_z)[10m:1m]) > 0 * on (instance) group_left probeguard_w"
    )
    assert metric_names(expr) == {
        "probeguard_x_bucket",
        "probeguard_y",
        "probeguard_z",
        "probeguard_w",
    }
