"""For the tests of deploy/alerts.yml and deploy/grafana-dashboard.json
(tests/unit/deploy/test_alerts.py, tests/unit/deploy/test_dashboard.py): the Prometheus
names the code exports, read from its source; the metric names a PromQL expression uses; promtool.

Read statically, so a metric defined anywhere under ``worker/`` counts without starting
the role that defines it: every ``Counter``/``Gauge``/``Histogram``/``Summary`` call with a
literal name, and ``f"probeguard_{role}_..."`` expanded over the ``role=`` of every
``RoleRuntime(...)`` call.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What prometheus_client exposes for a metric family, by type (OpenMetrics' _created too).
SUFFIXES = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "Summary": ("", "_sum", "_count", "_created"),
}
# Series Prometheus adds to every target itself.
SCRAPE_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_IDENT = re.compile(r"(?<![\w:$.])[a-zA-Z_:][\w:]*")


def _callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _roles(trees: list[ast.Module]) -> set[str]:
    return {
        str(kw.value.value)
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _callee(node) == "RoleRuntime"
        for kw in node.keywords
        if kw.arg == "role" and isinstance(kw.value, ast.Constant)
    }


def _names(arg: ast.expr, roles: set[str]) -> list[str]:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr):
        parts = [p.value if isinstance(p, ast.Constant) else None for p in arg.values]
        holes = [p for p in arg.values if isinstance(p, ast.FormattedValue)]
        if len(holes) == 1 and ast.unparse(holes[0].value) == "role":
            return ["".join(str(p) if p is not None else role for p in parts) for role in roles]
    raise AssertionError(f"a metric name the check cannot read: {ast.unparse(arg)}")


@cache
def defined() -> dict[str, str]:
    """Metric family name -> type, for every metric the code under ``worker/`` defines."""
    trees = [ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / "worker").rglob("*.py"))]
    roles = _roles(trees)
    found: dict[str, str] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _callee(node) in SUFFIXES and node.args:
                for name in _names(node.args[0], roles):
                    found[name.removesuffix("_total")] = str(_callee(node))
    return found


def exposed() -> set[str]:
    """Every series name a scrape of the roles can return."""
    return {
        name + suffix for name, kind in defined().items() for suffix in SUFFIXES[kind]
    } | SCRAPE_SERIES


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (an approximation that holds for the
    expressions here: identifiers outside strings and label matchers that are not
    followed by ``(`` nor inside ``by (...)``-style label lists, and not keywords)."""
    text = _MATCHERS.sub("{}", _STRING.sub('""', expr))
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges and subqueries: [10m:1m]
    words = {m.group(0) for m in _IDENT.finditer(text) if not _is_call(text, m.end())}
    keywords = {"and", "or", "unless", "bool", "offset", "group_left", "group_right"}
    keywords |= {"inf", "nan", "Inf", "NaN"}
    return {w for w in words if w not in keywords and not re.fullmatch(r"\d\w*", w)}


def _is_call(text: str, end: int) -> bool:
    return text[end:].lstrip().startswith("(")


def promtool() -> str:
    """promtool's path; skips the test without it, except under CI (which installs it)."""
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed (.ci/run installs it: make prometheus-deps)")
        pytest.skip("needs promtool from Debian's prometheus package (make prometheus-deps)")
    return path


def drift_thresholds() -> tuple[float, float]:
    """The mean-shift and PSI thresholds of deploy/alerts.yml's ProbeguardInputDrift rule,
    as Prometheus reads them (tests compare the gauges and the console with them)."""
    import yaml

    rules = [
        r
        for g in yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    ]
    expr = next(r["expr"] for r in rules if r.get("alert") == "ProbeguardInputDrift")
    shift = re.search(r"abs\(probeguard_scorer_drift_mean_shift\)\)\s*>\s*([\d.]+)", expr)
    psi = re.search(r"\(probeguard_scorer_drift_score_psi\)\s*>\s*([\d.]+)", expr)
    assert shift is not None and psi is not None, expr
    return float(shift[1]), float(psi[1])
