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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from probes.calibration import fit_heads
from probes.drift import probe_reference
from probes.errors import ProbeError
from probes.heads import remap_label_rows
from probes.kinds.pooling import SUMMARIES
from probes.learner import Learner
from probes.metrics import choose_thresholds
from probes.probe import Probe, keep_layers, slice_layer_state
from schemas import DriftReference, OperatingPoint, StateDtype, TrainingCounters
from worker.learning.replay import Example, Prequential, ReplayBuffer, collate_chunks
from worker.llm.precision import resolve_state_dtype
from worker.settings import DEFAULTS, Settings

if TYPE_CHECKING:
    from worker.llm.extract import Extraction

__all__ = ["Labeled", "Learned", "LearningConfig", "OnlineLearner"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearningConfig:
    """The updater's learning settings; every default is the ``PROBEGUARD_*`` setting's
    (``DEFAULTS``), so ``LearningConfig()`` and ``from_settings(Settings())`` agree."""

    lr: float = DEFAULTS.learn_lr  # Lion learning rate (its step size is fixed: lr · sign)
    weight_decay: float = DEFAULTS.learn_weight_decay
    batch_size: int = DEFAULTS.learn_batch_size  # new examples per step; as many replayed join
    steps_per_batch: int = DEFAULTS.learn_steps_per_batch  # Lion steps on each mini-batch
    replay_size: int = DEFAULTS.replay_size  # class-balanced memory, examples
    prequential_window: int = DEFAULTS.prequential_window  # test-then-train window, examples
    stats_warmup: int = DEFAULTS.stats_warmup  # a fresh probe's normalization comes from these
    ema_decay: float | None = DEFAULTS.ema_decay  # publish an EMA of the weights (None: weights)
    calibrate_min_positives: int = DEFAULTS.calibrate_min_positives  # before a threshold moves
    mix_entropy: float = DEFAULTS.learn_mix_entropy  # layer-mix entropy penalty (probes.learner)
    layer_lr_scale: float = DEFAULTS.learn_layer_lr_scale  # lr multiplier of the mix scalars
    freeze_shared: bool = DEFAULTS.learn_freeze_shared  # step the linear head alone
    operating_point: OperatingPoint = DEFAULTS.flag_operating_point  # where thresholds go
    # How replay stores hidden states (Settings.state_dtype resolved for the LLM: from_settings).
    state_dtype: StateDtype = "float16"
    # Drop the deepest layers whose scalar-mix weight stayed below this for
    # `drop_layer_publishes` publishes in a row (0: never; see drop_negligible_layers).
    drop_layer_weight: float = DEFAULTS.learn_drop_layer_weight
    drop_layer_publishes: int = DEFAULTS.learn_drop_layer_publishes

    @classmethod
    def from_settings(cls, settings: Settings, *, model_type: str = "") -> LearningConfig:
        """The learning settings; ``model_type`` (the LLM's ``config.model_type``) decides
        what ``STATE_DTYPE=auto`` stores replay in (:func:`resolve_state_dtype`)."""
        return cls(
            lr=settings.learn_lr,
            weight_decay=settings.learn_weight_decay,
            batch_size=settings.learn_batch_size,
            steps_per_batch=settings.learn_steps_per_batch,
            replay_size=settings.replay_size,
            prequential_window=settings.prequential_window,
            stats_warmup=settings.stats_warmup,
            ema_decay=settings.ema_decay,
            calibrate_min_positives=settings.calibrate_min_positives,
            mix_entropy=settings.learn_mix_entropy,
            layer_lr_scale=settings.learn_layer_lr_scale,
            freeze_shared=settings.learn_freeze_shared,
            operating_point=settings.flag_operating_point,
            state_dtype=resolve_state_dtype(settings.state_dtype, model_type),
            drop_layer_weight=settings.learn_drop_layer_weight,
            drop_layer_publishes=settings.learn_drop_layer_publishes,
        )


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
        new = self._examples(hidden, mask, targets, buckets)
        steps_before = self.lion.steps
        if self.warmup is not None:
            self.warmup.extend(new)
            if len(self.warmup) < self.config.stats_warmup:
                new = []
            else:
                self._set_stats(self.warmup)
                new, self.warmup = self.warmup, None
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
        """Rows of ``hidden [L, B, T, D]`` that cannot be learned from: NaN or inf in the
        example as replay keeps it (``state_dtype``: in fp16 values beyond 65504 count).
        Not learned from: one such row would make every later loss non-finite."""
        dtype = self._dtype
        with torch.no_grad():
            if self.probe.separable:
                kept = SUMMARIES[self.probe.spec.token_pool](hidden, mask).to(dtype)  # [L, B, D]
                ok = torch.isfinite(kept).all(dim=2).all(dim=0)  # [B]
            else:
                finite = torch.isfinite(hidden.to(dtype)) | ~mask[None, :, :, None]  # [L,B,T,D]
                ok = finite.flatten(2).all(dim=2).all(dim=0)  # [B]
        return [int(b) for b in (~ok).nonzero().flatten().tolist()]

    def _examples(
        self, hidden: Tensor, mask: Tensor, targets: Tensor, buckets: list[int]
    ) -> list[Example]:
        """What replay keeps: raw summaries ``[L, D]`` for separable pools, else the real
        tokens ``[L, T, D]``; in ``state_dtype`` either way."""
        if self.probe.separable:
            with torch.no_grad():
                raw = SUMMARIES[self.probe.spec.token_pool](hidden, mask)  # [L, B, D]
                pooled = raw.to(self._dtype)
            return [
                Example(pooled[:, b].clone(), targets[b], bucket)
                for b, bucket in enumerate(buckets)
            ]
        out = []
        for b, bucket in enumerate(buckets):
            real = mask[b].nonzero().flatten()
            out.append(Example(hidden[:, b, real].to(self._dtype).clone(), targets[b], bucket))
        return out

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
        if examples[0].x.dim() == 2:
            data = torch.stack([e.x.float() for e in examples])  # [N, L, D]
        else:
            data = torch.cat([e.x.float().transpose(0, 1) for e in examples])  # [N_tok, L, D]
        mean, std = data.mean(dim=0), data.std(dim=0)
        self.probe.set_input_stats(mean, torch.where(std > 1e-6, std, torch.ones_like(std)))
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
        """Flag thresholds at the operating point (default: the F1 maximum) on the
        prequential window: the online counterpart of ``fit`` choosing them out of fold. Each
        label's threshold moves only once the window holds ``calibrate_min_positives`` of its
        positives (0: never).

        A probe that carries a calibration (``fit``'s, :mod:`probes.calibration`) has it
        refitted first on the window's uncalibrated logits, head by head: a head whose window
        rows hold ``calibrate_min_positives`` positives of each of its labels gets a new
        temperature and bias (so all its labels get new thresholds too, chosen on the
        probabilities under it). One without that evidence keeps both its calibration and
        its thresholds, a pair that still makes the same decisions on the same logits; how
        many labels the probe learned since its calibration was fitted is
        ``calibration_age/<head>`` in :meth:`metrics` (the manifest). Refitting rather than
        dropping it: dropping would throw the served scores back to the class-balanced
        loss's scale (about half flagged) after a handful of labels, when the calibration
        is still nearly right, and a threshold on a softmax over more than two labels has
        no exact counterpart without it. A probe without a calibration gets none here."""
        need = self.config.calibrate_min_positives
        window = self.prequential.logit_window()
        if not need or window is None:
            return
        logits, targets = window
        spec = self.probe.spec
        probs = torch.stack(list(self.prequential.probs))  # [N, C] as they were served
        if spec.calibration:
            refit = fit_heads(
                spec, logits, targets, min_positives=need, labels_seen=self.counters.labels_seen
            )
            if refit:
                self.probe.set_calibration({**spec.calibration, **refit})
                spec = self.probe.spec
            kept = sorted(set(spec.calibration) - set(refit))
            if kept:
                log.info(
                    "calibration of heads %s kept: the window holds fewer than %d positives "
                    "of one of their labels",
                    kept,
                    need,
                )
            probs = self.probe.probabilities(logits)  # the window under the calibration now
        chosen = choose_thresholds(
            spec, probs, targets, min_positives=need, point=self.config.operating_point
        )
        if chosen:
            self.probe.set_thresholds({**spec.thresholds, **chosen})

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
        batches: list[tuple[Tensor, Tensor | None, Tensor | None]] = []
        for bucket in self.replay.buckets if self.replay.per_bucket else []:
            if not bucket:
                continue
            examples = list(bucket)
            seen = self.bucket_seen.get(examples[0].bucket, 0) if self.bucket_seen else None
            weight = 1.0 if seen is None else seen / len(examples)
            for hidden, mask, _ in collate_chunks(examples, chunk=64):
                batches.append((hidden, mask, torch.full((hidden.shape[1],), weight)))
        if not batches:
            return None
        device = next(probe.parameters()).device
        moved = ((h.to(device), m if m is None else m.to(device), w) for h, m, w in batches)
        return probe_reference(probe, moved)

    def optimizer_state(self) -> dict[str, Tensor]:
        """Lion's momentum per parameter name (safetensors-ready, on the CPU)."""
        state = {}
        for name, param in self.probe.named_parameters():
            exp_avg = self.lion.optimizer.state.get(param, {}).get("exp_avg")
            if exp_avg is not None:
                state[name] = exp_avg.detach().cpu().contiguous()
        return state

    def load_optimizer_state(
        self, state: dict[str, Tensor], labels: Sequence[str] | None = None
    ) -> int:
        """Restore momentum saved by :meth:`optimizer_state`; returns the tensors used
        (names or shapes that no longer match are skipped).

        ``labels``: the label order of the probe the state was saved from, when it may
        differ from this probe's (a head added or removed since): the linear head's rows
        then follow their labels, and a new label's rows start at zero momentum."""
        params = dict(self.probe.named_parameters())
        if labels is not None and list(labels) != list(self.probe.spec.labels):
            try:
                state = remap_label_rows(state, labels, self.probe.spec.labels)
            except ProbeError as exc:
                log.warning("optimizer state does not fit its labels (%s); skipping rows", exc)
        used = 0
        for name, exp_avg in state.items():
            param = params.get(name)
            # Parameters a frozen learner does not step have no state to restore.
            stepped = param is not None and id(param) in self._stepped()
            if param is not None and stepped and param.shape == exp_avg.shape:
                self.lion.optimizer.state[param]["exp_avg"] = exp_avg.to(param.device).clone()
                used += 1
        return used

    def _stepped(self) -> set[int]:
        return {id(p) for group in self.lion.optimizer.param_groups for p in group["params"]}

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
    sampling state), the prequential window, the warm-up and the counters."""

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
        learner.bucket_seen = self.bucket_seen
