"""Drift monitoring in a scorer: a window of live messages per served version, compared with
the training statistics its checkpoint carries (:mod:`probes.drift`).

After each batch :meth:`DriftMonitor.observe` adds the rows every version scored (live and
canary alike: the same traffic, each against its own training data) and sets the gauges
``probeguard_scorer_drift_mean_shift{probe,version,layer}`` and
``probeguard_scorer_drift_score_psi{probe,version}`` once a window holds
``drift_min_messages``. A version without statistics (a checkpoint written before they
existed, the packaged default) reports nothing; a version no longer served loses its series,
so an alert never fires on a stale number. Every few seconds :meth:`snapshots` hands the
window sums to the engine, which stores them in Redis (``Keys.drift``) for the console to
add up across scorers.
"""

from __future__ import annotations

import contextlib
import time
from datetime import datetime

import torch
from prometheus_client import Gauge

from probes.drift import DriftWindow, score_bins
from schemas import DriftSnapshot
from worker.scoring.metrics import ScorerMetrics
from worker.scoring.served import ServedProbe

__all__ = ["SNAPSHOT_EVERY_S", "DriftMonitor"]

SNAPSHOT_EVERY_S = 10.0  # how often a scorer shares its windows through Redis

Key = tuple[str, int]  # (probe, version)


class DriftMonitor:
    """The drift windows and gauges of one scorer."""

    def __init__(self, metrics: ScorerMetrics, *, window: int, min_messages: int) -> None:
        self.metrics = metrics
        self.size = window
        self.min_messages = min(min_messages, window)
        self.windows: dict[Key, DriftWindow] = {}
        self.layers: dict[Key, tuple[int, ...]] = {}
        self._shared = 0.0

    def observe(self, drift: dict[Key, tuple[ServedProbe, torch.Tensor, torch.Tensor]]) -> None:
        """One batch's ``BatchScores.drift``; versions absent from a batch that scored
        something are no longer served and are forgotten."""
        for key, (served, rms, scores) in drift.items():
            ref = served.manifest.drift
            if ref is None:
                continue
            window = self.windows.get(key)
            if window is None:
                window = self.windows[key] = DriftWindow(len(served.probe.layers), self.size)
                self.layers[key] = served.probe.layers
            finite = torch.isfinite(rms).all(dim=0) & torch.isfinite(scores)  # [B]
            window.add(rms[:, finite], score_bins(scores[finite]))
            if window.filled >= self.min_messages:
                self._export(key, served, window)
        if drift:
            for key in set(self.windows) - set(drift):
                self._forget(key)

    def _export(self, key: Key, served: ServedProbe, window: DriftWindow) -> None:
        ref = served.manifest.drift
        assert ref is not None
        probe, version = key[0], str(key[1])
        for layer, shift in zip(self.layers[key], window.shift(ref), strict=True):
            self.metrics.drift_shift.labels(probe, version, str(layer)).set(shift)
        self.metrics.drift_psi.labels(probe, version).set(window.psi(ref))
        self.metrics.drift_messages.labels(probe, version).set(window.filled)

    def _forget(self, key: Key) -> None:
        self.windows.pop(key, None)
        probe, version = key[0], str(key[1])
        for layer in self.layers.pop(key, ()):
            _remove(self.metrics.drift_shift, probe, version, str(layer))
        _remove(self.metrics.drift_psi, probe, version)
        _remove(self.metrics.drift_messages, probe, version)

    def snapshots(self, now: datetime) -> list[tuple[Key, DriftSnapshot]]:
        """The windows' sums to store, at most every ``SNAPSHOT_EVERY_S`` (else none)."""
        if time.monotonic() - self._shared < SNAPSHOT_EVERY_S:
            return []
        self._shared = time.monotonic()
        return [
            (
                key,
                DriftSnapshot(
                    at=now,
                    messages=w.filled,
                    layer_sum=w.layer_sum(),
                    score_counts=w.counts(),
                ),
            )
            for key, w in self.windows.items()
            if w.filled
        ]


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never exported (the window stayed below its minimum)
        gauge.remove(*labels)
