"""Settings of online learning (the updater) and of the rollout of the versions it publishes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator

from schemas import OperatingPoint
from worker.settings.base import (
    PositiveInt,
    Section,
)


class UpdaterSettings(Section):
    """The updater: Lion steps from human labels, publishing, seeding, label admission."""

    # --- Updater (online learning) -----------------------------------------
    train_probe: str | None = Field(
        None, description="The probe an updater trains (unset: the first of `PROBES`)."
    )
    learn_lr: Annotated[float, Field(gt=0, le=1)] = Field(
        3e-4, description="Lion learning rate (3-10x below what AdamW would want)."
    )
    learn_weight_decay: Annotated[float, Field(ge=0)] = Field(
        0.01, description="Lion's decoupled weight decay."
    )
    learn_batch_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        32,
        description="New labels per step; each step adds at least as many class-balanced "
        "replayed ones (topping up to this size).",
    )
    learn_steps_per_batch: Annotated[int, Field(ge=1, le=100)] = Field(
        2, description="Lion steps on each mini-batch of new labels."
    )
    replay_size: Annotated[int, Field(ge=0)] = Field(
        1024, description="Replay buffer size, examples, split evenly between classes."
    )
    prequential_window: Annotated[int, Field(ge=10)] = Field(
        500, description="Labels in the test-then-train (prequential) metric window."
    )
    stats_warmup: Annotated[int, Field(ge=1)] = Field(
        64,
        description="Labels a fresh probe collects to fix its input normalization before it "
        "learns.",
    )
    ema_decay: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None,
        description="Publish an exponential moving average of the weights with this decay "
        "(e.g. `0.99`; unset: the weights themselves).",
    )
    publish_every_labels: PositiveInt = Field(
        64, description="Publish a version after this many new labels ..."
    )
    publish_every_s: Annotated[float, Field(gt=0)] = Field(
        30.0, description="... or after this many seconds with unpublished labels."
    )
    keep_versions: PositiveInt = Field(
        20,
        description="Versions kept in Redis (never the live or canary one, nor the two lives "
        "before live: the rollback targets).",
    )
    # int8 (per-row scales, probes/quantize.py) is about a quarter of the bytes in Redis
    # and on every scorer's reload; the updater keeps training in fp32.
    publish_weights: Literal["fp32", "int8"] = Field(
        "fp32",
        description="How published checkpoints store the probe weights: `int8` with per-row "
        "scales is about a quarter of the bytes, dequantized to fp32 on load (see "
        "[int8 probes](cli.md#int8-probes)).",
    )
    lease_ttl_ms: Annotated[int, Field(ge=1000)] = Field(
        10_000,
        description="The updater lease, ms: a hot standby takes over this long after the "
        "holder dies.",
    )
    seed_checkpoint: Path | None = Field(
        None,
        description="Offline-trained checkpoint directory (e.g. from `probeguard fit`) an "
        "updater starts from when nothing is published.",
    )
    # After a key rotation every retained version fails verification; starting over would
    # silently throw away what was learned (and auto_live would serve the fresh probe).
    start_over_unverified: bool = Field(
        False,
        description="Let an updater start over (the seed checkpoint, the packaged default or "
        "from zero) when versions are published but none verifies with this key and LLM (e.g. "
        "after rotating `CHECKPOINT_HMAC_KEY`). Off: it refuses to start and says why.",
    )
    seed_spec: Path | None = Field(
        None,
        description="`ProbeSpec` JSON for a start from zero (unset: binary toxicity, "
        "downcast MHA pooling, scalar mix over 8 spread layers).",
    )
    entropy_alarm: Annotated[float, Field(ge=0)] = Field(
        0.5,
        description="Layer-weight entropy, nats, under which the layer-collapse alarm gauge is 1.",
    )
    calibrate_min_positives: Annotated[int, Field(ge=0)] = Field(
        20,
        description="Each published version's flag thresholds move to `OPERATING_POINT` on the "
        "prequential window once it holds this many positives of the label (`0`: keep "
        "arg-max); a calibrated probe's head gets its temperature and bias refitted there "
        "once the window holds this many of each of the head's labels.",
    )
    # Without it Lion's fixed-size steps collapse the mix onto one layer within a few
    # hundred labels (see probes/learner.py).
    learn_mix_entropy: Annotated[float, Field(ge=0)] = Field(
        0.05,
        description="Weight of the layer-mix entropy penalty (`λ·(log L − H)`) that keeps "
        "Lion from collapsing the mix onto one layer (`0`: off).",
    )
    learn_layer_lr_scale: Annotated[float, Field(gt=0)] = Field(
        30.0, description="Learning-rate multiplier of the layer-mix scalars."
    )
    learn_anchor_unlabeled: bool = Field(
        True,
        description="While a multi-head probe learns, hold each head no label of this "
        "tenure has reached to the scores it gave when the tenure began (its own "
        "probabilities as targets on every labeled text), so labels for one head do not move "
        "the others through the pooling and mix they share; a head learns from its labels "
        "from the first that reaches it. `false`: unlabeled heads follow the shared part.",
    )
    learn_freeze_shared: bool = Field(
        False,
        description="Train only the linear head's rows; the token pooling and layer mix that "
        "every head shares stay frozen (a head added from few labels cannot change the other "
        "heads' scores). bench/custom_head.md measures both.",
    )
    # Off by default: the entropy penalty keeps every weight away from 0 on purpose, and a
    # dropped layer never comes back to this probe's lineage; `fit --depth auto` measures
    # the quality of a shallower probe directly.
    learn_drop_layer_weight: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.0,
        description="At each publish, drop the deepest layers whose scalar-mix weight stayed "
        "below this for `LEARN_DROP_LAYER_PUBLISHES` publishes in a row: the version reads "
        "fewer layers and scorers stop their forward pass earlier (e.g. `0.02`; `0`: off).",
    )
    learn_drop_layer_publishes: Annotated[int, Field(ge=1, le=1000)] = Field(
        5,
        description="Publishes in a row a layer's weight must stay below "
        "`LEARN_DROP_LAYER_WEIGHT` before it is dropped.",
    )
    operating_point: str = Field(
        "f1",
        description="Where calibrated flag thresholds go: `f1` (its maximum), "
        "`precision>=0.9` (the most recall at that precision) or `recall>=0.8` (the most "
        "precision at that recall).",
    )
    labeler_max_labels: Annotated[int, Field(ge=0)] = Field(
        1000,
        description="Labels one labeler (`labeler_id`) may give a probe per "
        "`LABELER_WINDOW_S`, across updaters (a Redis counter); the rest are dead-lettered "
        "as `quarantined` and counted per labeler. A repeated label (same probe, message "
        "and labeler) is learned once and does not count (`0`: no limit).",
    )
    labeler_window_s: Annotated[int, Field(ge=1, le=7 * 86_400)] = Field(
        3600, description="Length of that per-labeler window, seconds."
    )
    labeler_keys: SecretStr | None = Field(
        None,
        description="Who a label is from, by signature (secret): `NAME:SECRET` entries "
        "(labels of `labeler_id` NAME signed with SECRET are NAME's) and `NAME/*:SECRET` "
        "(a signer that authenticates its users, as the console does with `console/*`: its "
        "labels are `NAME/<labeler_id>`), comma-separated; secrets of at least 16 bytes. "
        "Set, every unsigned or wrongly signed label counts as the one labeler `anonymous` "
        "for the per-labeler limit and `PROMOTE_MIN_LABELERS`. Unset: `labeler_id` is "
        "trusted as written.",
    )

    @model_validator(mode="after")
    def _updater_consistent(self) -> UpdaterSettings:
        try:
            OperatingPoint.parse(self.operating_point)
        except ValueError as exc:
            raise ValueError(f"operating_point: {exc}") from exc
        return self

    @property
    def flag_operating_point(self) -> OperatingPoint:
        """``operating_point`` parsed (validated when the settings were built)."""
        return OperatingPoint.parse(self.operating_point)


class RolloutSettings(Section):
    """How a published version goes live: manual, canary or at once, and when it rolls back."""

    # --- Rollout (worker/rollout/policy.py; evaluated by the active updater) ------
    rollout: Literal["auto_live", "canary", "manual"] = Field(
        "auto_live",
        description="`auto_live`: new versions go live at once. `canary`: new versions are "
        "candidates, the newest becomes the canary, then is promoted or rolled back on "
        "evidence. `manual`: no automatic stage change. The deprecated `PROBEGUARD_AUTO_LIVE` "
        "is still read when this is unset (`true` = `auto_live`, `false` = `manual`; a "
        "warning says so); set, this wins.",
    )
    canary_share: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        0.1,
        description="Share of conversations the policy's canary decides (also the CLI's default).",
    )
    promote_min_labels: PositiveInt = Field(
        200, description="Labels on the canary's messages before it can be promoted."
    )
    promote_min_labelers: PositiveInt = Field(
        2,
        description="Distinct labelers whose labels the canary's evidence holds before it "
        "can be promoted: one labeler alone (a misused credential, a buggy client) cannot "
        "promote a canary (`1` for a single-reviewer deployment).",
    )
    promote_epsilon: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.02, description="ε: promote when canary F1 ≥ live F1 − ε."
    )
    rollback_delta: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.05, description="δ: roll back when canary F1 < live F1 − δ (δ ≥ ε)."
    )
    rollback_min_labels: PositiveInt = Field(
        50, description="Labels before the F1 rollback rule applies."
    )
    rollback_flag_rate_factor: Annotated[float, Field(gt=1.0)] = Field(
        2.0,
        description="Roll back when the canary's and live's flag rates differ by more than "
        "this factor (rates smoothed as (flags+1)/(n+2)).",
    )
    rollback_min_messages: PositiveInt = Field(
        200, description="Messages (canary and live each) before the flag-rate rule applies."
    )
    rollback_head_min_flags: PositiveInt = Field(
        20,
        description="Per head of a multi-head probe, the flag-rate rule also needs this many "
        "flags: the canary's, or the ones live's rate predicts for its messages (a rare head's "
        "few flags differ by a factor by chance).",
    )
    rollout_check_interval_s: Annotated[float, Field(gt=0)] = Field(
        2.0, description="How often the active updater evaluates the policy, seconds."
    )
    evidence_pairs: Annotated[int, Field(ge=0, le=100_000)] = Field(
        2000, description="Score/truth pairs kept per version for its AUPRC."
    )

    @model_validator(mode="after")
    def _rollout_consistent(self) -> RolloutSettings:
        if self.promote_epsilon > self.rollback_delta:
            raise ValueError(
                "promote_epsilon must not exceed rollback_delta (a canary that may be promoted "
                "must not at the same time be bad enough to roll back)"
            )
        return self
