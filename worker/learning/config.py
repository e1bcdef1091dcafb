"""The updater's learning settings, one frozen slice of :class:`worker.settings.Settings`.

Apart from :mod:`worker.learning.online_learner` so that what the learner is configured
with reads in one place, each field with the ``PROBEGUARD_*`` setting it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import OperatingPoint, StateDtype
from worker.llm.precision import resolve_state_dtype
from worker.settings import DEFAULTS, Settings

__all__ = ["LearningConfig"]


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
    anchor_unlabeled: bool = DEFAULTS.learn_anchor_unlabeled  # worker.learning.anchor
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
            anchor_unlabeled=settings.learn_anchor_unlabeled,
            operating_point=settings.flag_operating_point,
            state_dtype=resolve_state_dtype(settings.state_dtype, model_type),
            drop_layer_weight=settings.learn_drop_layer_weight,
            drop_layer_publishes=settings.learn_drop_layer_publishes,
        )
