"""The updater's learning core on its own: no Kafka, no Redis, no LLM."""

from __future__ import annotations

import pytest
import torch

from probes import Probe, ProbeError, build_probe
from probes.heads import add_head
from probes.learner import Learner
from schemas import HeadSpec, TrainingCounters
from tests.unit.synthetic import NUM_LAYERS, make_spec, toy_task
from worker.learning.config import LearningConfig
from worker.learning.online_learner import Labeled, OnlineLearner
from worker.llm.extract import Extraction
from worker.settings import Settings

KINDS = [("mean", "scalar_mix"), ("gate", "scalar_mix"), ("mha", "scalar_mix"), ("max", "gate")]


def _learner(pool: str = "mean", mix: str = "scalar_mix", **config: object) -> OnlineLearner:
    cfg = LearningConfig(**{"batch_size": 8, "stats_warmup": 16, **config})  # type: ignore[arg-type]
    return OnlineLearner(build_probe(make_spec(pool, mix), seed=0), cfg, fresh=True)


def _feed(learner: OnlineLearner, seed: int, n: int = 48) -> tuple[torch.Tensor, ...]:
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=n, seed=seed)
    layers = torch.tensor(learner.probe.layers)
    hidden = hidden[layers - 1]  # the probe's layers, [L_sel, B, T, D]
    for start in range(0, n, 8):
        part = slice(start, start + 8)
        learner.learn(hidden[:, part], mask[part], y[part], y[part].tolist())
    return hidden, mask, y


def test_fresh_probe_warms_up_before_its_first_step() -> None:
    learner = _learner()
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=8)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1]
    assert learner.learn(hidden, mask, y, y.tolist()) == 0
    assert learner.warming_up and learner.lion.steps == 0
    assert torch.equal(learner.probe.scale, torch.ones_like(learner.probe.scale))
    # The second batch completes the warm-up: normalization fixed, all 16 examples learned.
    steps = learner.learn(hidden, mask, y, y.tolist())
    assert steps == 2 * 2  # two mini-batches of 8, two Lion steps each
    assert not learner.warming_up
    assert not torch.equal(learner.probe.scale, torch.ones_like(learner.probe.scale))
    assert learner.counters.labels_seen == 16 and learner.counters.steps == 4


def test_resumed_probe_learns_at_once_and_counts_per_label() -> None:
    probe = build_probe(make_spec("mean", "scalar_mix"), seed=0)
    learner = OnlineLearner(
        probe,
        LearningConfig(batch_size=8),
        counters=TrainingCounters(labels_seen=5, steps=7, per_label={"ok": 5}),
    )
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=8)
    hidden = hidden[torch.tensor(probe.layers) - 1]
    assert learner.learn(hidden, mask, y, y.tolist()) == 2
    c = learner.counters
    assert c.labels_seen == 13 and c.steps == 9
    assert sum(c.per_label.values()) == 13
    assert c.per_label["ok"] == 5 + int((y == 0).sum())


@pytest.mark.parametrize(("pool", "mix"), KINDS)
def test_every_kind_learns_the_toy_task_online(pool: str, mix: str) -> None:
    learner = _learner(pool, mix, lr=3e-3)
    for seed in range(1, 7):
        _feed(learner, seed)
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=96, seed=50)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1]
    accuracy = (learner.probe.predict_proba_many(hidden, mask).argmax(-1) == y).float().mean()
    assert accuracy > 0.8, f"{pool}/{mix}: accuracy {accuracy:.2f} on held-out toy data"
    report = learner.metrics()
    assert 0.0 <= report["prequential_f1"] <= 1.0 and "layer_entropy" in report


def test_replay_keeps_summaries_for_separable_pools_and_tokens_otherwise() -> None:
    for pool, dims in (("mean", 2), ("gate", 3)):
        learner = _learner(pool, stats_warmup=1)
        _feed(learner, seed=1, n=8)
        example = learner.replay.sample(1)[0]
        assert example.x.dim() == dims and example.x.dtype == torch.float16


def test_optimizer_state_round_trips_into_a_new_learner() -> None:
    a = _learner(stats_warmup=1)
    _feed(a, seed=1)
    state = a.optimizer_state()
    assert state and all(t.device.type == "cpu" for t in state.values())
    b = OnlineLearner(
        build_probe(make_spec("mean", "scalar_mix"), seed=0), LearningConfig(), fresh=False
    )
    assert b.load_optimizer_state({**state, "no.such.param": torch.zeros(3)}) == len(state)
    assert set(b.optimizer_state()) == set(state)
    for name, t in b.optimizer_state().items():
        assert torch.equal(t, state[name])


def test_ema_is_what_gets_published() -> None:
    learner = _learner(stats_warmup=1, ema_decay=0.9)
    _feed(learner, seed=1)
    shadow = learner.publishable()
    assert shadow is not learner.probe
    w = dict(learner.probe.named_parameters())
    changed = [n for n, p in shadow.named_parameters() if not torch.equal(p, w[n])]
    assert changed, "the EMA shadow should lag the live weights"
    plain = _learner(stats_warmup=1)
    assert plain.publishable() is plain.probe


def test_calibrate_moves_the_flag_threshold_only_with_enough_positives() -> None:
    strict = _learner(stats_warmup=1, calibrate_min_positives=10_000)
    _feed(strict, seed=1)
    strict.calibrate()
    assert strict.probe.spec.thresholds == {}
    eager = _learner(stats_warmup=1, calibrate_min_positives=3)
    _feed(eager, seed=1)
    eager.calibrate()
    assert set(eager.probe.spec.thresholds) == {"toxic"}


def test_snapshot_is_plain_data() -> None:
    learner = _learner()
    _feed(learner, seed=1, n=8)
    snap = learner.snapshot()
    assert snap["warming_up"] and snap["warmup_examples"] == 8 and snap["steps"] == 0
    assert snap["layers"] == list(learner.probe.layers)
    assert len(snap["layer_weights"]) == len(snap["layers"])
    assert not any(isinstance(v, torch.Tensor) for v in snap.values())


@pytest.mark.parametrize(("pool", "mix"), [("mean", "scalar_mix"), ("gate", "scalar_mix")])
def test_rows_that_overflow_half_precision_are_named_not_learned(pool: str, mix: str) -> None:
    # Replay keeps examples in fp16: a hidden value of 1e5 becomes inf there, and one such
    # label (1e6 here) used to make every later loss non-finite (and its whole batch a dead letter).
    learner = _learner(pool, mix)
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=8)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1].clone()
    first_real = int(mask[3].nonzero()[0])
    hidden[:, 3, first_real] = 1e6
    hidden[:, 5, -1] = 1e6
    bad = learner.unusable_rows(hidden, mask)
    assert bad == ([3, 5] if bool(mask[5, -1]) else [3])
    keep = [r for r in range(8) if r not in bad]
    for _ in range(4):  # through the warm-up, then learning
        learner.learn(hidden[:, keep], mask[keep], y[keep], y[keep].tolist())
    assert not learner.warming_up
    assert all(torch.isfinite(p).all() for p in learner.probe.parameters())
    assert learner.last_loss is not None and torch.isfinite(torch.tensor(learner.last_loss))


def test_learn_extraction_sets_aside_unreadable_and_unusable_rows_by_position() -> None:
    # Six labeled texts: the model could not read input 1, input 4's states overflow fp16.
    # The four others are learned from, each with its own target.
    learner = _learner(stats_warmup=1)
    hidden, mask, _ = toy_task(NUM_LAYERS, "multiclass", n=5, seed=3)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1].clone()  # [L, 5, T, D]
    hidden[:, 3, 0] = 1e6  # a real token (every row has at least two): inf in fp16
    targets = [0, 2, 1, 2, 0, 1]
    labeled = [Labeled(f"text {i}", torch.tensor(t), t) for i, t in enumerate(targets)]
    ex = Extraction(
        hidden=hidden, mask=mask, layers=learner.probe.layers, index=[0, 2, 3, 4, 5],
        errors={1: "unreadable: empty after cleaning"},
    )  # fmt: skip
    learned = learner.learn_extraction(ex, labeled)
    assert learned.unusable == {
        1: "unreadable: empty after cleaning",
        4: "hidden states not finite as float16 (NaN, inf or overflow)",
    }
    assert learned.examples == 4 and learned.steps > 0
    kept = [targets[p] for p in (0, 2, 3, 5)]
    assert learner.counters.labels_seen == 4
    assert learner.counters.per_label == {
        n: kept.count(i) for i, n in enumerate(learner.probe.spec.labels) if i in kept
    }
    nothing = learner.learn_extraction(  # no row readable: mean pooling has nothing to pool
        Extraction(hidden[:, :0], mask[:0], learner.probe.layers, [], {0: "x"}), labeled[:1]
    )
    assert (nothing.steps, nothing.examples, nothing.unusable) == (0, 0, {0: "x"})


def _graded_stream(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The toy task on the probe's 3 layers, with a signal that grows with depth (0.3, 0.6,
    1.0): every layer helps, the deepest most, as in a real LLM."""
    hidden, mask, y = toy_task(3, "multiclass", n=n, seed=seed)
    directions = 1.5 * torch.randn(3, hidden.shape[-1], generator=torch.Generator().manual_seed(99))
    strength = torch.tensor([0.3, 0.6, 1.0])[:, None, None, None]  # [L, 1, 1, 1]
    hidden -= directions[y][None, :, None, :]  # toy_task adds full strength to every layer
    return hidden + strength * directions[y][None, :, None, :], mask, y


def test_layer_mix_does_not_collapse_online_and_accuracy_holds() -> None:
    """The demo's regime: a few labels per batch, four Lion steps each, lr 1e-3. Without the
    entropy penalty the mix ends on one layer (entropy < 0.05, far below the 0.5 alarm);
    with the default one it keeps weight on more than one layer and learns as well."""
    demo = {"lr": 1e-3, "batch_size": 16, "steps_per_batch": 4, "stats_warmup": 16}
    hidden, mask, y = _graded_stream(240, seed=1)
    test_h, test_m, test_y = _graded_stream(200, seed=7)
    entropy, accuracy = {}, {}
    for name, extra in (("off", {"mix_entropy": 0.0}), ("default", {})):
        cfg = LearningConfig(**{**demo, **extra})  # type: ignore[arg-type]
        learner = OnlineLearner(
            build_probe(make_spec("mean", "scalar_mix"), seed=0), cfg, fresh=True
        )
        for start in range(0, 240, 2):
            part = slice(start, start + 2)
            learner.learn(hidden[:, part], mask[part], y[part], y[part].tolist())
        entropy[name] = learner.probe.layer_entropy()
        probs = learner.probe.predict_proba_many(test_h, test_m)
        accuracy[name] = float((probs.argmax(-1) == test_y).float().mean())
    assert entropy["off"] < 0.05, entropy  # the failure the fix is for
    assert entropy["default"] > 0.5, entropy  # above PROBEGUARD_ENTROPY_ALARM's default
    assert accuracy["default"] >= 0.9 and accuracy["default"] >= accuracy["off"] - 0.03, accuracy


@pytest.mark.parametrize("pool", ["gate", "mha"])
def test_token_level_kinds_learn_multilabel_online(pool: str) -> None:
    cfg = LearningConfig(batch_size=8, stats_warmup=16, lr=3e-3)
    learner = OnlineLearner(
        build_probe(make_spec(pool, "scalar_mix", task="multilabel"), seed=0), cfg, fresh=True
    )
    for seed in range(1, 7):
        hidden, mask, y = toy_task(NUM_LAYERS, "multilabel", n=48, seed=seed)
        hidden = hidden[torch.tensor(learner.probe.layers) - 1]
        for start in range(0, 48, 8):
            part = slice(start, start + 8)
            learner.learn(hidden[:, part], mask[part], y[part], [0] * 8)
    hidden, mask, y = toy_task(NUM_LAYERS, "multilabel", n=96, seed=50)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1]
    predicted = learner.probe.predict_proba_many(hidden, mask) >= 0.5
    assert (predicted == (y > 0.5)).float().mean() > 0.8


def test_the_cold_start_probe_is_mha_on_the_layers_a_cache_stores() -> None:
    from worker.learning.updater import default_spec
    from worker.offline.build_cache import default_token_layers

    spec = default_spec("toxicity", 30, 576)
    assert (spec.token_pool, spec.layer_mix) == ("mha", "scalar_mix")
    assert spec.layers == default_token_layers(30) == [4, 8, 11, 15, 19, 22, 26, 30]
    assert default_spec("t", 4, 16).layers == [1, 2, 3, 4]


def test_chunked_replay_steps_like_one_padded_batch() -> None:
    """Cutting a step's batch into length-sorted chunks changes the padding, not the step."""
    from worker.learning.replay import Example, collate, collate_chunks

    hidden, mask, y = toy_task(3, "multiclass", n=24, seed=3)
    examples = [
        Example(hidden[:, b, : int(mask[b].sum())].half(), y[b], int(y[b])) for b in range(24)
    ]
    a = build_probe(make_spec("mha", "gate"), seed=0)
    b = build_probe(make_spec("mha", "gate"), seed=0)
    weights = torch.tensor([1.0, 2.0, 0.5])
    whole = Learner(a, lr=1e-2, class_weights=weights, mix_entropy=0.1)
    loss_whole = whole.learn_many(*collate(examples))
    chunks = collate_chunks(examples, chunk=5)
    assert len(chunks) == 5 and max(c[0].shape[2] for c in chunks[:1]) < hidden.shape[2]
    loss_chunks = Learner(b, lr=1e-2, class_weights=weights, mix_entropy=0.1).learn_chunks(chunks)
    assert abs(loss_whole - loss_chunks) < 1e-5
    # Compare the gradients the step used (Lion's sign of a ~0 gradient is float noise).
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_bf16_replay_learns_from_rows_fp16_cannot_hold() -> None:
    # PROBEGUARD_STATE_DTYPE=bfloat16 (Gemma 3): 1e5 is an ordinary value, not an overflow.
    learner = _learner("gate", "scalar_mix", state_dtype="bfloat16")
    hidden, mask, y = toy_task(NUM_LAYERS, "multiclass", n=8)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1].clone()
    hidden[:, 3, int(mask[3].nonzero()[0])] = 1e5
    assert learner.unusable_rows(hidden, mask) == []
    assert _learner("gate", "scalar_mix").unusable_rows(hidden, mask) == [3]
    learner.learn(hidden, mask, y, y.tolist())
    assert learner.warmup is not None and learner.warmup[0].x.dtype == torch.bfloat16


def test_keep_layers_keeps_the_weights_of_the_layers_it_keeps() -> None:
    from probes.probe import keep_layers

    hidden, mask, _ = toy_task(NUM_LAYERS, "multiclass", n=16, seed=3)
    probe = build_probe(make_spec("mha", "scalar_mix"), seed=0)  # layers [1, 2, 4]
    with torch.no_grad():
        _set_mix(probe, torch.tensor([0.5, 0.2, -30.0]))  # layer 4: weight ~1e-13
    full = probe.predict_proba_many(hidden[torch.tensor([0, 1, 3])], mask)
    small = keep_layers(probe, [1, 2])
    assert small.layers == (1, 2) and small.spec.token_pool == "mha"
    torch.testing.assert_close(small.pool.qkv, probe.pool.qkv[:2])  # type: ignore[index]
    torch.testing.assert_close(small.head.weight, probe.head.weight)
    torch.testing.assert_close(small.predict_proba_many(hidden[:2], mask), full)
    with pytest.raises(ProbeError, match="subset"):
        keep_layers(probe, [3])


def _set_mix(probe: Probe, logits: torch.Tensor) -> None:
    logits_param: torch.Tensor = probe.mix.get_parameter("logits")  # scalar mix: [L]
    logits_param.copy_(logits)


def _drop_learner(**config: object) -> OnlineLearner:
    settings: dict[str, object] = {"lr": 3e-3, "mix_entropy": 0.0, "stats_warmup": 8, **config}
    learner = _learner("mha", "scalar_mix", **settings)
    _feed(learner, seed=1, n=16)  # warm-up done, replay holds token-level examples
    with torch.no_grad():  # as if learning had left layers 2 and 4 with ~no weight
        _set_mix(learner.probe, torch.tensor([4.0, -8.0, -8.0]))
    return learner


def test_the_updater_drops_only_deepest_layers_that_stayed_negligible() -> None:
    learner = _drop_learner(drop_layer_weight=0.01, drop_layer_publishes=2)
    assert learner.drop_negligible_layers() == []  # once below the bar is not enough
    assert learner.drop_negligible_layers() == [2, 4]  # twice in a row: both trailing ones
    assert learner.probe.layers == (1,)
    assert {e.x.shape[0] for b in learner.replay.buckets for e in b} == {1}
    params = dict(learner.probe.named_parameters())
    for name, momentum in learner.optimizer_state().items():
        assert momentum.shape == params[name].shape
    _feed(learner, seed=2, n=16)  # keeps learning on the shallower probe
    assert learner.lion.steps > 0 and learner.drop_negligible_layers() == []


def test_a_negligible_middle_layer_stays_and_the_default_never_drops() -> None:
    learner = _drop_learner(drop_layer_weight=0.01, drop_layer_publishes=1)
    with torch.no_grad():
        _set_mix(learner.probe, torch.tensor([4.0, -8.0, 4.0]))  # layer 2 negligible
    assert learner.drop_negligible_layers() == [] and learner.probe.layers == (1, 2, 4)
    default = _drop_learner()
    for _ in range(10):
        assert default.drop_negligible_layers() == []
    assert default.probe.layers == (1, 2, 4)
    recovering = _drop_learner(drop_layer_weight=0.01, drop_layer_publishes=2)
    recovering.drop_negligible_layers()
    with torch.no_grad():
        _set_mix(recovering.probe, torch.tensor([4.0, -8.0, 4.0]))  # layer 4 is back
    assert recovering.drop_negligible_layers() == []  # layer 4's run restarted; 2 is not last


def test_momentum_of_a_probe_that_since_grew_a_head_restores_by_label() -> None:
    a = _learner()
    _feed(a, seed=1)
    state, labels = a.optimizer_state(), list(a.probe.spec.labels)
    grown = add_head(a.probe, HeadSpec(name="jailbreak", task="multilabel", labels=["jb"]))
    b = OnlineLearner(grown, LearningConfig(batch_size=8))
    # Without the labels the head's shapes differ: its momentum is skipped (not an error)...
    assert b.load_optimizer_state(state) == len(state) - 2
    # ...with them, every tensor is used: old rows kept, the new head's rows at zero.
    c = OnlineLearner(add_head(a.probe, grown.spec.heads[-1]), LearningConfig(batch_size=8))
    assert c.load_optimizer_state(state, labels) == len(state)
    restored = c.optimizer_state()
    assert torch.equal(restored["head.weight"][:3], state["head.weight"])
    assert torch.equal(restored["head.bias"][:3], state["head.bias"])
    assert not restored["head.weight"][3].any() and float(restored["head.bias"][3]) == 0.0
    for name, t in state.items():
        if not name.startswith("head."):
            assert torch.equal(restored[name], t), name


def test_freeze_shared_steps_the_linear_head_alone() -> None:
    learner = _learner(freeze_shared=True)
    shared = {k: v.clone() for k, v in learner.probe.state_dict().items() if "head." not in k}
    head = learner.probe.head.weight.detach().clone()
    _feed(learner, seed=1)
    after = learner.probe.state_dict()
    for name, t in shared.items():
        if name not in ("shift", "scale"):  # the warm-up sets the normalization
            assert torch.equal(after[name], t), name
    assert not torch.equal(learner.probe.head.weight, head)
    assert set(learner.optimizer_state()) == {"head.weight", "head.bias"}
    assert LearningConfig.from_settings(Settings(learn_freeze_shared=True)).freeze_shared


def test_drift_reference_weights_the_balanced_replay_back_to_the_streams_class_shares() -> None:
    """Replay holds at most 8 examples per class: 36 of class 0 were seen, 4 of class 1, so
    each class-0 example stands for 36 / 8 = 4.5 and each class-1 example for 1."""
    from probes.drift import pooled_rms, reference
    from worker.learning.replay import collate

    learner = _learner(replay_size=24)  # 3 classes: 8 per class
    hidden, mask, _ = toy_task(NUM_LAYERS, "multiclass", n=40, seed=3)
    hidden = hidden[torch.tensor(learner.probe.layers) - 1]
    y = torch.tensor([0] * 36 + [1] * 4)
    for start in range(0, 40, 8):
        part = slice(start, start + 8)
        learner.learn(hidden[:, part], mask[part], y[part], y[part].tolist())
    assert [len(b) for b in learner.replay.buckets] == [8, 4, 0]
    probe = learner.publishable()
    got = learner.drift_reference(probe)
    rows = []
    for bucket, weight in ((learner.replay.buckets[0], 4.5), (learner.replay.buckets[1], 1.0)):
        h, m, _ = collate(list(bucket))
        probs, pooled = probe.predict_proba_pooled(h, m)
        rows.append((pooled_rms(pooled), probs, torch.full((len(bucket),), weight)))
    assert got == reference(probe.spec, rows)
    unweighted = reference(probe.spec, [(r, p, None) for r, p, _ in rows])
    assert got is not None and unweighted is not None and got.examples == 12
    assert got.layer_mean != unweighted.layer_mean
