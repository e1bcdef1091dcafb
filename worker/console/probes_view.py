"""The Probes page's data: versions and stages, the canary's trial against the rules,
evidence per head of a multi-head probe, metrics over versions, layer weights, history.

Everything comes from the functions ``probeguard probe status`` uses
(:func:`worker.rollout.status.gather`) and from the rollout policy itself
(:func:`worker.rollout.policy.next_action` on the current situation), so the page shows
what the CLI shows and what the policy would do now, with the same numbers.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

from probes.errors import ProbeError
from worker.console.charts import BarChart, LineChart, bar_chart, line_chart
from worker.console.drift_view import DriftView, drift_view
from worker.console.explainer import Explainer
from worker.errors import ProbeguardError, RegistryError
from worker.rollout.changes import Rollout
from worker.rollout.policy import Policy, RolloutDecision, next_action
from worker.rollout.status import StatusReport, VersionRow, gather, head_columns
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore

__all__ = ["ProbePage", "Progress", "probe_page"]


@dataclass(frozen=True)
class Progress:
    """One rule of the trial: how far the evidence is towards its threshold."""

    rule: str
    value: float
    threshold: float
    text: str
    met: bool


@dataclass(frozen=True)
class ProbePage:
    status: StatusReport
    policy: Policy
    decision: RolloutDecision
    progress: list[Progress]
    metrics_chart: LineChart
    entropy_chart: LineChart
    flag_chart: BarChart
    weights_chart: BarChart
    weights_version: int | None
    entropy_now: float | None
    history: list[Any]  # CheckpointEvent, newest first
    weights_error: str = ""
    # Live's and the canary's evidence per head (multi-head probes): the versions, the heads
    head_versions: tuple[VersionRow, ...] = ()
    head_names: tuple[str, ...] = ()
    drift: DriftView | None = None  # the live version's drift per layer


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _progress(policy: Policy, decision: RolloutDecision, canary: Any) -> list[Progress]:
    """The trial's rules as bars (see the rules in worker.rollout.policy)."""
    if canary is None:
        return []
    n = decision.numbers
    labels = canary.evidence.labels.labeled
    msgs = canary.evidence.scored
    rows = [
        Progress(
            "labels to promote",
            labels,
            policy.promote_min_labels,
            f"{labels} / {policy.promote_min_labels} labels on its messages",
            labels >= policy.promote_min_labels,
        ),
        Progress(
            "labels for the F1 rollback rule",
            labels,
            policy.rollback_min_labels,
            f"{labels} / {policy.rollback_min_labels} labels",
            labels >= policy.rollback_min_labels,
        ),
        Progress(
            "messages for the flag-rate rule",
            msgs,
            policy.rollback_min_messages,
            f"{msgs} / {policy.rollback_min_messages} messages",
            msgs >= policy.rollback_min_messages,
        ),
    ]
    gap = n.get("f1_gap")
    if isinstance(gap, int | float):
        rows.append(
            Progress(
                "F1 gap to live",
                float(gap),
                policy.rollback_delta,
                f"live F1 − canary F1 = {gap:+.3f}; promote if ≤ ε={policy.promote_epsilon:g}, "
                f"roll back if > δ={policy.rollback_delta:g}",
                float(gap) <= policy.promote_epsilon,
            )
        )
    head_factor, head = n.get("head_flag_rate_factor"), n.get("worst_head")
    if isinstance(head_factor, int | float):
        rows.append(
            Progress(
                "worst head's flag-rate factor",
                float(head_factor),
                policy.rollback_flag_rate_factor,
                f"head {head}: flag rates differ by ×{head_factor:.2f}; roll back above "
                f"k={policy.rollback_flag_rate_factor:g}",
                float(head_factor) <= policy.rollback_flag_rate_factor,
            )
        )
    factor = n.get("flag_rate_factor")
    if isinstance(factor, int | float):
        rows.append(
            Progress(
                "flag-rate factor",
                float(factor),
                policy.rollback_flag_rate_factor,
                f"flag rates differ by ×{factor:.2f}; roll back above "
                f"k={policy.rollback_flag_rate_factor:g}",
                float(factor) <= policy.rollback_flag_rate_factor,
            )
        )
    return rows


def probe_page(
    registry: CheckpointRegistry,
    evidence: EvidenceStore,
    settings: Settings,
    explainer: Explainer | None,
    *,
    limit: int = 12,
) -> ProbePage:
    status = gather(registry, evidence, limit=limit, settings=settings)
    policy = Policy.from_settings(settings)
    decision = next_action(policy, Rollout(registry, evidence, actor="console").situation())
    canary = next((r for r in status.rows if r.stage == "canary"), None)

    versions = registry.versions()[-40:]
    manifests = {}
    for v in versions:
        try:
            manifests[v] = registry.manifest(v)
        except RegistryError:
            continue
    xs = sorted(manifests)
    metric = {v: manifests[v].metrics for v in xs}
    metrics_chart = line_chart(
        xs,
        {
            "prequential F1": [_num(metric[v].get("prequential_f1")) for v in xs],
            "prequential AUPRC": [_num(metric[v].get("prequential_auprc")) for v in xs],
        },
        y_range=(0.0, 1.0),
    )
    entropy = [_num(metric[v].get("layer_entropy")) for v in xs]
    entropy_chart = line_chart(xs, {"layer-weight entropy (nats)": entropy})
    rows = sorted(status.rows, key=lambda r: r.version)
    flag_chart = bar_chart(
        [(f"v{r.version}", _num(r.evidence.flag_rate)) for r in rows],
        y_max=max([1e-9, *(r.evidence.flag_rate for r in rows if r.evidence.scored)]),
        highlight={f"v{status.stages.live}"} if status.stages.live else None,
        fmt=".0%",
    )
    shown = status.stages.live or (xs[-1] if xs else None)
    weights_chart, weights_error = bar_chart([]), ""
    if shown is not None and explainer is not None:
        try:
            pairs = explainer.layer_weights(registry.probe, shown)
            weights_chart = bar_chart([(str(layer), w) for layer, w in pairs])
        except (ProbeguardError, ProbeError) as exc:  # a broken blob: say why (our words)
            weights_error = f"v{shown}: {exc}"
        except Exception as exc:  # e.g. Redis: its text may name the server's address
            weights_error = f"v{shown}: could not be read ({type(exc).__name__})"
    history = [e for _, e in registry.history(200) if e.kind != "published"][-30:][::-1]
    head_versions, head_names = head_columns(status)
    live = status.stages.live
    live_manifest = manifests.get(live) if live else None
    if live and live_manifest is None:
        with contextlib.suppress(RegistryError):  # the plot says "no live version"
            live_manifest = registry.manifest(live)
    drift = drift_view(
        registry.client,
        registry.keys.drift(registry.probe, live or 0),
        live_manifest,
        alert_shift=settings.drift_alert_shift,
        alert_psi=settings.drift_alert_psi,
    )
    return ProbePage(
        status=status,
        policy=policy,
        decision=decision,
        progress=_progress(policy, decision, canary),
        metrics_chart=metrics_chart,
        entropy_chart=entropy_chart,
        flag_chart=flag_chart,
        weights_chart=weights_chart,
        weights_version=shown,
        entropy_now=_num(metric[shown].get("layer_entropy")) if shown in metric else None,
        history=history,
        weights_error=weights_error,
        head_versions=tuple(head_versions),
        head_names=tuple(head_names),
        drift=drift,
    )
