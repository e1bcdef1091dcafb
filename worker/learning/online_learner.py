"""The updater's learning core: a probe learning from a stream of labeled hidden states.

No Kafka, no Redis, no LLM: hidden states and targets in, a publishable probe out.
Per batch (:meth:`OnlineLearner.learn_extraction` takes the LLM's extraction of the
labeled texts and sets aside the rows it cannot learn from; :meth:`OnlineLearner.learn`
takes the tensors):

    test   -- score the batch with the probe as it is (windowed prequential metrics)
    warm   -- a fresh probe first collects ``stats_warmup`` examples and fixes its input
              normalization from them; nothing is learned before that
    train  -- Lion steps on the new examples plus a class-balanced replay sample
              (at least as many replayed as new); EMA of the weights when configured

At publish time :meth:`calibrate` refits a calibrated probe's temperature and bias and
moves flag thresholds to the operating point of the prequential window,
:meth:`publishable` gives the probe to publish (the EMA shadow when configured), and
:meth:`optimizer_state` the Lion momentum to publish beside it.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from probes.drift import probe_reference
from probes.learner import Learner
from probes.probe import Probe, keep_layers, slice_layer_state
from schemas import DriftReference, TrainingCounters
from worker.learning.anchor import Anchor
from worker.learning.config import LearningConfig
from worker.learning.recalibrate import recalibrate
from worker.learning.replay import (
    Example,
    Prequential,
    ReplayBuffer,
    collate_chunks,
    input_stats,
    replay_examples,
    unusable_rows,
)

if TYPE_CHECKING:
    from worker.llm.extract import Extraction

__all__ = ["Labeled", "Learned", "OnlineLearner"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Labeled:
    """One labeled text, ready to learn from."""

    text: str
    target: Tensor  # [] class index (multiclass) or [C] multi-hot (multilabel)
    bucket: int  # class-balance bucket of the replay buffer


@dataclass(frozen=True)
class Learned:
    """What :meth:`OnlineLearner.learn_extraction` did with one batch."""

    steps: int  # Lion steps taken (0 while warming up)
    examples: int  # rows learned from (warm-up included)
    unusable: dict[int, str]  # input position -> why it could not be learned from


class OnlineLearner:
    """One probe, its Lion optimizer, replay buffer, prequential window and counters.

    ``fresh=True`` (a probe built from zero) holds back learning until ``stats_warmup``
    examples have fixed the input normalization; a resumed probe learns at once.
    ``lion`` is the probe's optimizer step (:class:`probes.learner.Learner`).
    """

    def __init__(
        self,
        probe: Probe,
        config: LearningConfig,
        *,
        counters: TrainingCounters | None = None,
        fresh: bool = False,
    ) -> None:
        probe.train()
        self.probe = probe
        self.config = config
        self._dtype = getattr(torch, config.state_dtype)  # replay storage
        self.counters = counters or TrainingCounters()
        self.lion = self._make_lion(probe)
        spec = probe.spec
        self.replay = ReplayBuffer(
            config.replay_size, len(spec.labels) + (1 if spec.task == "multilabel" else 0)
        )
        self.prequential = Prequential(spec, config.prequential_window)
        self.ema = (
            {k: v.detach().clone() for k, v in probe.state_dict().items()}
            if config.ema_decay is not None
            else None
        )
        self.warmup: list[Example] | None = [] if fresh else None
        # Heads no label has reached hold the scores they started the tenure with (nothing
        # to hold in a fresh probe, nor where the shared part does not learn).
        holds = config.anchor_unlabeled and not (fresh or config.freeze_shared)
        self.anchor = Anchor(probe) if holds and spec.heads and spec.task == "multilabel" else None
        self.last_loss: float | None = None
        self.low_weight_runs: dict[int, int] = {}  # layer -> publishes in a row below the bar
        self.bucket_seen: Counter[int] = Counter()  # examples learned per balance bucket

    def _make_lion(self, probe: Probe) -> Learner:
        c = self.config
        lion = Learner(
            probe,
            lr=c.lr,
            weight_decay=c.weight_decay,
            layer_lr_scale=c.layer_lr_scale,
            mix_entropy=c.mix_entropy,
            freeze_shared=c.freeze_shared,
        )
        lion.steps = self.counters.steps
        return lion

    @property
    def warming_up(self) -> bool:
        """True while a fresh probe still collects examples for its normalization."""
        return self.warmup is not None

    # --- learning --------------------------------------------------------------------------

    def learn(self, hidden: Tensor, mask: Tensor, targets: Tensor, buckets: list[int]) -> int:
        """Test, then train on one batch: ``hidden [L, B, T, D]``, ``mask [B, T]``,
        ``targets [B]`` or ``[B, C]``, one balance bucket per row. Returns the Lion steps
        taken (0 while warming up).

        All or nothing: a failure part-way (out of device memory, a non-finite loss on a
        later mini-batch) restores the learner as it was before the batch, since the batch
        loop then retries and bisects it: each pass would otherwise test and train on the
        same labels again (the prequential window counting them twice, the first
        mini-batches' steps and replay additions kept)."""
        saved = _Saved.of(self)
        try:
            return self._learn(hidden, mask, targets, buckets)
        except BaseException:
            saved.restore(self)
            raise

    def _learn(self, hidden: Tensor, mask: Tensor, targets: Tensor, buckets: list[int]) -> int:
        # Test, then train: the prequential score comes from the probe before this step.
        logits = self.probe.predict_logits_many(hidden, mask)  # [B, C], uncalibrated
        self.prequential.add(self.probe.probabilities(logits), targets, logits)
        learned = targets
        if self.anchor is not None:
            learned, self.lion.held_rows = self.anchor.fill(hidden, mask, targets)
        new = replay_examples(self.probe, hidden, mask, learned, buckets, self._dtype)
        if learned is not targets:  # which cells are a held head's opinion, not a label
            opinion = targets.isnan() & ~learned.isnan()  # [B, C]
            new = [replace(e, anchored=opinion[b]) for b, e in enumerate(new)]
        steps_before = self.lion.steps
        if self.warmup is not None:
            self.warmup.extend(new)
            if len(self.warmup) < self.config.stats_warmup:
                new = []
            else:
                self._set_stats(self.warmup)
                new, self.warmup = self.warmup, None
        if self.anchor is not None:  # a head reached for the first time forgets its opinions
            self.replay.release(self.anchor.release(targets))  # (replayed, they would teach it)
        self._train(new)
        self._count(targets)
        self.bucket_seen.update(buckets)
        return self.lion.steps - steps_before

    def learn_extraction(self, ex: Extraction, labeled: Sequence[Labeled]) -> Learned:
        """Test, then train on ``ex``, the extraction of ``[x.text for x in labeled]`` at
        the probe's layers. Rows the model could not read (``ex.errors``) or whose states
        are not finite as replay keeps them (:meth:`unusable_rows`) are not learned from:
        they come back in :attr:`Learned.unusable` by input position, for the caller to
        reject."""
        unusable = dict(ex.errors)
        if not ex.index:  # nothing readable (a pooled summary of no rows would fail)
            return Learned(steps=0, examples=0, unusable=unusable)
        hidden, mask = ex.hidden.float(), ex.mask  # [L, B, T, D], [B, T]
        bad = set(self.unusable_rows(hidden, mask))
        why = f"hidden states not finite as {self.config.state_dtype} (NaN, inf or overflow)"
        for row in sorted(bad):
            unusable[ex.index[row]] = why
        rows = [row for row in range(len(ex.index)) if row not in bad]
        if not rows:
            return Learned(steps=0, examples=0, unusable=unusable)
        if bad:
            hidden, mask = hidden[:, rows], mask[rows]
        kept = [labeled[ex.index[row]] for row in rows]
        targets = torch.stack([x.target for x in kept])  # [B] or [B, C]
        steps = self.learn(hidden, mask, targets, [x.bucket for x in kept])
        return Learned(steps=steps, examples=len(kept), unusable=unusable)

    def unusable_rows(self, hidden: Tensor, mask: Tensor) -> list[int]:
        """Rows of ``hidden [L, B, T, D]`` not finite as replay keeps them
        (:func:`worker.learning.replay.unusable_rows`)."""
        return unusable_rows(self.probe, hidden, mask, self._dtype)

    def _train(self, new: list[Example]) -> None:
        bs = self.config.batch_size
        for start in range(0, len(new), bs):
            fresh = new[start : start + bs]
            # At least as many replayed (class-balanced) examples as fresh ones: a full
            # batch of fresh labels must not crowd the replay out, or a skewed stream
            # (ToxicChat: 7 % toxic) teaches mostly its majority class.
            extra = max(bs - len(fresh), len(fresh))
            for _ in range(self.config.steps_per_batch):
                chunks = collate_chunks(fresh + self.replay.sample(extra))
                self.last_loss = self.lion.learn_chunks(chunks)
                self._update_ema()
            self.replay.add(fresh)

    def _set_stats(self, examples: list[Example]) -> None:
        self.probe.set_input_stats(*input_stats(examples))
        log.info("input normalization fixed from %d examples", len(examples))

    def _update_ema(self) -> None:
        d = self.config.ema_decay
        if self.ema is None or d is None:
            return
        with torch.no_grad():
            for k, v in self.probe.state_dict().items():
                if v.is_floating_point():
                    self.ema[k].mul_(d).add_(v, alpha=1 - d)
                else:
                    self.ema[k].copy_(v)

    def _count(self, targets: Tensor) -> None:
        spec, c = self.probe.spec, self.counters
        per_label = dict(c.per_label)
        if spec.task == "multiclass":
            for idx in targets.tolist():
                per_label[spec.labels[idx]] = per_label.get(spec.labels[idx], 0) + 1
        else:
            for j, label in enumerate(spec.labels):
                per_label[label] = per_label.get(label, 0) + int(targets[:, j].nansum())
        self.counters = TrainingCounters(
            labels_seen=c.labels_seen + int(targets.shape[0]),
            steps=self.lion.steps,
            per_label=per_label,
        )

    # --- publishing ------------------------------------------------------------------------

    def calibrate(self) -> None:
        """Flag thresholds (and a calibrated probe's temperature and bias) refitted on the
        prequential window at publish time: :func:`worker.learning.recalibrate.recalibrate`."""
        recalibrate(
            self.probe,
            self.prequential,
            min_positives=self.config.calibrate_min_positives,
            labels_seen=self.counters.labels_seen,
            point=self.config.operating_point,
        )

    def drop_negligible_layers(self) -> list[int]:
        """Once per publish: drop the deepest layers whose mix weight has stayed below
        ``drop_layer_weight`` for ``drop_layer_publishes`` publishes in a row, so the next
        version reads fewer layers and scorers stop their forward pass earlier. Returns the
        layers dropped (usually none).

        Only the deepest ones: a forward pass runs every block up to the deepest layer read,
        so a negligible middle layer costs almost nothing and stays. Only for a scalar mix,
        whose weights do not depend on the input. The probe keeps its other weights; the
        remaining mix weights are renormalized, the optimizer momentum, EMA and replay
        buffer are cut to the same layers. Off by default (see the setting's note)."""
        c = self.config
        if not c.drop_layer_weight or self.warming_up or self.probe.spec.layer_mix != "scalar_mix":
            return []
        layers = list(self.probe.layers)
        for layer, w in zip(layers, self.probe.layer_weights().tolist(), strict=True):
            low = w < c.drop_layer_weight
            self.low_weight_runs[layer] = self.low_weight_runs.get(layer, 0) + 1 if low else 0
        keep = len(layers)
        while keep > 1 and self.low_weight_runs.get(layers[keep - 1], 0) >= c.drop_layer_publishes:
            keep -= 1
        if keep == len(layers):
            return []
        self._keep_first_layers(keep)
        for layer in layers[keep:]:
            self.low_weight_runs.pop(layer, None)
        log.info("dropped layers %s: mix weight below %g", layers[keep:], c.drop_layer_weight)
        return layers[keep:]

    def _keep_first_layers(self, keep: int) -> None:
        """Cut the probe, its optimizer state, EMA and replay to the first ``keep`` layers."""
        pick = torch.arange(keep)
        momentum = self.optimizer_state()
        probe = keep_layers(self.probe, list(self.probe.layers[:keep]))
        params = {k: v.shape for k, v in probe.named_parameters()}
        self.probe, self.lion = probe, self._make_lion(probe)
        self.load_optimizer_state(slice_layer_state(momentum, params, pick))
        if self.ema is not None:
            shapes = {k: v.shape for k, v in probe.state_dict().items()}
            self.ema = slice_layer_state(self.ema, shapes, pick)
        self.replay.keep_first_layers(keep)
        if self.anchor is not None:
            self.anchor.keep_first_layers(keep)

    def metrics(self) -> dict[str, float]:
        """Prequential metrics, the layer-weight entropy and, per calibrated head, the labels
        the probe learned since its calibration was fitted (0: on this window), for the
        manifest."""
        ages = {
            f"calibration_age/{name}": float(self.counters.labels_seen - c.labels_seen)
            for name, c in self.probe.spec.calibration.items()
        }
        return {
            **self.prequential.report(),
            "layer_entropy": self.probe.layer_entropy(),
            **ages,
        }

    def publishable(self) -> Probe:
        """The probe to publish: the EMA of the weights when configured, else the probe."""
        if self.ema is None:
            return self.probe
        shadow = copy.deepcopy(self.probe)
        shadow.load_state_dict(self.ema)
        return shadow

    def drift_reference(self, probe: Probe) -> DriftReference | None:
        """``probe``'s drift statistics (:mod:`probes.drift`) on the replay buffer, the
        examples it learned from. The buffer holds every class equally; each example is
        weighted back to its class's share of the labels this learner has seen, so a stream
        that is 7 % toxic is not compared with a 50 % toxic reference."""
        batches = self.replay.weighted_chunks(self.bucket_seen)
        if not batches:
            return None
        device = next(probe.parameters()).device
        moved = ((h.to(device), m if m is None else m.to(device), w) for h, m, w in batches)
        return probe_reference(probe, moved)

    def optimizer_state(self) -> dict[str, Tensor]:
        """Lion's momentum per parameter name (:meth:`probes.learner.Learner.momentum`)."""
        return self.lion.momentum()

    def load_optimizer_state(
        self, state: dict[str, Tensor], labels: Sequence[str] | None = None
    ) -> int:
        """Restore momentum saved by :meth:`optimizer_state`; returns the tensors used
        (:meth:`probes.learner.Learner.load_momentum`: ``labels`` the saved probe's order)."""
        return self.lion.load_momentum(state, labels)

    def snapshot(self) -> dict[str, Any]:
        """Cheap figures for views and reports (no tensors)."""
        return {
            "labels_seen": self.counters.labels_seen,
            "steps": self.lion.steps,
            "warming_up": self.warming_up,
            "warmup_examples": len(self.warmup or []),
            "last_loss": self.last_loss,
            "prequential": self.prequential.report(),
            "layers": list(self.probe.layers),
            "layer_weights": [float(w) for w in self.probe.layer_weights().tolist()],
            "layer_entropy": self.probe.layer_entropy(),
        }


@dataclass
class _Saved:
    """What one batch of :meth:`OnlineLearner.learn` may change, copied before it: the
    weights and normalization, the Lion momentum and counts, the EMA, replay (and its
    sampling state), the prequential window, the warm-up, the counters and the heads the
    anchor has seen reached."""

    weights: dict[str, Tensor]
    optimizer: dict[str, Any]
    steps: tuple[int, int]
    ema: dict[str, Tensor] | None
    replay: list[list[Example]]
    rng: object
    prequential: tuple[list[Tensor], list[Tensor], list[Tensor], int]
    warmup: list[Example] | None
    last_loss: float | None
    counters: TrainingCounters
    bucket_seen: Counter[int]
    anchor_labeled: frozenset[str]  # empty without an anchor

    @classmethod
    def of(cls, learner: OnlineLearner) -> _Saved:
        with torch.no_grad():
            weights = {k: v.detach().clone() for k, v in learner.probe.state_dict().items()}
            ema = {k: v.clone() for k, v in learner.ema.items()} if learner.ema else None
        pre = learner.prequential
        return cls(
            weights=weights,
            optimizer=copy.deepcopy(learner.lion.optimizer.state_dict()),
            steps=(learner.lion.steps, learner.lion.examples),
            ema=ema,
            replay=[list(bucket) for bucket in learner.replay.buckets],
            rng=learner.replay.rng.getstate(),
            prequential=(list(pre.probs), list(pre.logits), list(pre.targets), pre.seen),
            warmup=None if learner.warmup is None else list(learner.warmup),
            last_loss=learner.last_loss,
            counters=learner.counters,
            bucket_seen=learner.bucket_seen.copy(),
            anchor_labeled=frozenset() if learner.anchor is None else learner.anchor.labeled,
        )

    def restore(self, learner: OnlineLearner) -> None:
        learner.probe.load_state_dict(self.weights)  # in place: the optimizer's parameters
        learner.lion.optimizer.load_state_dict(self.optimizer)
        learner.lion.steps, learner.lion.examples = self.steps
        if learner.ema is not None and self.ema is not None:
            with torch.no_grad():
                for k, v in self.ema.items():
                    learner.ema[k].copy_(v)
        for bucket, kept in zip(learner.replay.buckets, self.replay, strict=True):
            bucket.clear()
            bucket.extend(kept)
        learner.replay.rng.setstate(self.rng)  # type: ignore[arg-type]
        pre = learner.prequential
        probs, logits, targets, pre.seen = self.prequential
        pre.probs.clear()
        pre.probs.extend(probs)
        pre.logits.clear()
        pre.logits.extend(logits)
        pre.targets.clear()
        pre.targets.extend(targets)
        learner.warmup = self.warmup
        learner.last_loss = self.last_loss
        learner.counters = self.counters
        if learner.anchor is not None:
            learner.anchor.labeled = self.anchor_labeled
        learner.bucket_seen = self.bucket_seen
