"""Offline training of a probe on a :class:`ProbeDataset`: Lion, early stopping, thresholds.

::

    result = fit(build_probe(spec, seed=0), train, val, FitConfig(lr=3e-4))
    result.probe.spec.thresholds, result.val_report["f1"]

Each epoch: mini-batches (rows of similar length together, so token-level
batches carry little padding), one Lion step each; then the validation split
is scored and the monitored metric decides early stopping. The best epoch's
weights are restored and the decision thresholds are chosen on validation (at
``config.operating_point``). Without a validation split (``val=None``) it trains
exactly ``max_epochs`` epochs and leaves the thresholds alone: that is how
:mod:`probes.offline.select` refits on all rows once cross-validation chose the epochs
and thresholds.

``FitConfig(logistic_c=C)`` fits instead a logistic regression: the pooling and layer mix
stay as they start (a mean of the probe's layers, standardized; or the mix
``logistic_mix`` gives, e.g. a Lion fit's), and the linear head is
solved to convergence (L-BFGS) under an L2 penalty of inverse strength ``C``, as
scikit-learn's ``LogisticRegression(C=C)`` per head: the loss summed over the rows each
head annotates plus ``||W||² / 2C``. One "epoch"; separable pools only. A small ``C`` keeps
the head near the difference of the classes' means, which is what transfers to text
unlike the training data (``bench/linear_ceiling.py``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from probes.drift import probe_reference
from probes.errors import ProbeError
from probes.learner import Learner
from probes.metrics import choose_thresholds, evaluate
from probes.offline.dataset import ProbeDataset
from probes.probe import Prepared, Probe
from schemas import DriftReference, OperatingPoint, ProbeSpec

__all__ = [
    "MAX_BATCH",
    "FitConfig",
    "FitResult",
    "class_weights",
    "drift_reference",
    "epoch_score",
    "fit",
    "predict_dataset",
    "source_directions",
]

MAX_BATCH = 256
# A source's positives of a head take part in its source directions when at least this many.
MIN_SOURCE_ROWS = 10
# Token-level mini-batches are padded once per fit when their fp32 copy fits in this many
# bytes (padding and the fp16 -> fp32 copy every step were a third of an MHA epoch); above
# it they are padded per step as they come.
PREPAD_BYTES = 4 << 30

Batch = tuple[Tensor | Prepared, Tensor | None, Tensor]  # (hidden, mask, targets)


@dataclass(frozen=True)
class FitConfig:
    """Hyper-parameters of :func:`fit`."""

    lr: float = 3e-4  # Lion wants ~3-10x less than AdamW
    weight_decay: float = 0.1  # decoupled; Lion wants ~3-10x more than AdamW
    batch_size: int = 64  # at most MAX_BATCH
    max_epochs: int = 40
    patience: int = 3  # epochs without improvement before stopping
    balance: Literal["weights", "sampler", "none"] = "weights"
    monitor: Literal["auprc", "f1", "loss"] = "auprc"
    standardize: bool = True  # per-(layer, dim) normalization from the training split
    gradient_checkpointing: bool = False  # recompute MHA attention in backward (less memory)
    # The dtype prepared token states are kept and projected in (Probe.prepare): bfloat16
    # halves their memory and, on a CPU with bf16 dot products (AVX512-BF16, AMX), runs an
    # MHA epoch 1.4x faster than float32, at bf16's rounding (elsewhere it is emulated, slower).
    token_dtype: Literal["float32", "bfloat16"] = "float32"
    layer_lr_scale: float = 30.0  # learning-rate multiplier of the layer-mix scalars
    mix_entropy: float = 0.0  # weight of the layer-mix entropy penalty (see probes.learner)
    operating_point: OperatingPoint = OperatingPoint()  # where flag thresholds go
    # After cross-validation: "soup" serves the average of the fold models' weights at the
    # chosen epoch (no refit), "refit" trains once more on every row (probes.offline.select).
    final: Literal["soup", "refit"] = "soup"
    # None: Lion epochs. A number: the head is a logistic regression solved exactly with
    # this inverse L2 strength, the pooling and mix fixed (see the module docstring); a
    # mapping: one per head, by name (a probe without heads: its own name).
    logistic_c: float | Mapping[str, float] | None = None
    # With logistic_c: the layer mix's weights to fit the heads on (e.g. a Lion fit's
    # learned mix) instead of the mix as it starts.
    logistic_mix: Mapping[str, Tensor] | None = None
    # With logistic_c: each training row's source (row id -> a name). Each head's weights
    # are then held orthogonal to the directions in which the mean features of its positive
    # rows differ from one source to the next (:func:`source_directions`): what tells one
    # dataset's positives from another's is the dataset's style, not the category.
    logistic_sources: Mapping[str, str] | None = None
    # With logistic_sources: the heads held so (None: every head).
    invariant_heads: frozenset[str] | None = None
    seed: int = 0
    # Cross-validation (probes.offline.select) repeated with the seeds seed, seed + 1, ...:
    # the soup averages every seed's fold models and a row's out-of-fold score is the mean
    # of its logits over the seeds, so the probe is the recipe's mean rather than one draw
    # of its initialization, folds and batch order. Costs that many times the training.
    seeds: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= MAX_BATCH:
            raise ProbeError(f"batch_size {self.batch_size} is outside 1..{MAX_BATCH}")
        c = self.logistic_c
        if c is not None and not all(
            v > 0 for v in (c.values() if isinstance(c, Mapping) else [c])
        ):
            raise ProbeError(f"logistic_c must be positive, got {c}")
        if self.seeds < 1:
            raise ProbeError(f"seeds must be >= 1, got {self.seeds}")
        if self.max_epochs < 1 or self.patience < 1:
            raise ProbeError(
                f"max_epochs ({self.max_epochs}) and patience ({self.patience}) must be >= 1"
            )


@dataclass
class FitResult:
    """The trained probe (best epoch, thresholds set) and how it got there."""

    probe: Probe
    best_epoch: int
    epochs: int
    steps: int
    examples: int
    seconds: float
    val_report: dict[str, Any]
    train_rows: int = 0
    train_counts: dict[str, int] = field(default_factory=dict)  # rows (or positives) per label
    history: list[dict[str, float]] = field(default_factory=list)
    val_probs: list[Tensor] = field(default_factory=list)  # [N_val, C] per epoch, if recorded
    epoch_states: list[dict[str, Tensor]] = field(default_factory=list)  # per epoch, if kept
    drift: DriftReference | None = None  # the training split's statistics (probes.drift)
    soup_of: int = 0  # fold models whose weights this probe averages (0: trained as it is)


def class_weights(train: ProbeDataset) -> Tensor:
    """Balanced weights ``[C]``: ``N / (C · n_c)`` per class (multiclass), or
    ``n_neg / n_pos`` per label as BCE ``pos_weight`` (multilabel, capped at 100).
    Classes without examples get weight 0 (multiclass) or 1 (multilabel)."""
    counts = train.class_counts().double()
    n, C = len(train), len(train.labels)
    if train.task == "multiclass":
        w = torch.where(counts > 0, n / (C * counts.clamp_min(1)), torch.zeros_like(counts))
    else:
        n_known = train.known_counts().double()  # per label: rows annotating it
        w = torch.where(
            counts > 0, (n_known - counts) / counts.clamp_min(1), torch.ones_like(counts)
        )
        w = w.clamp(1.0, 100.0)
    return w.float()


def _batches(
    data: ProbeDataset, size: int, order: Tensor, generator: torch.Generator | None
) -> Iterator[Tensor]:
    """Split ``order`` into mini-batches; token-level data is bucketed by length."""
    if data.token_level:
        # Sort within windows of 16 batches by length, then shuffle the batches.
        window = size * 16
        chunks = []
        for start in range(0, len(order), window):
            part = order[start : start + window]
            part = part[torch.argsort(data.lengths[part], stable=True)]
            chunks += list(part.split(size))
        if generator is not None:
            chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=generator)]
        yield from chunks
    else:
        yield from order.split(size)


class _Prepadded:
    """A token-level split's mini-batches, padded once to fp32 ``(hidden, mask, targets)``.

    Their composition (rows of similar length together, :func:`_batches` on one random
    order) is fixed for the whole fit; each epoch only shuffles their order.
    """

    def __init__(self, data: ProbeDataset, size: int, g: torch.Generator | None) -> None:
        order = torch.arange(len(data)) if g is None else torch.randperm(len(data), generator=g)
        self.index = list(_batches(data, size, order, None))
        self.items: list[Batch] = [data.batch(idx) for idx in self.index]

    @staticmethod
    def fits(data: ProbeDataset) -> bool:
        """Whether the padded fp32 copy stays within :data:`PREPAD_BYTES` (an estimate:
        each row padded to at most twice its length)."""
        if not data.token_level:
            return False
        per_token = len(data.layers) * data.hidden_size * 4
        return 2 * int(data.lengths.sum()) * per_token <= PREPAD_BYTES

    def prepare(self, probe: Probe, dtype: torch.dtype | None = None) -> None:
        """Replace each padded batch by ``probe.prepare`` of it (in place, batch by batch,
        so memory does not double), when the probe's pooling has parameter-free passes to
        do once: the MHA kind's standardize, mask, residual mean and LayerNorm were 30 %
        of an epoch (bench/fit_speed.py). ``dtype``: see :meth:`Probe.prepare`."""
        for i, (hidden, mask, y) in enumerate(self.items):
            if isinstance(hidden, Prepared):
                continue
            prepared = probe.prepare(hidden, mask, dtype=dtype)
            if prepared is None:
                return
            self.items[i] = (prepared, mask, y)

    def epoch(self, g: torch.Generator) -> Iterator[Batch]:
        for i in torch.randperm(len(self.items), generator=g).tolist():
            yield self.items[i]


def _epoch_order(train: ProbeDataset, config: FitConfig, g: torch.Generator) -> Tensor:
    if config.balance != "sampler":
        return torch.randperm(len(train), generator=g)
    if train.task != "multiclass":
        raise ProbeError("balance='sampler' needs multiclass targets; use 'weights' for multilabel")
    w = class_weights(train)[train.targets].double()
    return torch.multinomial(w, len(train), replacement=True, generator=g)


@torch.no_grad()
def drift_reference(
    probe: Probe, data: ProbeDataset, batch_size: int = 128
) -> DriftReference | None:
    """The drift statistics of ``probe`` on ``data`` (its training split), for the manifest."""
    order = torch.arange(len(data))
    batches = (data.batch(idx) for idx in _batches(data, batch_size, order, None))
    return probe_reference(probe, ((hidden, mask, None) for hidden, mask, _ in batches))


@torch.no_grad()
def predict_dataset(
    probe: Probe, data: ProbeDataset, batch_size: int = 128, *, prepadded: _Prepadded | None = None
) -> Tensor:
    """Probabilities ``[N, C]`` for every row of ``data``, in row order (``prepadded``: its
    batches of ``data``, padded once)."""
    out = torch.empty(len(data), len(probe.spec.labels))
    if prepadded is not None:
        for idx, (hidden, mask, _) in zip(prepadded.index, prepadded.items, strict=True):
            out[idx] = probe.predict_proba_many(hidden, mask)
        return out
    order = torch.arange(len(data))
    for idx in _batches(data, batch_size, order, None):
        hidden, mask, _ = data.batch(idx)
        out[idx] = probe.predict_proba_many(hidden, mask)
    return out


def epoch_score(
    spec: ProbeSpec, probs: Tensor, targets: Tensor, monitor: str
) -> tuple[float, dict[str, float]]:
    """``(score to maximize, logged values)`` of probabilities ``[N, C]`` on a split:
    ``monitor`` is ``auprc``, ``f1`` (at the F1-best thresholds) or ``loss`` (negated)."""
    clipped = probs.clamp(1e-7, 1 - 1e-7)
    if spec.task == "multiclass":
        loss = float(torch.nn.functional.nll_loss(clipped.log(), targets))
    else:
        known = ~targets.isnan()  # a multi-head row annotates only some heads
        cells = torch.nn.functional.binary_cross_entropy(
            clipped, targets.nan_to_num(0.0), reduction="none"
        )
        loss = float(cells[known].mean())
    tuned = spec.model_copy(update={"thresholds": choose_thresholds(spec, probs, targets)})
    report = evaluate(tuned, probs, targets)
    logged = {"val_loss": loss, "val_f1": float(report["f1"]), "val_auprc": float(report["auprc"])}
    score = {"loss": -loss, "f1": logged["val_f1"], "auprc": logged["val_auprc"]}[monitor]
    return score, logged


def fit(
    probe: Probe,
    train: ProbeDataset,
    val: ProbeDataset | None,
    config: FitConfig = FitConfig(),
    progress: Callable[[dict[str, float]], None] | None = None,
    *,
    record_val_probs: bool = False,
    keep_states: bool = False,
    input_stats: tuple[Tensor, Tensor] | None = None,
    reference: bool = True,
) -> FitResult:
    """Train ``probe`` on ``train`` with early stopping and thresholds on ``val``; with
    ``val=None``, for exactly ``config.max_epochs`` epochs, thresholds untouched.
    ``record_val_probs`` keeps every epoch's validation probabilities and ``keep_states``
    every epoch's weights (for cross-validation, which picks the epoch from several folds'
    curves); ``input_stats`` standardizes by these instead of the training split's;
    ``reference=False`` skips the drift statistics (a fold model is never served)."""
    _check_splits(probe, train, val)
    started = time.perf_counter()
    g = torch.Generator().manual_seed(config.seed)
    if config.standardize:
        probe.set_input_stats(*(input_stats or train.input_stats()))
    probe.pool.gradient_checkpointing = config.gradient_checkpointing
    learner = _learner(probe, train, config)
    if config.logistic_c is not None:
        return _fit_logistic(
            probe, learner, train, val, config, progress, started, reference,
            record_val_probs=record_val_probs, keep_states=keep_states,
        )  # fmt: skip
    # Balanced sampling draws other rows every epoch, so its batches are padded per step.
    prepadded = (
        _Prepadded(train, config.batch_size, g)
        if config.balance != "sampler" and _Prepadded.fits(train)
        else None
    )
    val_prepadded = _Prepadded(val, 128, None) if val is not None and _Prepadded.fits(val) else None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.token_dtype]
    for padded in (prepadded, val_prepadded):  # the normalization is fixed from here on
        if padded is not None:
            padded.prepare(probe, dtype)

    def epoch_batches() -> Iterator[Batch]:
        if prepadded is not None:
            return prepadded.epoch(g)
        order = _epoch_order(train, config, g)
        return (train.batch(idx) for idx in _batches(train, config.batch_size, order, g))

    run = _Epochs(record_val_probs=record_val_probs, keep_states=keep_states)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)  # dropout
        run.train(probe, learner, epoch_batches, val, val_prepadded, config, progress)
    if run.best_state is not None:
        probe.load_state_dict(run.best_state)
    probe.eval()
    report: dict[str, Any] = {}
    if val is not None:
        probs = predict_dataset(probe, val, prepadded=val_prepadded)
        probe.set_thresholds(
            choose_thresholds(probe.spec, probs, val.targets, point=config.operating_point)
        )
        report = evaluate(probe.spec, probs, val.targets)
    history, best_epoch = run.history, run.best_epoch
    return FitResult(
        probe=probe,
        best_epoch=best_epoch if val is not None else len(history),
        epochs=len(history),
        steps=learner.steps,
        examples=learner.examples,
        seconds=time.perf_counter() - started,
        val_report=report,
        train_rows=len(train),
        train_counts=dict(zip(train.labels, train.class_counts().tolist(), strict=True)),
        history=history,
        val_probs=run.val_probs,
        epoch_states=run.epoch_states,
        drift=drift_reference(probe, train) if reference else None,
    )


def _fit_logistic(
    probe: Probe,
    learner: Learner,
    train: ProbeDataset,
    val: ProbeDataset | None,
    config: FitConfig,
    progress: Callable[[dict[str, float]], None] | None,
    started: float,
    reference: bool,
    *,
    record_val_probs: bool,
    keep_states: bool,
) -> FitResult:
    """:func:`fit` with ``config.logistic_c``: the head solved by L-BFGS on the fixed
    features (the pooling and mix as they start), as one epoch."""
    if train.summaries is None or not probe.separable:
        raise ProbeError(
            "logistic_c fits a head on cached per-layer summaries: use a mean, max, first or "
            f"last pool, not {probe.spec.token_pool!r}"
        )
    spec = probe.spec
    c = config.logistic_c
    assert c is not None
    per_label = torch.full((len(spec.labels),), float(c) if not isinstance(c, Mapping) else 0.0)
    if isinstance(c, Mapping):
        heads = [h.name for h in spec.heads] or [spec.name]
        if set(c) != set(heads):
            raise ProbeError(f"logistic_c names heads {sorted(c)}; the probe has {heads}")
        for name, value in c.items():
            per_label[spec.head_columns(name) if spec.heads else slice(None)] = value
    if config.logistic_mix is not None:
        probe.mix.load_state_dict(dict(config.logistic_mix))
    probe.eval()
    with torch.no_grad():
        hidden, _, targets = train.batch(torch.arange(len(train)))
        features = probe.mix(probe.summarize(hidden))  # [N, D]
    head = probe.head
    optimizer = torch.optim.LBFGS(
        head.parameters(), max_iter=500, tolerance_grad=1e-7, line_search_fn="strong_wolfe"
    )
    penalty = 1.0 / (2.0 * per_label)  # [C]: one per output row of the head
    sources = config.logistic_sources
    blocks = _head_blocks(
        spec,
        features,
        targets,
        [sources[i] for i in train.ids] if sources else [],
        config.invariant_heads,
    )

    def objective() -> Tensor:
        optimizer.zero_grad()
        logits = torch.nn.functional.linear(features, _without(head.weight, blocks), head.bias)
        total, _ = learner._loss_parts(logits, targets)
        value = (total + (penalty[:, None] * head.weight.square()).sum()) / len(train)
        value.backward()
        return value

    with torch.enable_grad():
        loss = float(optimizer.step(objective).detach())
    with torch.no_grad():
        head.weight.copy_(_without(head.weight, blocks))
    steps = int(optimizer.state[head.weight].get("n_iter", 0))
    row: dict[str, float] = {"epoch": 1, "train_loss": loss}
    report: dict[str, Any] = {}
    val_probs = []
    if val is not None:
        probs = predict_dataset(probe, val)
        row.update(epoch_score(probe.spec, probs, val.targets, config.monitor)[1])
        probe.set_thresholds(
            choose_thresholds(probe.spec, probs, val.targets, point=config.operating_point)
        )
        report = evaluate(probe.spec, probs, val.targets)
        val_probs = [probs] if record_val_probs else []
    if progress is not None:
        progress(row)
    return FitResult(
        probe=probe,
        best_epoch=1,
        epochs=1,
        steps=steps,
        examples=len(train),
        seconds=time.perf_counter() - started,
        val_report=report,
        train_rows=len(train),
        train_counts=dict(zip(train.labels, train.class_counts().tolist(), strict=True)),
        history=[row],
        val_probs=val_probs,
        epoch_states=[copy.deepcopy(probe.state_dict())] if keep_states else [],
        drift=drift_reference(probe, train) if reference else None,
    )


def source_directions(
    features: Tensor, positive: Tensor, sources: list[str], min_rows: int = MIN_SOURCE_ROWS
) -> Tensor | None:
    """An orthonormal basis ([K, D]) of the directions in which the mean ``features``
    ([N, D]) of the ``positive`` rows ([N] bool) differ between ``sources`` (one name per
    row), over the sources with at least ``min_rows`` positives; None when fewer than two.

    A head fitted across datasets learns whatever separates its positives from its
    negatives, and each dataset's positives come in their own style (templated hate
    statements, requests to an assistant, tweets): a weight along the line from one
    source's positives to another's rewards the style of the source with more of them.
    A head kept orthogonal to these directions reads only what the sources' positives
    share, which is what transfers to text in a style no source has."""
    index = {name: k for k, name in enumerate(dict.fromkeys(sources))}
    codes = torch.tensor([index[s] for s in sources])
    means = []
    for k in range(len(index)):
        rows = positive & (codes == k)
        if int(rows.sum()) >= min_rows:
            means.append(features[rows].double().mean(0))
    if len(means) < 2:
        return None
    spread = torch.stack(means)
    _, values, vh = torch.linalg.svd(spread - spread.mean(0), full_matrices=False)
    return vh[values > 1e-6 * values[0]].to(features.dtype)


def _head_blocks(
    spec: ProbeSpec,
    features: Tensor,
    targets: Tensor,
    sources: list[str],
    heads: frozenset[str] | None = None,
) -> list[tuple[slice, Tensor | None]]:
    """Each head's output rows and its :func:`source_directions` (from its flagging label's
    positives; none without ``sources`` or for a head not among ``heads``)."""
    columns = [(h.name, spec.head_columns(h.name)) for h in spec.heads] or [
        (spec.name, slice(0, len(spec.labels)))
    ]
    blocks = []
    for name, cols in columns:
        basis = None
        if sources and (heads is None or name in heads):
            if targets.dim() == 1:  # one task, class indices: its flagging labels
                flags = [spec.labels.index(x) for x in spec.flag_labels]
                positive = torch.isin(targets, torch.tensor(flags))
            else:  # [N, C], NaN where a head is unknown: the head's flagging label
                positive = targets[:, cols.stop - 1].nan_to_num(0.0) > 0.5
            basis = source_directions(features, positive, sources)
        blocks.append((cols, basis))
    return blocks


def _without(weight: Tensor, blocks: list[tuple[slice, Tensor | None]]) -> Tensor:
    """``weight`` ([C, D]) with each head's rows projected off its source directions."""
    if all(basis is None for _, basis in blocks):
        return weight
    return torch.cat(
        [weight[c] if v is None else weight[c] - (weight[c] @ v.T) @ v for c, v in blocks]
    )


def _learner(probe: Probe, train: ProbeDataset, config: FitConfig) -> Learner:
    """Lion over ``probe`` as ``config`` asks (class weights from ``train`` when balancing
    by weights)."""
    weights = class_weights(train) if config.balance == "weights" else None
    return Learner(
        probe,
        lr=config.lr,
        weight_decay=config.weight_decay,
        class_weights=weights,
        layer_lr_scale=config.layer_lr_scale,
        mix_entropy=config.mix_entropy,
    )


def _check_splits(probe: Probe, train: ProbeDataset, val: ProbeDataset | None) -> None:
    """Refuse a split the probe cannot read (other layers or labels) or an empty one."""
    splits = [("train", train)] + ([("validation", val)] if val is not None else [])
    for name, data in splits:
        if data.layers != list(probe.spec.layers) or data.labels != list(probe.spec.labels):
            raise ProbeError(
                f"{name} data has layers {data.layers} and labels {data.labels}; the probe reads "
                f"layers {probe.spec.layers} with labels {probe.spec.labels}"
            )
        if len(data) == 0:
            raise ProbeError(f"the {name} split is empty")


@dataclass
class _Epochs:
    """The epochs of one :func:`fit`: its history, the best epoch on validation (early
    stopping) and, when asked, each epoch's validation probabilities and weights."""

    record_val_probs: bool = False
    keep_states: bool = False
    history: list[dict[str, float]] = field(default_factory=list)
    val_probs: list[Tensor] = field(default_factory=list)
    epoch_states: list[dict[str, Tensor]] = field(default_factory=list)
    best_score: float = float("-inf")
    best_state: dict[str, Tensor] | None = None
    best_epoch: int = 0

    def train(
        self,
        probe: Probe,
        learner: Learner,
        epoch_batches: Callable[[], Iterator[Batch]],
        val: ProbeDataset | None,
        val_prepadded: _Prepadded | None,
        config: FitConfig,
        progress: Callable[[dict[str, float]], None] | None,
    ) -> None:
        """Up to ``config.max_epochs`` epochs; with ``val``, stop after ``patience`` epochs
        without a better monitored score."""
        for epoch in range(1, config.max_epochs + 1):
            losses = []
            for hidden, mask, y in epoch_batches():
                losses.append(learner.learn_many(hidden, mask, y))
            row: dict[str, float] = {"epoch": epoch, "train_loss": sum(losses) / len(losses)}
            if self.keep_states:
                self.epoch_states.append(copy.deepcopy(probe.state_dict()))
            if val is None:
                self.history.append(row)
                if progress is not None:
                    progress(row)
                continue
            probs = predict_dataset(probe, val, prepadded=val_prepadded)
            if self.record_val_probs:
                self.val_probs.append(probs)
            score, logged = epoch_score(probe.spec, probs, val.targets, config.monitor)
            row.update(logged)
            self.history.append(row)
            if progress is not None:
                progress(row)
            if score > self.best_score:
                self.best_score, self.best_epoch = score, epoch
                self.best_state = copy.deepcopy(probe.state_dict())
            elif epoch - self.best_epoch >= config.patience:
                break
