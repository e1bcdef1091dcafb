"""Calibration of a probe's scores: the per-head temperature and bias, where they apply
(every path from logits to probabilities), how they travel (spec, checkpoint, heads), how
``fit`` fits them out of fold and how the updater refits them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from probes import build_probe, load_checkpoint, save_checkpoint
from probes.calibration import (
    calibrated_probabilities,
    fit_heads,
    probabilities,
    raw_logits,
)
from probes.exit import exit_probabilities
from probes.explain import layer_breakdown
from probes.heads import add_head, remove_head
from probes.metrics import (
    average_precision,
    choose_thresholds,
    evaluate,
    expected_calibration_error,
)
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig
from probes.offline.select import fit_cv
from schemas import ExitSpec, HeadCalibration, HeadSpec, ProbeSpec
from tests.unit.synthetic import FINGERPRINT, NUM_LAYERS, D, make_spec, toy_task
from worker.learning.config import LearningConfig
from worker.learning.online_learner import OnlineLearner


def _binary_spec(**extra: object) -> ProbeSpec:
    return ProbeSpec(
        name="tox",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=D,
        task="multilabel",
        labels=["toxic"],
        flag_labels=["toxic"],
        **extra,  # type: ignore[arg-type]
    )


def _miscalibrated(n: int = 4000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[n, 1]`` three times too confident and shifted by +2 (a class-balanced
    head's habit), and labels drawn from the true probabilities (about 25 % positive)."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(n, 1, generator=g) * 1.5 - 1.5
    y = (torch.rand(n, 1, generator=g) < torch.sigmoid(true)).float()
    return 3.0 * true + 2.0, y


def _nll(probs: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.binary_cross_entropy(probs.clamp(1e-7, 1 - 1e-7), y))


# --- fitting ---------------------------------------------------------------------------------


def test_calibration_lowers_nll_and_ece_and_keeps_auprc() -> None:
    logits, y = _miscalibrated()
    spec = _binary_spec()
    cal = fit_heads(spec, logits, y, labels_seen=7)["tox"]
    assert cal.temperature == pytest.approx(3.0, rel=0.15)  # the truth: T = 3, bias = -2/3
    assert cal.bias[0] == pytest.approx(-2 / 3, abs=0.2) and cal.labels_seen == 7
    raw = probabilities(spec, logits)
    fixed = calibrated_probabilities(spec.model_copy(update={"calibration": {"tox": cal}}), logits)
    assert _nll(fixed, y) < _nll(raw, y) - 0.05
    yn = y.numpy()[:, 0]
    assert expected_calibration_error(yn, fixed.numpy()[:, 0]) < 0.03
    assert expected_calibration_error(yn, raw.numpy()[:, 0]) > 0.1
    # Monotone: the ranking, so AUPRC and recall at 1 % FPR, are unchanged.
    assert average_precision(yn, fixed.numpy()[:, 0]) == average_precision(yn, raw.numpy()[:, 0])


def test_a_two_class_softmax_head_is_calibrated_and_keeps_its_auprc() -> None:
    logits, y = _miscalibrated(seed=1)
    spec = ProbeSpec(
        name="tox",
        token_pool="mean",
        layer_mix="single",
        layers=[1],
        hidden_size=D,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )
    two = torch.cat([torch.zeros_like(logits), logits], dim=1)  # [N, 2]: softmax = sigmoid
    targets = y[:, 0].long()
    cal = fit_heads(spec, two, targets)["tox"]
    assert sum(cal.bias) == pytest.approx(0.0, abs=1e-5)  # softmax: only differences matter
    tuned = spec.model_copy(update={"calibration": {"tox": cal}})
    raw, fixed = probabilities(spec, two), calibrated_probabilities(tuned, two)
    assert F.nll_loss(fixed.log(), targets) < F.nll_loss(raw.log(), targets) - 0.05
    assert evaluate(tuned, fixed, targets)["ece"] < evaluate(spec, raw, targets)["ece"] / 3
    # Monotone too (up to float32 ties where a softmax saturates near 1).
    auprc = evaluate(spec, raw, targets)["auprc"]
    assert evaluate(tuned, fixed, targets)["auprc"] == pytest.approx(auprc, abs=1e-4)


def test_each_head_is_calibrated_on_its_own_rows_and_a_head_without_positives_is_left_out() -> None:
    spec = make_spec("mean", "scalar_mix", "multihead")  # toxicity (toxic) | topic (ok, spam)
    g = torch.Generator().manual_seed(0)
    n = 400
    logits = torch.randn(n, 3, generator=g) * 3
    toxic = (torch.rand(n, generator=g) < torch.sigmoid(logits[:, 0] / 3 - 1)).float()
    spam = (torch.rand(n, generator=g) < torch.softmax(logits[:, 1:] / 3, 1)[:, 1]).long()
    targets = torch.stack([toxic, 1.0 - spam, spam.float()], dim=1)
    targets[: n // 3, 0] = float("nan")  # the first third says nothing of toxicity
    targets[n // 3 : 2 * n // 3, 1:] = float("nan")  # the second nothing of the topic
    both = fit_heads(spec, logits, targets)
    assert set(both) == {"toxicity", "topic"}
    assert both["toxicity"].temperature == pytest.approx(3.0, rel=0.3)
    assert both["topic"].temperature == pytest.approx(3.0, rel=0.3)
    assert len(both["topic"].bias) == 2 and len(both["toxicity"].bias) == 1
    no_spam = targets.clone()
    no_spam[:, 1:] = torch.where(no_spam[:, 1:].isnan(), no_spam[:, 1:], torch.tensor([1.0, 0.0]))
    assert set(fit_heads(spec, logits, no_spam)) == {"toxicity"}
    assert set(fit_heads(spec, logits, targets, min_positives=10_000)) == set()


def test_raw_logits_undo_the_probabilities_and_the_calibration() -> None:
    spec = make_spec("mean", "scalar_mix", "multihead")
    tuned = spec.model_copy(
        update={
            "calibration": {
                "toxicity": HeadCalibration(temperature=2.5, bias=[-1.0]),
                "topic": HeadCalibration(temperature=0.5, bias=[0.3, -0.3]),
            }
        }
    )
    logits = torch.randn(50, 3, generator=torch.Generator().manual_seed(1)) * 3
    back = raw_logits(tuned, calibrated_probabilities(tuned, logits))
    torch.testing.assert_close(back[:, 0], logits[:, 0], atol=1e-4, rtol=1e-4)
    # A softmax head comes back up to a constant per row, which its softmax ignores.
    torch.testing.assert_close(
        torch.softmax(back[:, 1:], 1), torch.softmax(logits[:, 1:], 1), atol=1e-5, rtol=1e-5
    )


# --- where it applies ------------------------------------------------------------------------


def test_every_path_from_logits_to_probabilities_is_calibrated() -> None:
    spec = make_spec("mean", "scalar_mix", "multihead", exit=ExitSpec(layer=1, temperature=2.0))
    calibration = {
        "toxicity": HeadCalibration(temperature=2.0, bias=[-1.5]),
        "topic": HeadCalibration(temperature=0.7, bias=[0.2, -0.2]),
    }
    plain = build_probe(spec, seed=0).eval()
    probe = build_probe(spec.model_copy(update={"calibration": calibration}), seed=0).eval()
    hidden, mask, _ = toy_task(3, "multihead", n=12, seed=2)
    logits = probe.predict_logits_many(hidden, mask)
    served = probe.predict_proba_many(hidden, mask)
    torch.testing.assert_close(served, calibrated_probabilities(probe.spec, logits))
    assert not torch.allclose(served, plain.predict_proba_many(hidden, mask))
    # Uncalibrated: exactly the sigmoid / softmax of before.
    raw = plain.predict_logits_many(hidden, mask)
    expected = torch.sigmoid(raw)
    expected[:, 1:] = torch.softmax(raw[:, 1:], dim=-1)
    assert torch.equal(plain.predict_proba_many(hidden, mask), expected)
    # explain: the mixed verdict is the served one; each layer alone is calibrated too.
    parts = layer_breakdown(probe, hidden, mask)
    torch.testing.assert_close(parts.mixed_probs, served)
    torch.testing.assert_close(parts.probs, calibrated_probabilities(probe.spec, parts.logits))
    # The exit head keeps its own calibration (ExitSpec), not the main probe's.
    states = hidden[0]
    torch.testing.assert_close(
        exit_probabilities(probe, states, mask), exit_probabilities(plain, states, mask)
    )


# --- how it travels --------------------------------------------------------------------------

# ProbeSpec.encode() of this spec before calibration existed (and its sha256): checkpoints,
# digests and signatures over uncalibrated specs must not change.
BEFORE = (
    b'{"schema_version":1,"name":"tox","token_pool":"mean","layer_mix":"scalar_mix",'
    b'"layers":[1,2],"hidden_size":8,"task":"multiclass","labels":["ok","toxic"],'
    b'"flag_labels":["toxic"],"thresholds":{"toxic":0.25},"d_inner":64,"num_heads":4,'
    b'"layer_norm":true,"dropout":0.0}'
)


def test_a_spec_without_calibration_encodes_byte_for_byte_as_before() -> None:
    import hashlib

    spec = ProbeSpec(
        name="tox",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=8,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
        thresholds={"toxic": 0.25},
    )
    assert spec.encode() == BEFORE and ProbeSpec.decode(BEFORE).encode() == BEFORE
    digest = "738871f43ced70c740473e57866f1d29a57793bd9a4433fb67190f998ce58d26"
    assert hashlib.sha256(spec.encode()).hexdigest() == digest
    cal = {"tox": HeadCalibration(temperature=1.7, bias=[0.5, -0.5], labels_seen=3)}
    calibrated = spec.model_copy(update={"calibration": cal})
    raw = calibrated.encode()
    assert b'"calibration":{"tox":{"temperature":1.7,"bias":[0.5,-0.5],"labels_seen":3}}' in raw
    assert ProbeSpec.decode(raw) == calibrated


def test_a_calibration_must_fit_the_heads() -> None:
    data = _binary_spec().model_dump()
    with pytest.raises(ValidationError, match="calibration names head 'other'"):
        ProbeSpec.model_validate({**data, "calibration": {"other": {"bias": [0.0]}}})
    with pytest.raises(ValidationError, match="2 biases for 1 labels"):
        ProbeSpec.model_validate({**data, "calibration": {"tox": {"bias": [0.0, 1.0]}}})
    with pytest.raises(ValidationError):
        ProbeSpec.model_validate({**data, "calibration": {"tox": {"bias": [0], "temperature": 0}}})


def test_a_checkpoint_keeps_the_calibration(tmp_path: Path) -> None:
    spec = make_spec("mean", "scalar_mix").model_copy(update={"thresholds": {"toxic": 0.2}})
    probe = build_probe(spec, seed=0)
    probe.set_calibration({"contract": HeadCalibration(temperature=2.0, bias=[0.1, -0.4, 0.3])})
    probe.set_thresholds({"toxic": 0.3})  # set after: they were chosen on these scores
    key = b"k" * 32
    save_checkpoint(probe, tmp_path / "ck", llm=FINGERPRINT, signing_key=key)
    loaded, manifest = load_checkpoint(tmp_path / "ck", FINGERPRINT, signing_key=key)
    assert loaded.spec == probe.spec and manifest.spec.calibration == probe.spec.calibration
    hidden, mask, _ = toy_task(3, "multiclass", n=8, seed=4)
    torch.testing.assert_close(
        loaded.predict_proba_many(hidden, mask), probe.predict_proba_many(hidden, mask)
    )


def test_heads_added_removed_or_renamed_keep_the_calibration_consistent() -> None:
    probe = build_probe(make_spec("mean", "scalar_mix"), seed=0)
    probe.set_calibration({"contract": HeadCalibration(temperature=2.0, bias=[0.1, -0.4, 0.3])})
    grown = add_head(probe, HeadSpec(name="jailbreak", task="multilabel", labels=["jb"]))
    assert set(grown.spec.calibration) == {"contract"}  # the new head starts uncalibrated
    hidden, mask, _ = toy_task(3, "multiclass", n=8, seed=5)
    torch.testing.assert_close(
        grown.predict_proba_many(hidden, mask)[:, :3], probe.predict_proba_many(hidden, mask)
    )
    grown.rename("other")  # a multi-head probe's heads keep their names
    assert set(grown.spec.calibration) == {"contract"}
    assert remove_head(grown, "contract").spec.calibration == {}
    probe.rename("served")  # a single head is named after its probe
    assert set(probe.spec.calibration) == {"served"}


# --- fit: out of fold ------------------------------------------------------------------------


def _imbalanced(n: int = 240, seed: int = 0) -> ProbeDataset:
    """Cached summaries ``[2, n, D]`` of a binary multilabel task, about 20 % positive."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, 1, generator=g) < 0.2).float()
    direction = torch.randn(D, generator=torch.Generator().manual_seed(9))
    x = torch.randn(2, n, D, generator=g) * 1.5 + 0.6 * y[None, :, :1] * direction
    ids = [f"r{i}" for i in range(n)]
    return ProbeDataset([1, 2], ["toxic"], "multilabel", y, ids, summaries=x)


def test_fit_cv_calibrates_out_of_fold_and_chooses_thresholds_on_the_calibrated_scores() -> None:
    data = _imbalanced()
    spec = _binary_spec()
    config = FitConfig(max_epochs=6, patience=6, lr=3e-3)
    plain, raw_cv = fit_cv(spec, data, config, folds=3)
    result, cv = fit_cv(spec, data, config, folds=3, calibrate=True)
    assert plain.probe.spec.calibration == {} and raw_cv.calibration_report == {}
    assert set(cv.calibration) == {"tox"} and cv.calibration["tox"].labels_seen == len(data)
    assert result.probe.spec.calibration == cv.calibration
    assert result.probe.spec.thresholds == cv.thresholds
    # Thresholds chosen on the calibrated out-of-fold scores, which rank as the raw ones did.
    tuned = spec.model_copy(update={"calibration": cv.calibration})
    assert cv.thresholds == choose_thresholds(tuned, cv.oof_probs, data.targets)
    torch.testing.assert_close(
        cv.oof_probs, calibrated_probabilities(tuned, raw_logits(spec, raw_cv.oof_probs))
    )
    assert cv.oof_report["auprc"] == pytest.approx(raw_cv.oof_report["auprc"], abs=1e-9)
    assert cv.oof_report["f1"] == pytest.approx(raw_cv.oof_report["f1"], abs=1e-9)
    report = cv.calibration_report
    assert report["ece_uncalibrated"] == pytest.approx(raw_cv.oof_report["ece"])
    assert report["ece"] < report["ece_uncalibrated"]  # cross-fitted, so honest


# --- the updater -----------------------------------------------------------------------------


SEED_CALIBRATION = HeadCalibration(temperature=5.0, bias=[2.0, -1.0, -1.0])


def _calibrated_learner(need: int) -> OnlineLearner:
    probe = build_probe(make_spec("mean", "scalar_mix"), seed=0)
    probe.set_calibration({"contract": SEED_CALIBRATION})
    config = LearningConfig(batch_size=8, calibrate_min_positives=need)
    return OnlineLearner(probe, config)


def _feed_and(learner: OnlineLearner) -> OnlineLearner:
    """``learner`` after learning 96 rows of the toy task and calibrating at publish."""
    _feed(learner)
    learner.calibrate()
    return learner


def _feed(learner: OnlineLearner, n: int = 96) -> None:
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=n, seed=1)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1]
    for start in range(0, n, 8):
        part = slice(start, start + 8)
        learner.learn(hidden[:, part], mask[part], y[part], y[part].tolist())


def test_the_updater_refits_the_calibration_on_its_window_with_the_thresholds() -> None:
    learner = _feed_and(_calibrated_learner(need=5))
    spec = learner.probe.spec
    cal = spec.calibration["contract"]
    assert cal.temperature != 5.0 and cal.labels_seen == learner.counters.labels_seen == 96
    assert learner.metrics()["calibration_age/contract"] == 0.0
    logits, targets = learner.prequential.logit_window()  # type: ignore[misc]
    probs = calibrated_probabilities(spec, logits)
    expected = choose_thresholds(spec, probs, targets, min_positives=5)
    assert spec.thresholds == expected and set(expected) == {"toxic"}
    # The refit fits the window better than the calibration it replaced.
    before = spec.model_copy(update={"calibration": {"contract": SEED_CALIBRATION}})
    nll = F.nll_loss(probs.log(), targets)
    assert nll < F.nll_loss(calibrated_probabilities(before, logits).log(), targets)


def test_without_the_evidence_the_updater_keeps_calibration_and_thresholds_and_says_how_old() -> (
    None
):
    learner = _calibrated_learner(need=10_000)
    learner.probe.set_thresholds({"toxic": 0.4})
    _feed_and(learner)
    assert learner.probe.spec.calibration["contract"].temperature == 5.0
    assert learner.probe.spec.thresholds == {"toxic": 0.4}
    assert learner.metrics()["calibration_age/contract"] == 96.0


def test_the_updater_gives_no_calibration_to_a_probe_without_one() -> None:
    learner = OnlineLearner(
        build_probe(make_spec("mean", "scalar_mix"), seed=0),
        LearningConfig(batch_size=8, calibrate_min_positives=5),
    )
    _feed_and(learner)
    assert learner.probe.spec.calibration == {} and set(learner.probe.spec.thresholds) == {"toxic"}
    assert not any(k.startswith("calibration_age") for k in learner.metrics())
    assert "prequential_ece" in learner.metrics()
