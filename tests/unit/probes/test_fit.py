"""Datasets, batching and the offline fit loop on synthetic hidden states."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from torch import Tensor

from probes import ProbeError, build_probe
from probes.kinds.pooling import masked_mean
from probes.learner import Learner
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, class_weights, fit, predict_dataset
from probes.probe import Prepared
from schemas import ProbeSpec
from tests.unit.synthetic import D, toy_task


def token_dataset(task: str = "multiclass", n: int = 96, seed: int = 1) -> ProbeDataset:
    hidden, mask, y = toy_task(3, task, n=n, seed=seed)  # [L, N, T, D]
    tokens = hidden.permute(1, 2, 0, 3)[mask].half()  # [n_tok, L, D]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), mask.sum(1).cumsum(0)])
    ids = [f"r{i}" for i in range(n)]
    labels = ["ok", "toxic", "spam"]
    return ProbeDataset([1, 2, 4], labels, task, y, ids, tokens=tokens, offsets=offsets)  # type: ignore[arg-type]


def spec_for(data: ProbeDataset, pool: str, mix: str = "scalar_mix") -> ProbeSpec:
    return ProbeSpec(
        name="t",
        token_pool=pool,  # type: ignore[arg-type]
        layer_mix=mix,  # type: ignore[arg-type]
        layers=data.layers,
        hidden_size=D,
        task=data.task,
        labels=data.labels,
        flag_labels=["toxic"],
        d_inner=8,
        num_heads=2,
    )


def test_batch_pads_ragged_tokens_back() -> None:
    hidden, mask, _ = toy_task(3, "multiclass", n=96, seed=1)
    data = token_dataset()
    idx = torch.tensor([5, 0, 17])
    h, m, _ = data.batch(idx)
    assert h.shape[:2] == (3, 3) and m is not None
    T = h.shape[2]
    torch.testing.assert_close(m, mask[idx][:, :T])
    torch.testing.assert_close(
        masked_mean(h, m), masked_mean(hidden[:, idx].half().float(), mask[idx])
    )


def test_subset_and_stats() -> None:
    data = token_dataset()
    sub = data.subset(torch.tensor([3, 4]))
    assert len(sub) == 2 and sub.ids == ["r3", "r4"]
    torch.testing.assert_close(sub.batch(torch.tensor([1]))[0], data.batch(torch.tensor([4]))[0])
    shift, scale = data.input_stats()
    assert shift.shape == (3, D) and (scale > 0).all()


def test_relabel_reorders_and_refuses_unknown_classes() -> None:
    data = token_dataset()
    re = data.relabel(["spam", "toxic", "ok"])
    assert torch.equal(re.targets, 2 - data.targets)
    with pytest.raises(ProbeError, match="does not know"):
        data.relabel(["ok", "toxic"])


def test_class_weights_balance() -> None:
    data = token_dataset()
    w = class_weights(data)
    counts = data.class_counts().float()
    torch.testing.assert_close((w * counts).sum(), torch.tensor(float(len(data))))


@pytest.mark.parametrize("pool", ["gate", "mean", "mha"])
def test_fit_learns_and_sets_thresholds(pool: str) -> None:
    train, val = token_dataset(seed=1), token_dataset(seed=2, n=60)
    probe = build_probe(spec_for(train, pool), seed=0)
    result = fit(probe, train, val, FitConfig(lr=3e-3, max_epochs=8, patience=3, batch_size=32))
    assert result.val_report["f1"] > 0.8
    assert "toxic" in result.probe.spec.thresholds
    assert 1 <= result.best_epoch <= result.epochs <= 8
    assert result.history[-1]["epoch"] == result.epochs
    assert predict_dataset(result.probe, val).shape == (60, 3)


def test_fit_multilabel_with_sampler_refused_and_weights_ok() -> None:
    train, val = token_dataset("multilabel", seed=1), token_dataset("multilabel", seed=2)
    probe = build_probe(spec_for(train, "max"), seed=0)
    with pytest.raises(ProbeError, match="sampler"):
        fit(probe, train, val, FitConfig(balance="sampler", max_epochs=1))
    result = fit(probe, train, val, FitConfig(lr=3e-3, max_epochs=6, batch_size=16))
    assert set(result.probe.spec.thresholds) <= set(train.labels)
    assert result.val_report["macro_auprc"] > 0.6


def test_batch_size_is_bounded() -> None:
    with pytest.raises(ProbeError, match="batch_size 512"):
        FitConfig(batch_size=512)


def test_fit_is_deterministic() -> None:
    train, val = token_dataset(seed=1), token_dataset(seed=2, n=40)

    def run() -> torch.Tensor:
        probe = build_probe(spec_for(train, "gate", "gate"), seed=0)
        res = fit(probe, train, val, FitConfig(lr=3e-3, max_epochs=3, balance="sampler"))
        return predict_dataset(res.probe, val)

    assert torch.equal(run(), run())


def test_masked_mean_with_gradients_matches_the_span_path_and_ignores_nan_padding() -> None:
    """With gradients the mean masks the whole tensor (the per-row span path's backward
    writes one full-size gradient per row); values and gradients are the same, and NaN in
    the padding reaches neither."""
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 4])[:, None]  # [3, 6]
    base = torch.randn(2, 3, 6, 5, generator=g).masked_fill(~mask[None, :, :, None], float("nan"))
    with torch.no_grad():
        reference = masked_mean(base, mask)  # the span path
    hidden = base.clone().requires_grad_(True)
    out = masked_mean(hidden, mask)
    torch.testing.assert_close(out, reference)
    out.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    expected = mask[None, :, :, None] / mask.sum(1)[None, :, None, None]
    torch.testing.assert_close(hidden.grad, expected.expand_as(hidden.grad).float())


def test_prepadded_batches_cover_every_row_once_per_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    import probes.offline.fit as fit_module

    data = token_dataset(n=70)
    pre = fit_module._Prepadded(data, 16, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    rows = torch.cat(list(pre.index)).sort().values
    assert torch.equal(rows, torch.arange(70))
    for (hidden, mask, y), idx in zip(pre.items, pre.index, strict=True):
        h, m, t = data.batch(idx)
        assert mask is not None and m is not None
        assert isinstance(hidden, torch.Tensor) and torch.equal(hidden, h)
        assert torch.equal(mask, m) and torch.equal(y, t)
    assert sum(int(b[2].shape[0]) for b in pre.epoch(g)) == 70
    probe = build_probe(spec_for(data, "mha"), seed=0)
    probe.set_input_stats(*data.input_stats())
    torch.testing.assert_close(
        predict_dataset(probe, data, prepadded=pre), predict_dataset(probe, data)
    )
    # Over the memory budget fit pads per step and still trains.
    assert fit_module._Prepadded.fits(data)
    monkeypatch.setattr(fit_module, "PREPAD_BYTES", 0)
    assert not fit_module._Prepadded.fits(data)
    res = fit(build_probe(spec_for(data, "mha"), seed=0), data, data, FitConfig(max_epochs=2))
    assert res.epochs == 2


@pytest.mark.parametrize("layer_norm", [True, False])
def test_prepared_batches_score_as_raw_states_and_refuse_other_statistics(
    layer_norm: bool,
) -> None:
    data = token_dataset(n=24)
    spec = spec_for(data, "mha").model_copy(update={"layer_norm": layer_norm})
    probe = build_probe(spec, seed=0)
    probe.set_input_stats(*data.input_stats())
    hidden, mask, _ = data.batch(torch.arange(24))
    prepared = probe.prepare(hidden, mask)
    assert prepared is not None
    torch.testing.assert_close(probe.summarize(prepared), probe.summarize(hidden, mask))
    torch.testing.assert_close(
        probe.predict_proba_many(prepared), probe.predict_proba_many(hidden, mask)
    )
    # Gradients reach every parameter the raw path trains.
    probe(prepared).sum().backward()
    assert all(p.grad is not None for p in probe.pool.parameters())
    # Kept in bfloat16 (half the memory, bf16 projections): the same up to its rounding.
    half = probe.prepare(hidden, mask, dtype=torch.bfloat16)
    assert half is not None and half.parts[0].dtype == torch.bfloat16
    assert half.parts[1].dtype == torch.float32  # the residual mean [L, B, D]
    torch.testing.assert_close(probe(half), probe(prepared), rtol=0.02, atol=0.02)
    # Other statistics (a new fit's, or a state loaded since): the batch is stale.
    shift, scale = data.input_stats()
    probe.set_input_stats(shift + 1, scale)
    with pytest.raises(ProbeError, match="prepared under other input statistics"):
        probe.summarize(prepared)
    # Kinds without parameter-free passes, and summaries, are left as they are.
    mean = build_probe(spec_for(data, "mean"), seed=0)
    assert mean.prepare(hidden, mask) is None
    assert mean.prepare(torch.zeros(3, 2, D), None) is None


def test_fit_on_prepared_batches_trains_as_on_raw_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    import probes.offline.fit as fit_module

    data = token_dataset(n=80)
    train, val = data.subset(torch.arange(56)), data.subset(torch.arange(56, 80))
    prepared_seen: list[bool] = []
    original = fit_module.Learner.learn_many

    def counting(self: Learner, hidden: Tensor | Prepared, mask: Tensor | None, y: Tensor) -> float:
        prepared_seen.append(isinstance(hidden, fit_module.Prepared))
        return original(self, hidden, mask, y)

    monkeypatch.setattr(fit_module.Learner, "learn_many", counting)
    config = FitConfig(max_epochs=3, patience=3, batch_size=16)
    fast = fit(build_probe(spec_for(data, "mha"), seed=0), train, val, config)
    assert prepared_seen and all(prepared_seen)
    prepared_seen.clear()
    monkeypatch.setattr(fit_module._Prepadded, "prepare", lambda self, probe, dtype=None: None)
    slow = fit(build_probe(spec_for(data, "mha"), seed=0), train, val, config)
    assert prepared_seen and not any(prepared_seen)
    assert [r["train_loss"] for r in fast.history] == pytest.approx(
        [r["train_loss"] for r in slow.history], rel=1e-4
    )
    for name, tensor in slow.probe.state_dict().items():
        torch.testing.assert_close(fast.probe.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)
    assert fast.probe.spec.thresholds == pytest.approx(slow.probe.spec.thresholds, abs=1e-3)


def test_fit_on_bfloat16_states_learns_as_on_float32_ones() -> None:
    data = token_dataset(n=96)
    train, val = data.subset(torch.arange(64)), data.subset(torch.arange(64, 96))

    def report(dtype: Literal["float32", "bfloat16"]) -> dict:
        config = FitConfig(max_epochs=4, patience=4, batch_size=16, token_dtype=dtype)
        return fit(build_probe(spec_for(data, "mha"), seed=0), train, val, config).val_report

    assert report("bfloat16")["auprc"] == pytest.approx(report("float32")["auprc"], abs=0.05)


def summary_dataset(n: int = 240, seed: int = 3) -> ProbeDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, D, generator=g) * torch.linspace(0.5, 3.0, D)  # [L, N, D]
    logit = x[0, :, 0] - 0.7 * x[0, :, 1] + 0.3 * torch.randn(n, generator=g)
    y = (logit > 0.4).float()[:, None]  # [N, 1]: one label, a minority
    return ProbeDataset([4], ["toxic"], "multilabel", y, [f"r{i}" for i in range(n)], summaries=x)


@pytest.mark.parametrize("c", [1e-3, 1.0])
def test_a_logistic_head_is_scikit_learns_logistic_regression_on_the_same_features(
    c: float,
) -> None:
    from sklearn.linear_model import LogisticRegression

    data = summary_dataset()
    spec = spec_for(data, "mean", mix="single").model_copy(update={"flag_labels": ["toxic"]})
    config = FitConfig(logistic_c=c, balance="none")
    result = fit(build_probe(spec, seed=0), data, None, config)
    probe = result.probe
    assert result.epochs == 1 and result.steps > 0
    assert data.summaries is not None
    with torch.no_grad():
        features = probe.summarize(data.summaries)[0].numpy()  # standardized, as the head saw
        logits = probe(data.summaries)[:, 0].numpy()
    reference = LogisticRegression(C=c, tol=1e-10, max_iter=10_000).fit(
        features, data.targets[:, 0].numpy()
    )
    torch.testing.assert_close(
        torch.from_numpy(logits).double(),
        torch.from_numpy(reference.decision_function(features)).double(),
        atol=2e-3,
        rtol=2e-3,
    )


def test_logistic_heads_fit_on_the_mix_they_are_given() -> None:
    one = summary_dataset()
    assert one.summaries is not None
    data = ProbeDataset(
        [2, 4], one.labels, "multilabel", one.targets, one.ids,
        summaries=torch.cat([one.summaries, one.summaries.flip(-1)]),
    )  # fmt: skip
    spec = spec_for(data, "mean")  # scalar_mix over two layers
    learned = {"logits": torch.tensor([2.0, -1.0]), "gamma": torch.tensor(1.5)}
    probe = fit(
        build_probe(spec, seed=0), data, None, FitConfig(logistic_c=1.0, logistic_mix=learned)
    ).probe
    torch.testing.assert_close(probe.mix.state_dict(), learned)
    # The mix as it starts (uniform) gives other features, so another head.
    plain = fit(build_probe(spec, seed=0), data, None, FitConfig(logistic_c=1.0)).probe
    assert not torch.allclose(plain.head.weight, probe.head.weight, atol=1e-3)


def test_logistic_heads_need_summaries_and_positive_strengths() -> None:
    data = token_dataset()
    with pytest.raises(ProbeError, match="logistic_c fits a head on cached per-layer summaries"):
        fit(build_probe(spec_for(data, "mha"), seed=0), data, None, FitConfig(logistic_c=1.0))
    with pytest.raises(ProbeError, match="logistic_c must be positive"):
        FitConfig(logistic_c={"toxicity": 0.0})
    summaries = summary_dataset()
    spec = spec_for(summaries, "mean", mix="single")
    with pytest.raises(ProbeError, match=r"logistic_c names heads \['other'\]"):
        fit(build_probe(spec, seed=0), summaries, None, FitConfig(logistic_c={"other": 1.0}))
    # A mapping by the probe's own name (no heads) is its one head's C: stronger L2, smaller W.
    norms = [
        float(fit(build_probe(spec, seed=0), summaries, None, FitConfig(logistic_c={"t": c}))
              .probe.head.weight.norm())
        for c in (1e-3, 1.0)
    ]  # fmt: skip
    assert norms[0] < 0.2 * norms[1]


def styled_source(name: str, n: int, positive: float, style: Tensor | None, seed: int) -> tuple:
    """``n`` rows of one source: the category along dimension 0 (weakly), a ``positive``
    share of positives, and the source's ``style`` on every row (a per-row random one when
    None: a source whose style says nothing of its labels)."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < positive).float()
    x = 0.7 * torch.randn(n, D, generator=g)
    x[:, 0] += y
    if style is None:
        x[:, 1] += 2.0 * torch.randint(0, 2, (n,), generator=g).float()
    else:
        x += style
    return x, y, [f"{name}-{i}" for i in range(n)]


def test_logistic_heads_held_off_the_sources_directions_transfer_to_a_new_source() -> None:
    from sklearn.metrics import average_precision_score

    from probes.offline.fit import source_directions

    # Source a is mostly positive, source b mostly negative, and a's rows carry a style
    # (dimension 1) b's do not: across both, the style predicts the label.
    style = torch.zeros(D)
    style[1] = 2.0
    a = styled_source("a", 300, 0.9, style, seed=1)
    b = styled_source("b", 300, 0.1, torch.zeros(D), seed=2)
    x, y = torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])[:, None]
    ids = a[2] + b[2]
    data = ProbeDataset([4], ["toxic"], "multilabel", y, ids, summaries=x[None])
    spec = spec_for(data, "mean", mix="single").model_copy(update={"flag_labels": ["toxic"]})
    sources = {i: i.split("-")[0] for i in ids}
    plain = fit(build_probe(spec, seed=0), data, None, FitConfig(logistic_c=1.0)).probe
    held = fit(
        build_probe(spec, seed=0),
        data,
        None,
        FitConfig(logistic_c=1.0, logistic_sources=sources),
    ).probe
    # The held head has no weight along the line between the sources' positives.
    with torch.no_grad():
        features = held.summarize(data.summaries)[0]  # type: ignore[arg-type]
    basis = source_directions(features, y[:, 0] > 0.5, [sources[i] for i in ids])
    assert basis is not None and basis.shape == (1, D)
    assert float((held.head.weight.detach() @ basis.T).abs().max()) < 1e-5
    assert float((plain.head.weight.detach() @ basis.T).abs().max()) > 0.1
    # A new source whose rows carry the style at random: the plain head reads it as the
    # category, the held one does not.
    new = styled_source("c", 600, 0.5, None, seed=3)
    with torch.no_grad():
        scores = [p(new[0][None])[:, 0].numpy() for p in (plain, held)]
    plain_ap, held_ap = (average_precision_score(new[1].numpy(), s) for s in scores)
    assert held_ap > plain_ap + 0.05, (plain_ap, held_ap)


def test_source_directions_need_two_sources_with_enough_positives() -> None:
    from probes.offline.fit import source_directions

    x = torch.randn(30, D)
    positive = torch.ones(30, dtype=torch.bool)
    assert source_directions(x, positive, ["a"] * 30) is None
    assert source_directions(x, positive, ["a"] * 25 + ["b"] * 5) is None  # b: 5 < 10
    basis = source_directions(x, positive, ["a"] * 10 + ["b"] * 10 + ["c"] * 10)
    assert basis is not None and basis.shape == (2, D)
    torch.testing.assert_close(basis @ basis.T, torch.eye(2), atol=1e-5, rtol=0)
