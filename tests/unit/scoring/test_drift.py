"""Drift statistics (probes.drift): PSI and the standardized mean shift against hand
computations, the reference a checkpoint carries, the scorer's windows and gauges."""

from __future__ import annotations

import json
import math

import pytest
import torch

from probes import build_probe, checkpoint_to_bytes, probe_from_bytes
from probes.checkpoint import CheckpointError
from probes.drift import (
    PSI_FLOOR,
    DriftWindow,
    drift_score,
    mean_shift,
    probe_reference,
    psi,
    reference,
    score_bins,
)
from probes.offline.fit import FitConfig, fit
from probes.probe import Probe
from schemas import DRIFT_BINS, CheckpointManifest, DriftReference, utcnow
from tests.unit.probes.test_fit import spec_for, token_dataset
from tests.unit.synthetic import FINGERPRINT, make_spec, toy_task
from worker.scoring.drift import DriftMonitor
from worker.scoring.metrics import ScorerMetrics
from worker.scoring.served import ServedProbe

KEY = b"drift-test-key-0123456789abcdef!"


def ref(mean: list[float], std: list[float], bins: list[float] | None = None) -> DriftReference:
    return DriftReference(
        examples=10,
        layer_mean=mean,
        layer_std=std,
        score_bins=bins or [0.5, 0.5] + [0.0] * (DRIFT_BINS - 2),
    )


# --- the numbers, by hand ---------------------------------------------------------------


def test_psi_matches_a_hand_computation() -> None:
    # Live 1 of 4 in bin 0 and 3 of 4 in bin 1, training half and half:
    # (0.25 - 0.5) ln(0.25/0.5) + (0.75 - 0.5) ln(0.75/0.5) = 0.25 ln 2 + 0.25 ln 1.5 = 0.25 ln 3
    counts = [1, 3] + [0] * (DRIFT_BINS - 2)
    assert psi([0.5, 0.5] + [0.0] * 8, counts) == pytest.approx(0.25 * math.log(3), rel=1e-12)
    # The same shares: no shift at all.
    assert psi([0.5, 0.5] + [0.0] * 8, [7, 7] + [0] * 8) == pytest.approx(0.0, abs=1e-15)
    # Live mass where training had none counts as a share of PSI_FLOOR there, not ln(0).
    moved = psi([1.0] + [0.0] * 9, [1] + [0] * 8 + [1])
    expected = (0.5 - 1.0) * math.log(0.5 / 1.0) + (0.5 - PSI_FLOOR) * math.log(0.5 / PSI_FLOOR)
    assert moved == pytest.approx(expected, rel=1e-12)
    assert moved > 4  # 0.3466 + 4.2577
    assert psi([0.1] * 10, [0] * 10) == 0.0  # an empty window says nothing
    with pytest.raises(ValueError, match="bins"):
        psi([0.5, 0.5], [1, 2, 3])


def test_mean_shift_is_in_training_standard_deviations() -> None:
    r = ref([1.0, 2.0, 0.5], [0.5, 0.25, 0.0])
    # (2 - 1) / 0.5 = 2; (1.5 - 2) / 0.25 = -2; a layer that never varied: any move is huge
    shift = mean_shift(r, [2.0, 1.5, 0.5])
    assert shift == pytest.approx([2.0, -2.0, 0.0])
    assert mean_shift(r, [1.0, 2.0, 0.5 + 1e-3])[2] == pytest.approx(1e3)
    with pytest.raises(ValueError, match="layers"):
        mean_shift(r, [1.0])


def test_reference_means_stds_and_score_shares_by_hand() -> None:
    spec = make_spec("mean", "single")  # one layer; flag label "toxic" (column 1)
    rms = torch.tensor([[1.0, 2.0, 3.0]])  # [L=1, B=3]
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.8, 0.15, 0.05], [0.0, 0.95, 0.05]])
    got = reference(spec, [(rms, probs, None)])
    assert got is not None and got.examples == 3
    assert got.layer_mean == pytest.approx([2.0])
    assert got.layer_std == pytest.approx([math.sqrt(2 / 3)], rel=1e-5)  # population std
    assert got.score_bins == pytest.approx([1 / 3, 1 / 3] + [0.0] * 7 + [1 / 3])
    # Weighted 2:1:1, as replay weights its balanced classes back to the stream's shares:
    # mean (2 + 2 + 3) / 4 = 1.75; E[r^2] = (2 + 4 + 9) / 4 = 3.75; var 3.75 - 1.75^2 = 0.6875
    weighted = reference(spec, [(rms, probs, torch.tensor([2.0, 1.0, 1.0]))])
    assert weighted is not None
    assert weighted.layer_mean == pytest.approx([1.75])
    assert weighted.layer_std == pytest.approx([math.sqrt(0.6875)], rel=1e-5)
    assert weighted.score_bins == pytest.approx([0.5, 0.25] + [0.0] * 7 + [0.25])
    assert reference(spec, []) is None


def test_drift_score_is_the_flag_labels_highest_else_any_label() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    assert drift_score(make_spec("mean", "single"), probs).tolist() == pytest.approx([0.2, 0.3])
    spec = make_spec("mean", "single")
    no_flags = spec.model_copy(update={"flag_labels": [], "thresholds": {}})
    assert drift_score(no_flags, probs).tolist() == pytest.approx([0.7, 0.6])
    assert score_bins(torch.tensor([0.0, 0.0999, 0.1, 0.55, 1.0])).tolist() == [0, 0, 1, 5, 9]


def test_window_keeps_the_last_messages() -> None:
    w = DriftWindow(layers=2, size=3)
    w.add(torch.tensor([[1.0, 2.0], [10.0, 20.0]]), torch.tensor([0, 1]))
    assert (w.filled, w.layer_sum(), w.counts()[:3]) == (2, [3.0, 30.0], [1, 1, 0])
    w.add(torch.tensor([[3.0, 4.0], [30.0, 40.0]]), torch.tensor([2, 2]))  # drops the first
    assert (w.filled, w.layer_sum(), w.counts()[:3]) == (3, [9.0, 90.0], [0, 1, 2])
    r = ref([2.0, 20.0], [1.0, 10.0], [0.0, 0.5, 0.5] + [0.0] * 7)
    assert w.shift(r) == pytest.approx([1.0, 1.0])  # mean 3 vs 2 (sd 1); 30 vs 20 (sd 10)
    assert w.psi(r) == pytest.approx(
        (1 / 3 - 0.5) * math.log(2 / 3) + (2 / 3 - 0.5) * math.log(4 / 3)
    )
    with pytest.raises(ValueError):
        DriftWindow(layers=1, size=0)


# --- in the checkpoint --------------------------------------------------------------------


def _probe_and_data(seed: int = 0) -> tuple[Probe, torch.Tensor, torch.Tensor]:
    spec = make_spec("mean", "scalar_mix")
    hidden, mask, _ = toy_task(len(spec.layers), "multiclass", n=32, seed=seed)
    return build_probe(spec, seed=0), hidden, mask


def test_the_reference_travels_signed_and_old_manifests_stay_byte_identical() -> None:
    probe, hidden, mask = _probe_and_data()
    drift = probe_reference(probe, [(hidden, mask, None)])
    assert drift is not None and len(drift.layer_mean) == 3
    blob, manifest = checkpoint_to_bytes(
        probe,
        llm=FINGERPRINT,
        version=3,
        signing_key=KEY,
        drift=drift,
    )
    _, loaded = probe_from_bytes(blob, manifest, FINGERPRINT, signing_key=KEY)
    assert loaded.drift == drift
    # The statistics are signed like the rest: changing them breaks the signature.
    data = json.loads(manifest)
    data["drift"]["layer_mean"][0] += 1.0
    with pytest.raises(CheckpointError, match="signature"):
        probe_from_bytes(blob, json.dumps(data), FINGERPRINT, signing_key=KEY)
    # Without statistics the manifest has no "drift" key at all (old readers, old signatures).
    _, plain = checkpoint_to_bytes(probe, llm=FINGERPRINT, version=3)
    assert "drift" not in json.loads(plain)
    assert CheckpointManifest.decode(plain).drift is None


def test_statistics_for_other_layers_are_refused() -> None:
    probe, _, _ = _probe_and_data()
    wrong = ref([1.0], [1.0])  # one layer; the spec reads three
    with pytest.raises(CheckpointError, match="drift"):
        checkpoint_to_bytes(probe, llm=FINGERPRINT, drift=wrong)


def test_fit_records_the_training_splits_statistics() -> None:
    train = token_dataset("multiclass", n=48, seed=1)
    probe = build_probe(spec_for(train, "mean"), seed=0)
    result = fit(probe, train, None, FitConfig(lr=3e-3, max_epochs=2))
    assert result.drift is not None and result.drift.examples == len(train)
    # The training split itself shows no shift against its own statistics.
    h, m, _ = train.batch(torch.arange(len(train)))
    _, pooled = result.probe.predict_proba_pooled(h, m)
    live = pooled.pow(2).mean(-1).sqrt().mean(dim=1).tolist()
    assert mean_shift(result.drift, live) == pytest.approx([0.0] * len(live), abs=1e-4)


# --- the scorer's monitor -------------------------------------------------------------------


def _served(version: int, drift: DriftReference | None) -> ServedProbe:
    probe, _, _ = _probe_and_data()
    blob, manifest = checkpoint_to_bytes(
        probe,
        llm=FINGERPRINT,
        version=version,
        drift=drift,
    )
    loaded, m = probe_from_bytes(blob, manifest, FINGERPRINT)
    return ServedProbe(loaded, m)


def test_monitor_exports_once_the_window_is_full_enough_and_forgets_old_versions() -> None:
    metrics = ScorerMetrics()
    monitor = DriftMonitor(metrics, window=10, min_messages=4)
    r = ref([1.0, 1.0, 1.0], [0.5, 0.5, 0.5], [1.0] + [0.0] * 9)
    v1, old = _served(1, r), _served(7, None)  # v7: written before drift statistics existed

    def sample(name: str, **labels: str) -> float | None:
        return metrics.collector.get_sample_value(name, labels)

    rms = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [1.5, 1.5, 1.5]])  # [L, B]
    scores = torch.tensor([0.05, 0.05, 0.95])
    batch = {("toxicity", 1): (v1, rms, scores), ("toxicity", 7): (old, rms, scores)}
    monitor.observe(batch)  # 3 messages: below the minimum of 4
    assert sample("probeguard_scorer_drift_score_psi", probe="toxicity", version="1") is None
    monitor.observe(batch)  # 6
    shift = sample("probeguard_scorer_drift_mean_shift", probe="toxicity", version="1", layer="1")
    assert shift == pytest.approx((2.0 - 1.0) / 0.5)
    layer4 = sample("probeguard_scorer_drift_mean_shift", probe="toxicity", version="1", layer="4")
    assert layer4 == pytest.approx((1.5 - 1.0) / 0.5)
    # 4 of 6 in bin 0 (training: all), 2 of 6 in bin 9 (training: none)
    want = (4 / 6 - 1) * math.log(4 / 6) + (2 / 6 - PSI_FLOOR) * math.log(2 / 6 / PSI_FLOOR)
    psi_now = sample("probeguard_scorer_drift_score_psi", probe="toxicity", version="1")
    assert psi_now == pytest.approx(want)
    assert sample("probeguard_scorer_drift_window_messages", probe="toxicity", version="1") == 6
    assert sample("probeguard_scorer_drift_score_psi", probe="toxicity", version="7") is None
    (key, snap), *rest = monitor.snapshots(utcnow())
    assert not rest and key == ("toxicity", 1) and snap.messages == 6
    assert snap.layer_sum == pytest.approx([12.0, 6.0, 9.0]) and snap.score_counts[0] == 4
    # v2 replaces v1: v1's series go, so no alert fires on a version nobody serves.
    v2 = _served(2, r)
    monitor.observe({("toxicity", 2): (v2, rms[:, :1], scores[:1])})
    assert sample("probeguard_scorer_drift_score_psi", probe="toxicity", version="1") is None
    assert (
        sample("probeguard_scorer_drift_mean_shift", probe="toxicity", version="1", layer="1")
        is None
    )
    assert list(monitor.windows) == [("toxicity", 2)]


def test_monitor_skips_rows_that_are_not_finite() -> None:
    metrics = ScorerMetrics()
    monitor = DriftMonitor(metrics, window=10, min_messages=1)
    v1 = _served(1, ref([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]))
    rms = torch.tensor([[1.0, float("nan")], [1.0, 1.0], [1.0, 1.0]])
    monitor.observe({("toxicity", 1): (v1, rms, torch.tensor([0.1, 0.1]))})
    assert monitor.windows[("toxicity", 1)].filled == 1
