"""Adding (and removing) a head: a custom category on a probe that already serves, with
every existing head's scores exactly as before."""

from __future__ import annotations

import pytest
import torch

from probes import (
    ProbeError,
    build_probe,
    checkpoint_to_bytes,
    encode_target,
    probe_from_bytes,
)
from probes.heads import add_head, remap_label_rows, remove_head
from probes.learner import Learner
from schemas import HeadSpec
from tests.unit.synthetic import FINGERPRINT, make_spec, random_batch, trained

JAILBREAK = HeadSpec(name="jailbreak", task="multilabel", labels=["jailbreaking"])
TOPICS = HeadSpec(name="mood", task="multiclass", labels=["calm", "angry", "sad"])
KINDS = [("mean", "scalar_mix"), ("mha", "scalar_mix"), ("gate", "gate"), ("max", "single")]


@pytest.mark.parametrize(("pool", "mix"), KINDS)
@pytest.mark.parametrize("head", [JAILBREAK, TOPICS], ids=["binary", "multiclass"])
def test_existing_heads_score_exactly_as_before(pool: str, mix: str, head: HeadSpec) -> None:
    probe = trained(pool, mix)
    hidden, mask = random_batch(len(probe.layers))
    bigger = add_head(probe, head, flag=True)
    spec = bigger.spec
    assert [h.name for h in spec.head_specs] == ["toxicity", "topic", head.name]
    assert spec.labels == [*probe.spec.labels, *head.labels]
    assert spec.flag_labels == ["toxic", *head.labels]
    old = slice(0, len(probe.spec.labels))
    # Exactly: the shared part's output and the old heads' rows are the same bits...
    mixed = probe.mix(probe.summarize(hidden, mask))
    assert torch.equal(bigger.mix(bigger.summarize(hidden, mask)), mixed)
    assert torch.equal(bigger.head.weight[old], probe.head.weight)
    assert torch.equal(bigger.head.bias[old], probe.head.bias)
    # ...so the scores differ by float rounding alone: BLAS sums a [B, D] @ [D, C] product
    # with a kernel chosen by C, and F.linear's first C columns of C + 1 differ from those
    # of C in the last bit for some C.
    before = probe.predict_proba_many(hidden, mask)
    after = bigger.predict_proba_many(hidden, mask)
    torch.testing.assert_close(after[:, old], before, rtol=0, atol=1e-6)
    new = after[:, spec.head_columns(head.name)]  # zero rows: 0.5 each, or uniform
    want = 0.5 if head.task == "multilabel" else 1 / len(head.labels)
    torch.testing.assert_close(new, torch.full_like(new, want))
    # Every buffer and shared parameter is kept; the probe given is left as it was.
    for name, t in probe.state_dict().items():
        if not name.startswith("head."):
            assert torch.equal(bigger.state_dict()[name], t), name
    assert probe.spec.labels == ["toxic", "ok", "spam"]
    assert torch.equal(probe.predict_proba_many(hidden, mask), before)


def test_pooled_summaries_score_the_same_too() -> None:
    probe = trained("mean", "scalar_mix")
    hidden = torch.randn(len(probe.layers), 5, probe.spec.hidden_size)
    bigger = add_head(probe, JAILBREAK)
    torch.testing.assert_close(
        bigger.predict_proba_many(hidden)[:, :3],
        probe.predict_proba_many(hidden),
        rtol=0,
        atol=1e-6,
    )


def test_a_single_head_probe_becomes_a_multi_head_one_with_the_same_scores() -> None:
    probe = trained("mean", "scalar_mix", task="multiclass")
    hidden, mask = random_batch(len(probe.layers))
    bigger = add_head(probe, JAILBREAK)
    assert [(h.name, h.task) for h in bigger.spec.heads] == [
        ("contract", "multiclass"),
        ("jailbreak", "multilabel"),
    ]
    assert bigger.spec.task == "multilabel" and bigger.spec.flag_labels == ["toxic"]
    torch.testing.assert_close(
        bigger.predict_proba_many(hidden, mask)[:, :3],
        probe.predict_proba_many(hidden, mask),
        rtol=0,
        atol=1e-6,
    )


def test_small_random_rows_are_reproducible() -> None:
    probe = trained("mean", "scalar_mix")
    a = add_head(probe, JAILBREAK, init_std=0.01, seed=1)
    b = add_head(probe, JAILBREAK, init_std=0.01, seed=1)
    assert torch.equal(a.head.weight, b.head.weight)
    assert 0 < float(a.head.weight[3].detach().abs().max()) < 0.1
    assert float(a.head.bias[3].detach()) == 0.0


def test_refusals_name_the_clash() -> None:
    probe = trained("mean", "scalar_mix")
    with pytest.raises(ProbeError, match="already has a head 'topic'"):
        add_head(probe, HeadSpec(name="topic", task="multilabel", labels=["x"]))
    with pytest.raises(ProbeError, match=r"labels \['spam'\] already belong"):
        add_head(probe, HeadSpec(name="ads", task="multilabel", labels=["spam"]))
    with pytest.raises(ProbeError, match="lacks"):
        add_head(probe, JAILBREAK, thresholds={"toxic": 0.3})
    with pytest.raises(ProbeError, match="only head"):
        remove_head(build_probe(make_spec("mean", "scalar_mix")), "contract")
    with pytest.raises(ValueError, match="no head 'nope'"):
        remove_head(probe, "nope")


def test_thresholds_of_the_new_head_travel_in_the_spec() -> None:
    probe = trained("mean", "scalar_mix")
    bigger = add_head(probe, JAILBREAK, flag=True, thresholds={"jailbreaking": 0.7})
    assert bigger.spec.thresholds["jailbreaking"] == 0.7


def test_remove_head_undoes_add_head() -> None:
    probe = trained("mha", "scalar_mix")
    hidden, mask = random_batch(len(probe.layers))
    bigger = add_head(probe, TOPICS, flag=True, thresholds={"angry": 0.4})
    back = remove_head(bigger, "mood")
    assert back.spec == probe.spec
    assert torch.equal(back.head.weight, probe.head.weight)  # the same width: the same bits
    assert torch.equal(
        back.predict_proba_many(hidden, mask), probe.predict_proba_many(hidden, mask)
    )
    smaller = remove_head(probe, "toxicity")  # a middle or first head: the rest keep rows
    assert smaller.spec.labels == ["ok", "spam"] and smaller.spec.flag_labels == []
    torch.testing.assert_close(
        smaller.predict_proba_many(hidden, mask),
        probe.predict_proba_many(hidden, mask)[:, 1:],
        rtol=0,
        atol=1e-6,
    )


def test_a_grown_probe_survives_a_checkpoint_round_trip() -> None:
    probe = trained("mha", "scalar_mix")
    bigger = add_head(probe, JAILBREAK, flag=True, thresholds={"jailbreaking": 0.6})
    hidden, mask = random_batch(len(probe.layers))
    for weights in ("fp32", "int8"):
        blob, manifest = checkpoint_to_bytes(
            bigger,
            llm=FINGERPRINT,
            version=3,
            parent=2,
            weights=weights,
        )
        loaded, m = probe_from_bytes(blob, manifest, FINGERPRINT)
        assert m.spec == bigger.spec and m.parent == 2
        if weights == "fp32":
            assert torch.equal(
                loaded.predict_proba_many(hidden, mask), bigger.predict_proba_many(hidden, mask)
            )


def test_optimizer_rows_follow_their_labels() -> None:
    state = {
        "head.weight": torch.arange(6.0).reshape(3, 2),
        "head.bias": torch.tensor([1.0, 2.0, 3.0]),
        "mix.logits": torch.ones(3),
    }
    grown = remap_label_rows(state, ["a", "b", "c"], ["b", "c", "new", "a"])
    assert grown["head.weight"].tolist() == [[2, 3], [4, 5], [0, 0], [0, 1]]
    assert grown["head.bias"].tolist() == [2, 3, 0, 1]
    assert torch.equal(grown["mix.logits"], state["mix.logits"])
    with pytest.raises(ProbeError, match="3 rows for 2 labels"):
        remap_label_rows(state, ["a", "b"], ["a"])


def test_the_new_head_learns_from_its_own_labels_alone() -> None:
    probe = trained("mean", "scalar_mix")
    bigger = add_head(probe, JAILBREAK)
    spec = bigger.spec
    hidden, mask = random_batch(len(probe.layers), batch=16)
    positive = hidden[..., 0].mean(dim=2) > 0  # [L, B] -> use the first layer's sign
    names = [["jailbreaking"] if bool(p) else [] for p in positive[0]]
    targets = torch.stack([encode_target(spec, n, head="jailbreak")[0] for n in names])
    assert targets[:, :3].isnan().all()  # no word about the other heads
    learner = Learner(bigger, lr=1e-2)
    before = bigger.predict_proba_many(hidden, mask)[:, 3]
    for _ in range(30):
        learner.learn_many(hidden, mask, targets)
    after = bigger.predict_proba_many(hidden, mask)[:, 3]
    y = targets[:, 3].bool()
    assert float(after[y].mean() - after[~y].mean()) > float(before[y].mean() - before[~y].mean())


def test_flag_some_labels_of_a_multiclass_head() -> None:
    bigger = add_head(trained("mean", "scalar_mix"), TOPICS, flag=["angry"])
    assert bigger.spec.flag_labels == ["toxic", "angry"]
    with pytest.raises(ProbeError, match="lacks"):
        add_head(trained("mean", "scalar_mix"), TOPICS, flag=["happy"])
