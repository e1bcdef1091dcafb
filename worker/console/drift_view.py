"""The Probes page's drift plot: the live version's drift per layer, added up over every
scorer's window in Redis (``Keys.drift``, written by :mod:`worker.scoring.drift`).

Scorers store sums (messages, per-layer RMS sums, score counts per bin), so several windows
add up exactly; windows older than :data:`FRESH_S` are left out (a scorer that stopped).
The numbers are those of the gauges (:mod:`probes.drift`); records that do not parse are
skipped, never trusted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from pydantic import ValidationError

from probes.drift import mean_shift, psi
from schemas import DRIFT_BINS, CheckpointManifest, DriftSnapshot, utcnow
from worker.console.charts import BarChart, bar_chart

__all__ = ["FRESH_S", "DriftView", "drift_view"]

FRESH_S = 600.0


@dataclass(frozen=True)
class DriftView:
    version: int | None
    chart: BarChart
    note: str  # what the plot shows, or why there is none
    psi: float | None = None
    drifted: bool = False


def drift_view(
    client: object,
    key: str,
    manifest: CheckpointManifest | None,
    *,
    alert_shift: float,
    alert_psi: float,
) -> DriftView:
    """The drift of the version ``manifest`` describes, from the hash at ``key``."""
    empty = bar_chart([])
    if manifest is None:
        return DriftView(None, empty, "no live version")
    v, ref = manifest.version, manifest.drift
    if ref is None:
        why = "written before drift monitoring, or the packaged default"
        return DriftView(v, empty, f"v{v} carries no training statistics ({why}): no drift")
    raw = client.hgetall(key)  # type: ignore[attr-defined]
    since = utcnow() - timedelta(seconds=FRESH_S)
    messages, scorers = 0, 0
    sums = [0.0] * len(ref.layer_mean)
    counts = [0] * DRIFT_BINS
    for value in raw.values():
        try:
            snap = DriftSnapshot.decode(value)
        except (ValidationError, ValueError):
            continue
        if snap.at < since or len(snap.layer_sum) != len(sums) or snap.messages == 0:
            continue
        scorers += 1
        messages += snap.messages
        sums = [a + b for a, b in zip(sums, snap.layer_sum, strict=True)]
        counts = [a + b for a, b in zip(counts, snap.score_counts, strict=True)]
    if not messages:
        quiet = f"no scorer has reported v{v}'s traffic in the last {FRESH_S / 60:.0f} minutes"
        return DriftView(v, empty, quiet)
    shifts = mean_shift(ref, [s / messages for s in sums])
    layers = [str(layer) for layer in manifest.spec.layers]
    over = {name for name, s in zip(layers, shifts, strict=True) if abs(s) > alert_shift}
    score_psi = psi(ref.score_bins, counts)
    chart = bar_chart(
        [(name, abs(s)) for name, s in zip(layers, shifts, strict=True)],
        y_max=max([alert_shift * 1.5, *(abs(s) for s in shifts)]),
        highlight=over,
    )
    note = (
        f"{messages} recent messages from {scorers} scorer(s) against {ref.examples} training "
        f"examples; score PSI {score_psi:.3f} (alert above {alert_psi:g}); layers over "
        f"{alert_shift:g} SD highlighted"
    )
    return DriftView(v, chart, note, score_psi, bool(over) or score_psi > alert_psi)
