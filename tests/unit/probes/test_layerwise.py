"""Per-layer probing curves, selectivity against a control task, per-class layer use."""

from __future__ import annotations

import torch

from probes import build_probe
from probes.offline.control import control_targets
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig
from probes.offline.layerwise import class_layer_use, layer_slice, probe_layers
from schemas import ProbeSpec
from tests.unit.synthetic import D


def signal_in_layer(n: int, signal_layer: int, seed: int = 0) -> ProbeDataset:
    """Summaries of 3 layers; only ``signal_layer`` (an index) carries the class."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < 0.3).long()
    summaries = torch.randn(3, n, D, generator=g)
    direction = torch.randn(D, generator=torch.Generator().manual_seed(7))
    summaries[signal_layer] += 1.5 * y[:, None] * direction
    return ProbeDataset(
        [0, 1, 2], ["ok", "toxic"], "multiclass", y, [f"{seed}-{i}" for i in range(n)],
        summaries=summaries.half(),
    )  # fmt: skip


def spec(layers: list[int], labels: list[str], mix: str = "scalar_mix") -> ProbeSpec:
    return ProbeSpec(
        name="t", token_pool="mean", layer_mix=mix, layers=layers, hidden_size=D,  # type: ignore[arg-type]
        task="multiclass", labels=labels, flag_labels=["toxic"] if "toxic" in labels else [],
    )  # fmt: skip


def test_layer_slice_keeps_rows_and_picks_layers() -> None:
    data = signal_in_layer(20, 1)
    part = layer_slice(data, [2, 0])
    assert part.layers == [2, 0] and len(part) == 20
    assert part.summaries is not None and data.summaries is not None
    assert torch.equal(part.summaries[0], data.summaries[2])


def test_the_curve_finds_the_layer_with_the_signal_and_selectivity_there() -> None:
    train, test = signal_in_layer(400, 1, seed=0), signal_in_layer(200, 1, seed=1)
    # Control keys: one per message (an arbitrary first word); same balance, no signal.
    keys = [f"k{i % 97}" for i in range(600)]
    control = control_targets(keys, torch.cat([train.targets, test.targets]))
    rows = probe_layers(
        spec([0, 1, 2], ["ok", "toxic"]),
        train,
        test,
        FitConfig(max_epochs=8, patience=3, lr=3e-3),
        control=(control[:400], control[400:]),
    )
    assert [r["layer"] for r in rows] == [0, 1, 2]
    best = max(rows, key=lambda r: r["auprc"])
    assert best["layer"] == 1 and best["auprc"] > 0.8
    assert all(r["auprc"] < 0.6 for r in rows if r["layer"] != 1)
    assert best["selectivity_auprc"] > 0.4
    assert set(rows[0]) >= {"control_f1", "control_auprc", "selectivity_f1", "epochs"}


def test_class_layer_use_splits_each_class_logit_gap_by_layer() -> None:
    # Class c's rows carry direction c in layer c only; the head reads direction c for c.
    n, C = 300, 3
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % C
    directions = torch.eye(C, D) * 3
    summaries = 0.1 * torch.randn(C, n, D, generator=g)
    for c in range(C):
        summaries[c, y == c] += directions[c]
    data = ProbeDataset(
        [0, 1, 2], ["a", "b", "c"], "multiclass", y, [str(i) for i in range(n)],
        summaries=summaries.half(),
    )  # fmt: skip
    probe = build_probe(spec([0, 1, 2], ["a", "b", "c"]), seed=0).eval()
    with torch.no_grad():
        probe.head.weight.copy_(directions)
        probe.head.bias.fill_(0.5)
    use = class_layer_use(probe, data, batch_size=64)
    assert use.gap.shape == (C, C) and use.rows.tolist() == [100, 100, 100]
    assert torch.equal(use.gap.abs().argmax(dim=1), torch.arange(C))  # class c <- layer c
    # Exact: the per-layer gaps add up to each class's own-rows logit gap.
    logits = probe(data.summaries.float())  # type: ignore[union-attr]
    want = torch.stack([logits[y == c, c].mean() - logits[:, c].mean() for c in range(C)])
    torch.testing.assert_close(use.gap.sum(dim=1), want, atol=1e-3, rtol=1e-3)
    assert torch.allclose(use.shares().abs().sum(dim=1), torch.ones(C))
