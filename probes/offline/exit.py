"""Choosing the cascade's exit head by cross-validation: which layer, which threshold.

For each candidate layer ``k`` (a layer the probe reads, below its deepest): an exit head
over layer ``k`` alone (a linear head on its masked means, or the attention kind on its
tokens) is trained on ``k - 1`` folds and scores the held-out fold (out-of-fold logits for
every row), its calibration (temperature and per-label bias) is fitted on those logits, and
for each ``allow_below`` threshold the rows whose calibrated flag risk is below it take the
exit score while the others keep the full probe's out-of-fold score. A threshold is
acceptable when that cascade's AUPRC is within ``epsilon`` of the full probe's and it
allows at most ``max_missed`` of the flagged rows early; the layer and threshold chosen
minimize the forward pass's expected cost ``k / deepest + (1 - tokens) · (deepest - k) /
deepest``, where ``tokens`` is the share of the tokens (not of the rows) decided at the
exit: the rows an exit head is sure of are mostly the short ones (on ToxicChat, 67 % of
the rows at layer 8 held 35 % of the tokens, and the backlog ran 1.35x, not the 1.96x a
count of rows promised). Data of summaries holds no lengths: its rows count alike.
Nothing is chosen when no layer saves at least ``min_saving`` of the forward pass. The
head attached is the *soup* of the chosen layer's fold heads (the mean of their weights):
its calibration and threshold were fitted on those heads' scores, while a head refit on
every row is more confident than they were and exits more rows than the search measured
(held-out ToxicChat rows at layer 8: 61 %, not 19 %).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from probes.calibration import calibrated, fit_calibration
from probes.errors import ProbeError
from probes.exit import attach_exit, flag_risk
from probes.metrics import _flag_score, _truth, average_precision
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, fit
from probes.offline.select import mean_state, stratified_folds
from probes.probe import Probe, build_probe
from schemas import ExitSpec, ProbeSpec, TokenPool

__all__ = ["THRESHOLDS", "ExitRow", "ExitSearch", "exit_cost", "mean_summaries", "search_exit"]

THRESHOLDS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2)


def exit_cost(layer: int, deepest: int, decided: float) -> float:
    """The share of the forward pass to ``deepest`` still run when an exit at ``layer``
    decides ``decided`` of the work (a share of the tokens, or of the rows)."""
    return layer / deepest + (1 - decided) * (deepest - layer) / deepest


@dataclass(frozen=True)
class ExitRow:
    layer: int
    allow_below: float
    temperature: float
    share: float  # rows decided at the exit
    auprc: float  # of the cascade (out of fold)
    cost: float  # expected share of the forward pass's work (blocks x tokens) still run
    bias: list[float] | None = None  # the calibration's per-label bias
    missed: float = 0.0  # share of the flagged rows (any flag label true) it allows early
    tokens: float | None = None  # share of the tokens decided at the exit (None: unknown)


@dataclass
class ExitSearch:
    full_auprc: float
    rows: list[ExitRow]
    chosen: ExitRow | None
    probe: Probe | None = None  # the probe with its exit head attached (when chosen)
    epsilon: float = 0.005
    notes: list[str] = field(default_factory=list)
    pool: str = "mean"  # the exit heads' token aggregation

    def table(self) -> list[dict[str, float]]:
        return [row.__dict__ for row in self.rows]

    def metrics(self) -> dict[str, float]:
        """For the checkpoint manifest."""
        out = {"exit_full_cv_auprc": self.full_auprc}
        if self.chosen is not None:
            c = self.chosen
            out |= {
                "exit_layer": float(c.layer),
                "exit_allow_below": c.allow_below,
                "exit_cv_share": c.share,
                "exit_cv_missed": c.missed,
                "exit_cv_auprc": c.auprc,
                "exit_cv_cost": c.cost,
            }
            if c.tokens is not None:
                out["exit_cv_token_share"] = c.tokens
        return out


def mean_summaries(data: ProbeDataset, layer: int) -> ProbeDataset:
    """``data``'s masked-mean summaries ``[1, N, D]`` of ``layer`` (token-level or not)."""
    one = data.select_layers([layer])
    if one.summaries is not None:
        return one
    assert one.tokens is not None and one.offsets is not None
    lengths = one.offsets.diff()  # [N]
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [N_tok]
    sums = torch.zeros(len(lengths), one.tokens.shape[-1]).index_add_(
        0, rows, one.tokens[:, 0].float()
    )
    means = sums / lengths.clamp_min(1)[:, None].float()  # [N, D]
    return ProbeDataset([layer], one.labels, one.task, one.targets, one.ids, summaries=means[None])


def search_exit(
    spec: ProbeSpec,
    probe: Probe,
    data: ProbeDataset,
    oof_probs: Tensor,
    config: FitConfig,
    *,
    folds: int = 5,
    epsilon: float = 0.005,
    layers: list[int] | None = None,
    epochs: int | None = None,
    min_saving: float = 0.15,
    pool: TokenPool = "mean",
    max_missed: float = 0.05,
) -> ExitSearch:
    """Search the exit layers of ``spec`` (or ``layers``) on ``data`` (the probe's training
    rows; ``oof_probs`` ``[N, C]``: the full probe's out-of-fold probabilities) and attach
    the chosen exit head (the soup of its fold heads) to ``probe``.

    ``pool``: the exit head's token aggregation. ``"mean"`` trains a linear head on the
    layer's masked means (cheap: one pass over the tokens); any other pool (``"mha"``: the
    multi-head attention kind) trains on the layer's token states, which ``data`` must
    hold, for ``epochs`` epochs (the full probe's, from its cross-validation).

    ``max_missed``: the largest share of the flagged rows a threshold may allow early. The
    cascade's out-of-fold AUPRC alone is optimistic: it is measured against the fold
    models, which rank no better than a good exit head, while the probe served (their soup)
    ranks better, so positives the exit lets through cost more held out (on ToxicChat, a
    threshold within 0.5 point by CV lost 2.1 points held out, allowing 17 % of positives
    early; at most 5 % kept the loss within 0.35 point)."""
    if not spec.flag_labels:
        return ExitSearch(float("nan"), [], None, notes=["no flag labels: nothing to exit on"])
    deepest = spec.deepest_layer
    candidates = [k for k in (layers or spec.layers) if k in spec.layers and 1 <= k < deepest]
    truth = _truth(spec, data.targets)[:, [spec.labels.index(x) for x in spec.flag_labels]]
    y = np.asarray(truth.any(axis=1))
    full = _flag_score(spec, oof_probs.double().numpy())
    full_auprc = average_precision(y, full)
    # The work a row costs past the exit is about its token count (no lengths: rows alike).
    lengths = None if data.offsets is None else data.offsets.diff().double().numpy()  # [N]
    # Fixed epochs (no early stopping on the held-out fold: its scores stay honest), and no
    # class balancing: the exit decides by the value of its probabilities, which must keep
    # the data's base rate (a balanced loss reads as if half the messages were flagged,
    # and a temperature cannot move that back).
    exit_config = FitConfig(
        **{**config.__dict__, "max_epochs": epochs or config.max_epochs, "balance": "none"}
    )
    fold = stratified_folds(data, folds, seed=config.seed)
    if pool != "mean" and data.tokens is None:
        raise ProbeError(f"a {pool!r} exit head trains on token states; the data holds summaries")
    if pool == "mean" and data.tokens is None:
        pool = spec.token_pool  # cached summaries: already pooled by the probe's own pool
    rows: list[ExitRow] = []
    soups: dict[int, dict[str, Tensor]] = {}
    alone: dict[int, float] = {}  # each layer's exit head alone, out of fold (AUPRC)
    for k in candidates:
        logits, soups[k] = _fold_heads(spec, data, k, pool, fold, folds, config, exit_config)
        layer_rows, alone[k] = _threshold_rows(spec, k, logits, data.targets, y, full, lengths)
        rows += layer_rows
    chosen = _choose(rows, full_auprc - epsilon, max_missed, 1 - min_saving)
    search = ExitSearch(full_auprc, rows, chosen, epsilon=epsilon, pool=pool)
    if chosen is None:
        search.notes.append(
            "no exit layer saves enough within epsilon and max_missed: no exit head"
        )
        return search
    exit_spec = ExitSpec(
        layer=chosen.layer,
        token_pool=pool,
        temperature=chosen.temperature,
        bias=chosen.bias,
        allow_below=chosen.allow_below,
    )
    soup, floor = soups[chosen.layer], alone[chosen.layer]
    head = _served_head(spec, data, exit_spec, chosen, soup, floor, y, config)
    if head is None:
        search.notes.append("the soup of the fold exit heads fell apart: refit on every row")
        head = _refit_head(spec, data, exit_spec, config, exit_config)
    search.probe = attach_exit(probe, head, exit_spec)
    return search


def _choose(
    rows: list[ExitRow], min_auprc: float, max_missed: float, max_cost: float
) -> ExitRow | None:
    """The cheapest row (then the best AUPRC) whose cascade keeps ``min_auprc``, misses at
    most ``max_missed`` of the flagged rows and costs at most ``max_cost``; None: none."""
    ok = [r for r in rows if r.auprc >= min_auprc and r.missed <= max_missed and r.cost <= max_cost]
    return min(ok, key=lambda r: (r.cost, -r.auprc)) if ok else None


def _fold_heads(
    spec: ProbeSpec,
    data: ProbeDataset,
    k: int,
    pool: TokenPool,
    fold: Tensor,
    folds: int,
    config: FitConfig,
    exit_config: FitConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Layer ``k``'s exit head fitted on each fold's complement: its out-of-fold logits
    ``[N, C]`` and the soup of the fold heads' weights."""
    view = _exit_view(spec, ExitSpec(layer=k, token_pool=pool))
    one = _exit_rows(data, k, pool)
    # Every fold standardizes by all rows' statistics and starts from one seed, so the
    # fold heads average into one (the soup), as fit_cv's final probe does.
    stats = one.input_stats() if config.standardize else None
    logits = torch.empty(len(data), len(spec.labels))
    states: list[dict[str, Tensor]] = []
    for f in range(folds):
        held = (fold == f).nonzero().flatten()
        train = (fold != f).nonzero().flatten()
        trained = fit(
            build_probe(view, seed=config.seed),
            one.subset(train),
            None,
            exit_config,
            input_stats=stats,
            reference=False,
        ).probe.eval()
        logits[held] = _logits(trained, one, held)
        states.append(trained.state_dict())
    return logits, mean_state(states)


def _threshold_rows(
    spec: ProbeSpec,
    k: int,
    logits: Tensor,
    targets: Tensor,
    y: np.ndarray,
    full: np.ndarray,
    lengths: np.ndarray | None,
) -> tuple[list[ExitRow], float]:
    """Layer ``k``'s exit head calibrated on its out-of-fold ``logits``, then one row per
    threshold of :data:`THRESHOLDS` (the cascade's AUPRC, cost and misses when it exits
    below it); and the head's AUPRC alone."""
    deepest = spec.deepest_layer
    temperature, bias = fit_calibration(spec, logits, targets)
    probs = calibrated(spec, logits, temperature, bias)
    risk = flag_risk(spec, probs).double().numpy()
    early = _flag_score(spec, probs.double().numpy())
    rows = []
    for t in THRESHOLDS:
        exited = risk < t
        share = float(exited.mean())
        tokens = None if lengths is None else float(lengths[exited].sum() / lengths.sum())
        auprc = average_precision(y, np.where(exited, early, full))
        cost = exit_cost(k, deepest, share if tokens is None else tokens)
        missed = float(exited[y].mean()) if y.any() else 0.0
        rows.append(ExitRow(k, t, temperature, share, auprc, cost, bias, missed, tokens))
    return rows, average_precision(y, early)


def _served_head(
    spec: ProbeSpec,
    data: ProbeDataset,
    exit_spec: ExitSpec,
    chosen: ExitRow,
    soup: dict[str, Tensor],
    alone: float,
    y: np.ndarray,
    config: FitConfig,
) -> Probe | None:
    """The chosen layer's exit head as the soup of its fold heads, or None when that soup
    ranks the rows worse than the fold heads did alone (then the caller refits)."""
    one = _exit_rows(data, chosen.layer, exit_spec.token_pool)
    view = _exit_view(spec, exit_spec)
    head = build_probe(view, seed=config.seed)
    head.load_state_dict(soup)
    head.eval()
    # As fit_cv's soup: fold heads that left the shared basin average to weights that rank
    # the rows they all trained on worse than each ranked rows it never saw.
    soup_logits = _logits(head, one, torch.arange(len(data)))
    seen = calibrated(spec, soup_logits, chosen.temperature, chosen.bias).double().numpy()
    if not average_precision(y, _flag_score(spec, seen)) >= alone:
        return None
    return head


def _refit_head(
    spec: ProbeSpec,
    data: ProbeDataset,
    exit_spec: ExitSpec,
    config: FitConfig,
    exit_config: FitConfig,
) -> Probe:
    """The exit head fitted once on every row (when the fold heads' soup fell apart)."""
    one = _exit_rows(data, exit_spec.layer, exit_spec.token_pool)
    view = _exit_view(spec, exit_spec)
    return fit(build_probe(view, seed=config.seed), one, None, exit_config).probe.eval()


def _exit_rows(data: ProbeDataset, layer: int, pool: str) -> ProbeDataset:
    """What an exit head with ``pool`` trains on: ``layer``'s masked means for a linear
    head over token states, else the layer as ``data`` holds it."""
    if pool == "mean" and data.tokens is not None:
        return mean_summaries(data, layer)
    return data.select_layers([layer])


@torch.no_grad()
def _logits(probe: Probe, data: ProbeDataset, index: Tensor, chunk: int = 256) -> Tensor:
    """``probe``'s logits ``[len(index), C]`` for rows ``index`` of ``data``, in chunks
    (token-level rows pad to their longest)."""
    parts = []
    for part in index.split(chunk):
        hidden, mask, _ = data.batch(part)
        parts.append(probe(hidden, mask).float())
    return torch.cat(parts)


def _exit_view(spec: ProbeSpec, exit_spec: ExitSpec) -> ProbeSpec:
    data = {**spec.model_dump(), "exit": exit_spec.model_dump()}
    return ProbeSpec.model_validate(data).exit_view()
