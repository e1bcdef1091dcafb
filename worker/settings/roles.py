"""Settings every role shares (wire limits, metrics, identity) and the scorer's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas import DEFAULT_LIMITS, Limits
from schemas.limits import HARD_MAX_LABELS, HARD_MAX_TEXT_CHARS
from worker.settings.base import (
    DEFAULT_PROBE_NAME,
    PositiveInt,
    Section,
)


class CommonSettings(Section):
    """What every role reads: wire limits, polling, metrics, logging, identity."""

    # --- Wire limits (every role that decodes a topic) ---------------------------
    max_text_chars: Annotated[int, Field(ge=1, le=HARD_MAX_TEXT_CHARS)] = Field(
        DEFAULT_LIMITS.max_text_chars,
        description="Longest message text, characters; longer messages are dead-lettered.",
    )
    max_labels: Annotated[int, Field(ge=1, le=HARD_MAX_LABELS)] = Field(
        DEFAULT_LIMITS.max_labels, description="Most labels on one human label or probe."
    )
    max_metadata_bytes: Annotated[int, Field(ge=2)] = Field(
        DEFAULT_LIMITS.max_metadata_bytes,
        description="Largest `ChatMessage.metadata`, bytes of compact JSON.",
    )

    # --- Every role (scorer, updater, console) -----------------------------------
    poll_wait_ms: Annotated[int, Field(ge=1, le=60_000)] = Field(
        200, description="Longest a poll waits for a batch to fill, ms."
    )
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        9300,
        description="Port of `/metrics`, `/healthz` and `/readyz` of a scorer or updater "
        "(`0`: no server).",
    )
    stall_not_ready_s: Annotated[float, Field(gt=0)] = Field(
        30.0,
        description="A scorer or updater whose batch in hand has failed to complete (broker, "
        "handler, Redis) for this many seconds reports not ready on `/readyz`.",
    )
    device_faults_to_restart: Annotated[int, Field(ge=1)] = Field(
        5,
        description="A scorer or updater whose batch in hand failed this many times in a "
        "row on a device fault other than out of memory (e.g. a CUDA illegal memory "
        "access, which lasts until the process restarts) fails `/healthz`, so the "
        "orchestrator restarts it and its partitions move on; `/readyz` says why.",
    )
    log_json: bool = Field(False, description="Log one JSON object per line.")
    worker_id: str | None = Field(
        None,
        description="Id this process reports in verdicts, dead letters and the updater lease "
        "(unset: `hostname-pid`).",
    )

    @property
    def limits(self) -> Limits:
        return Limits(
            max_text_chars=self.max_text_chars,
            max_labels=self.max_labels,
            max_metadata_bytes=self.max_metadata_bytes,
        )

    def resolved_worker_id(self) -> str:
        import socket

        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"


class ScorerSettings(Section):
    """The scorer: which probes, which heads flag, review routing, the default probe, drift."""

    # --- Scorer --------------------------------------------------------------
    probes: str = Field(
        DEFAULT_PROBE_NAME,
        description="Comma-separated probe names every scorer serves (lowercase letters, "
        "digits, `_` and `-`, as on the wire; not `text`, `decided`, `review`, "
        "`review_budget`, `counted`, `once` or `console`, which deployment-wide Redis keys "
        "use). The default, `moderation`, is what the packaged multi-head default serves "
        "as; before it was `toxicity`, still a fine name for a single-head probe: a "
        "registry that holds versions of `toxicity` and none of `moderation` makes the "
        "roles refuse to start until this is set.",
    )
    flag_heads: str | None = Field(
        None,
        description="Comma-separated heads of multi-head probes whose flag labels flag a "
        "verdict (e.g. `toxicity,sexual-minors`); the other heads still score and say what "
        "they predict. Unset: every head that has flag labels. Heads a probe lacks are "
        "ignored.",
    )
    review_low: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.35,
        description="Lower end of the uncertain band: flag scores in "
        "[`REVIEW_LOW`, `REVIEW_HIGH`] go to the review topic.",
    )
    review_high: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.65, description="Upper end of the uncertain band (see `REVIEW_LOW`)."
    )
    review_audit_share: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.01,
        description="Share of all messages sent to review at random as an audit (sticky by "
        "message id).",
    )
    review_max_per_window: Annotated[int, Field(ge=0)] = Field(
        120,
        description="Review requests admitted per window, across all scorers (a Redis "
        "counter); the rest are not queued.",
    )
    review_window_s: Annotated[int, Field(ge=1, le=86_400)] = Field(
        60, description="Length of that review budget window, seconds."
    )
    # While the shared counter is unreachable (the registry's Redis breaker is open), each
    # scorer admits this many on its own, so an outage does not silently drop every review.
    review_local_max_per_window: Annotated[int, Field(ge=0)] = Field(
        12,
        description="Review requests one scorer admits per window on its own while the shared "
        "budget in Redis is unreachable (0: none until Redis answers).",
    )
    text_cache_ttl_s: PositiveInt = Field(
        7 * 24 * 3600,
        description="How long scorers keep message texts (and decisions) in Redis for label "
        "joins, seconds (default: 7 days).",
    )
    text_cache_max_bytes: PositiveInt = Field(
        128 * 1024,
        description="Longer texts (UTF-8 bytes) are not cached; their labels must carry the text.",
    )
    default_probe: bool = Field(
        True,
        description="Start from the packaged default probe of the configured LLM and text "
        "form when the registry has nothing published: scorers serve it at once (version 0, "
        "one score per head), updaters fine-tune from it. `false`: scorers wait for a "
        "published version, updaters start from `SEED_CHECKPOINT` or from zero.",
    )
    default_attention: bool = Field(
        True,
        description="An updater fine-tuning the packaged default (a mean pool) first gives "
        "it an attention pool (`mha`: the same scores until it learns), so the deployment's "
        "labels also teach it which tokens matter. `false`: fine-tune the mean pool as it is "
        '(see docs/default-probe.md, "With the deployment\'s labels").',
    )
    default_flag_budget: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        None,
        description="The share of ordinary (benign) text the packaged default may flag, any "
        "head counted: its flag thresholds move to the operating point its card ships for "
        "this budget (0.01, 0.02, 0.03, 0.05 or 0.1; chosen out of fold on the benign rows "
        "of every training set; see docs/default-probe.md). Unset: as shipped (0.03).",
    )
    bootstrap_checkpoint: Path | None = Field(
        None,
        description="Checkpoint directory a scorer serves until the registry has a live "
        "version (unset: it waits).",
    )
    shadow: bool = Field(
        False,
        description="Score every message with live and canary, act on live only, and record "
        "the canary's scores and agreement.",
    )
    stage_check_interval_s: Annotated[float, Field(gt=0)] = Field(
        5.0,
        description="Periodic re-read of the stage pointers, seconds (besides following the "
        "event stream).",
    )
    probe_watch: Literal["thread", "poll"] = Field(
        "thread",
        description="How scorers follow the probe registry: `thread` (a watcher thread blocks "
        "on the event stream, loads and verifies a new version off the scoring thread and "
        "swaps it in for the next batch) or `poll` (the scoring thread checks between "
        "batches, so a change waits for the batch in hand).",
    )
    drift_window: Annotated[int, Field(ge=10, le=1_000_000)] = Field(
        1000,
        description="Drift monitoring: each scorer compares its last this many messages, per "
        "served version with training statistics in its checkpoint, with those statistics "
        "(`probeguard_scorer_drift_*`; see deploy/README.md, Monitoring).",
    )
    drift_min_messages: Annotated[int, Field(ge=1)] = Field(
        200,
        description="Messages a drift window must hold before its gauges are exported (fewer "
        "give noisy numbers; at most `DRIFT_WINDOW`).",
    )
    drift_alert_shift: Annotated[float, Field(gt=0)] = Field(
        1.0,
        description="Standardized mean shift of a layer's pooled state that the console marks "
        "as drift (keep it equal to the `ProbeguardInputDrift` rule of deploy/alerts.yml).",
    )
    drift_alert_psi: Annotated[float, Field(gt=0)] = Field(
        0.25,
        description="Score PSI the console marks as drift (as in the `ProbeguardInputDrift` rule).",
    )

    @model_validator(mode="after")
    def _scorer_consistent(self) -> ScorerSettings:
        if self.review_low > self.review_high:
            raise ValueError("review_low must not exceed review_high")
        if not self.probe_names:
            raise ValueError("probes must name at least one probe")
        return self

    @property
    def probe_names(self) -> list[str]:
        return [p.strip() for p in self.probes.split(",") if p.strip()]

    @property
    def flag_head_names(self) -> frozenset[str] | None:
        if self.flag_heads is None:
            return None
        return frozenset(h.strip() for h in self.flag_heads.split(",") if h.strip())
