"""Multi-head probes: one pooling and layer mix, several named heads, rows that annotate
only some heads (the rest unknown, never negative)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from probes import ProbeError, build_probe, decide, encode_target, encode_targets
from probes.learner import Learner
from probes.metrics import choose_thresholds, evaluate, recall_at_fpr
from probes.offline.multitask import SourceHeads, multitask_targets
from probes.targets import annotated, head_targets
from schemas import HeadSpec, HumanLabel, ProbeSpec, utcnow
from tests.unit.synthetic import make_spec, toy_task
from worker.learning.labels import flag_truths
from worker.offline.default_recipe import default_spec

NAN = float("nan")
DEFAULT = default_spec(8, [1], noncommercial=True)  # the packaged default's heads


def _default_cols(targets: torch.Tensor, *labels: str) -> list[list[float]]:
    idx = [DEFAULT.labels.index(x) for x in labels]
    return targets[:, idx].nan_to_num(-1.0).tolist()


def heads_spec(**extra: object) -> ProbeSpec:
    return make_spec("mean", "scalar_mix", "multihead", **extra)


def test_the_flat_view_is_filled_in_and_checked() -> None:
    spec = heads_spec()
    assert spec.labels == ["toxic", "ok", "spam"] and spec.task == "multilabel"
    assert [h.name for h in spec.head_specs] == ["toxicity", "topic"]
    assert spec.head_columns("topic") == slice(1, 3)
    assert spec.head_of("spam").name == "topic"
    view = spec.head_view("topic")
    assert (view.task, view.labels, view.heads) == ("multiclass", ["ok", "spam"], [])
    with pytest.raises(ValidationError, match="head order"):
        ProbeSpec.model_validate({**spec.model_dump(), "labels": ["ok", "spam", "toxic"]})
    with pytest.raises(ValidationError, match="must not repeat"):
        data = {k: v for k, v in spec.model_dump().items() if k != "labels"}
        ProbeSpec.model_validate({**data, "heads": [spec.heads[0].model_dump()] * 2})
    with pytest.raises(ValueError, match="no head 'nope'"):
        spec.head("nope")


def test_single_head_specs_serialize_as_before_heads_existed() -> None:
    spec = make_spec("mean", "scalar_mix", "multiclass")
    assert b'"heads"' not in spec.encode()
    assert spec.head_specs == [HeadSpec(name="contract", task="multiclass", labels=spec.labels)]
    assert ProbeSpec.model_validate_json(heads_spec().encode()) == heads_spec()


def test_a_label_for_one_head_leaves_the_others_unknown() -> None:
    spec = heads_spec()
    target, bucket = encode_target(spec, ["spam"], head="topic")
    torch.testing.assert_close(target, torch.tensor([NAN, 0.0, 1.0]), equal_nan=True)
    assert bucket == 2
    negative, _ = encode_target(spec, [], head="toxicity")
    torch.testing.assert_close(negative, torch.tensor([0.0, NAN, NAN]), equal_nan=True)
    # Without a head: only the heads it names a label of; never a negative for the others.
    whole, _ = encode_target(spec, ["toxic", "ok"])
    torch.testing.assert_close(whole, torch.tensor([1.0, 1.0, 0.0]))
    only_topic, _ = encode_target(spec, ["ok"])
    torch.testing.assert_close(only_topic, torch.tensor([NAN, 1.0, 0.0]), equal_nan=True)
    with pytest.raises(ProbeError, match="annotate no head"):
        encode_target(spec, [])
    with pytest.raises(ProbeError, match="not among head 'toxicity'"):
        encode_target(spec, ["spam"], head="toxicity")
    with pytest.raises(ProbeError, match="exactly one label"):
        encode_target(spec, ["ok", "spam"], head="topic")
    with pytest.raises(ProbeError, match="no head 'tox'"):
        encode_target(spec, ["toxic"], head="tox")
    targets = encode_targets(spec, [["toxic"], ["toxic", "spam"]])
    assert annotated(spec, targets)["topic"].tolist() == [False, True]
    assert annotated(spec, targets)["toxicity"].tolist() == [True, True]
    assert head_targets(spec, targets, "topic").tolist() == [1]


def test_an_exhaustive_label_is_a_negative_for_every_head_it_leaves_blank() -> None:
    spec = heads_spec()
    # A reviewer who judged every head: nothing applies is a negative, not "unknown"...
    nothing, _ = encode_target(spec, [], exhaustive=True)
    # ...but a multiclass head with two classes that do not flag stays unknown.
    torch.testing.assert_close(nothing, torch.tensor([0.0, NAN, NAN]), equal_nan=True)
    topic, _ = encode_target(spec, ["spam"], exhaustive=True)
    torch.testing.assert_close(topic, torch.tensor([0.0, 0.0, 1.0]))
    binary = ProbeSpec.model_validate(
        {
            **{k: v for k, v in spec.model_dump().items() if k != "labels"},
            "flag_labels": ["toxic", "spam"],
        }
    )
    calm, _ = encode_target(binary, [], exhaustive=True)
    torch.testing.assert_close(calm, torch.tensor([0.0, 1.0, 0.0]))  # topic: its calm class
    with pytest.raises(ValidationError, match="cannot also be 'exhaustive'"):
        HumanLabel(
            message_id="m",
            head="topic",
            labels=[],
            exhaustive=True,
            labeler_id="r",
            created_at=utcnow(),
        )
    plain = HumanLabel(message_id="m", labels=[], labeler_id="r", created_at=utcnow())
    assert b"exhaustive" not in plain.encode()  # old consumers see the same bytes


def test_an_exhaustive_no_is_a_flag_truth_and_a_plain_one_is_not() -> None:
    spec = heads_spec()
    now = utcnow()
    said = flag_truths(
        spec,
        [
            HumanLabel(
                message_id="judged", exhaustive=True, labels=[], labeler_id="r", created_at=now
            ),
            HumanLabel(message_id="plain", labels=[], labeler_id="r", created_at=now),
        ],
    )
    assert said == [("judged", False)]


def test_unannotated_heads_add_nothing_to_the_loss_or_the_gradient() -> None:
    spec = heads_spec()
    probe = build_probe(spec, seed=0)
    hidden, mask, y = toy_task(len(spec.layers), "multihead", n=12)
    learner = Learner(probe)
    logits = probe(hidden, mask).detach().requires_grad_(True)
    loss = learner.loss(logits, y)
    assert torch.isfinite(loss)
    # Whatever the logits say where no one annotated, the loss is the same.
    moved = logits.detach().clone()
    moved[y.isnan()] += 5.0
    torch.testing.assert_close(learner.loss(moved, y), loss.detach())
    # A row with its topic unknown gives the topic columns no gradient, its toxicity some.
    loss.backward()
    assert logits.grad is not None
    row = int(y[:, 1].isnan().nonzero()[0])
    assert logits.grad[row, 1:].abs().sum() == 0 and logits.grad[row, 0] != 0
    # A multi-head probe learns every head from rows that each annotate only one or two.
    before = float(learner.loss(probe(hidden, mask), y).detach())
    for _ in range(30):
        learner.learn_many(hidden, mask, y)
    assert float(learner.loss(probe(hidden, mask), y).detach()) < before


def test_a_batch_that_annotates_no_head_makes_no_step() -> None:
    # A source's rows may annotate no head at all (AILuminate's specialized-advice prompts):
    # a mini-batch of only such rows (an epoch's last one, say) has nothing to learn; it
    # once read loss 0/0 = NaN and failed the whole fit.
    spec = heads_spec()
    probe = build_probe(spec, seed=0)
    hidden, mask, y = toy_task(len(spec.layers), "multihead", n=4)
    learner = Learner(probe)
    before = {k: v.clone() for k, v in probe.state_dict().items()}
    assert learner.learn_many(hidden, mask, torch.full_like(y, float("nan"))) == 0.0
    assert learner.steps == 0 and learner.examples == 0
    for name, value in probe.state_dict().items():
        torch.testing.assert_close(value, before[name])
    learner.learn_many(hidden, mask, y)  # a batch with labels still steps
    assert learner.steps == 1


def test_a_multiclass_head_takes_a_softmax_of_its_own_and_decides_one_class() -> None:
    spec = heads_spec(thresholds={"toxic": 0.3})
    probe = build_probe(spec, seed=0)
    hidden, mask, _ = toy_task(len(spec.layers), "multihead", n=8)
    probs = probe.predict_proba_many(hidden, mask)
    torch.testing.assert_close(probs[:, 1:].sum(dim=1), torch.ones(8))
    d = decide(spec, probs)
    assert (d.predicted[:, 1:].sum(dim=1) == 1).all()  # one topic per row
    assert d.predicted[:, 0].tolist() == (probs[:, 0] >= 0.3).tolist()
    assert d.flagged.tolist() == d.predicted[:, 0].tolist()
    assert d.head_flags(spec)["toxicity"].tolist() == d.flagged.tolist()
    assert not d.head_flags(spec)["topic"].any()


def test_each_head_is_measured_on_the_rows_that_annotate_it() -> None:
    spec = heads_spec()
    probs = torch.tensor([[0.9, 0.2, 0.8], [0.1, 0.7, 0.3], [0.8, 0.4, 0.6], [0.2, 0.6, 0.4]])
    y = torch.tensor([[1.0, NAN, NAN], [0.0, 1.0, 0.0], [NAN, 0.0, 1.0], [NAN, 1.0, 0.0]])
    report = evaluate(spec, probs, y)
    assert report["heads"]["toxicity"]["n"] == 2 and report["heads"]["topic"]["n"] == 3
    assert report["heads"]["toxicity"]["auprc"] == 1.0  # the unknown rows did not count
    assert report["auprc"] == pytest.approx(
        (report["heads"]["toxicity"]["auprc"] + report["heads"]["topic"]["auprc"]) / 2
    )
    thresholds = choose_thresholds(spec, probs, y)
    assert set(thresholds) == {"toxic"}  # the topic head has no flag label: arg-max


def test_recall_at_one_percent_false_positives() -> None:
    import numpy as np

    y = np.array([0] * 100 + [1] * 10)
    s = np.concatenate([np.linspace(0, 0.5, 100), np.linspace(0.45, 0.9, 10)])
    assert recall_at_fpr(y, s, 0.01) == pytest.approx(0.9)  # one negative above 0.45


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_a_multi_head_checkpoint_round_trips(weights: str) -> None:
    from probes import checkpoint_to_bytes, probe_from_bytes
    from tests.unit.synthetic import FINGERPRINT

    spec = make_spec("mha", "scalar_mix", "multihead", thresholds={"toxic": 0.3})
    probe = build_probe(spec, seed=0).eval()
    hidden, mask, _ = toy_task(len(spec.layers), "multihead", n=8)
    blob, manifest = checkpoint_to_bytes(probe, llm=FINGERPRINT, weights=weights)  # type: ignore[arg-type]
    loaded, _ = probe_from_bytes(blob, manifest, FINGERPRINT)
    assert loaded.spec == spec and loaded.spec.heads == spec.heads
    tol = 1e-6 if weights == "fp32" else 2e-2
    torch.testing.assert_close(
        loaded.predict_proba_many(hidden, mask),
        probe.predict_proba_many(hidden, mask),
        atol=tol,
        rtol=0,
    )


def test_the_layer_breakdown_of_a_multi_head_probe_keeps_each_heads_own_softmax() -> None:
    from probes.explain import layer_breakdown

    spec = heads_spec()
    probe = build_probe(spec, seed=0).eval()
    hidden, mask, _ = toy_task(len(spec.layers), "multihead", n=4)
    parts = layer_breakdown(probe, hidden, mask)
    torch.testing.assert_close(parts.probs[..., 1:].sum(dim=-1), torch.ones(len(spec.layers), 4))
    assert not torch.allclose(parts.probs[..., 0] + parts.probs[..., 1], torch.ones(1))


def test_multitask_targets_reads_an_empty_map_as_a_multiclass_heads_calm_class() -> None:
    source = SourceHeads("s", {"toxicity": {"a": ["toxic"], "b": []}})
    t = multitask_targets(DEFAULT, source, [frozenset({"a"}), frozenset({"b"}), frozenset({"c"})])
    assert _default_cols(t, "non-toxic", "toxic") == [[0, 1], [1, 0], [-1, -1]]
    both = SourceHeads("s", {"toxicity": {"a": ["toxic"], "b": ["non-toxic"]}})
    with pytest.raises(ProbeError, match=r"s: row 'id-7' \(\['a', 'b'\]\)"):
        multitask_targets(DEFAULT, both, [frozenset({"a", "b"})], row_ids=["id-7"])
