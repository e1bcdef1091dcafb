"""Settings of the transport: Kafka (connection, consumer timing, topics and groups), Redis,
checkpoint integrity and data at rest.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator

from worker.settings.base import (
    PositiveInt,
    Section,
    check_key,
)


class KafkaSettings(Section):
    """The broker: how to reach it, consumer timing, topics and consumer groups."""

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

    @model_validator(mode="after")
    def _kafka_consistent(self) -> KafkaSettings:
        sasl = self.kafka_security_protocol.startswith("SASL")
        if sasl and not (self.kafka_sasl_mechanism and self.kafka_sasl_username):
            raise ValueError(
                f"kafka_security_protocol={self.kafka_security_protocol} needs "
                "kafka_sasl_mechanism and kafka_sasl_username (and a password)"
            )
        if self.kafka_heartbeat_interval_ms * 3 > self.kafka_session_timeout_ms:
            raise ValueError("kafka_heartbeat_interval_ms should be at most a third of the session")
        return self

    def updater_group(self, probe: str) -> str:
        """The consumer group of ``probe``'s updaters (one group per probe, so no probe's
        updater takes label partitions from another's)."""
        return f"{self.group_updater}.{probe}"


class StoreSettings(Section):
    """Redis, how checkpoints are signed and verified, and what is encrypted at rest."""

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

    @model_validator(mode="after")
    def _store_consistent(self) -> StoreSettings:
        for name in ("checkpoint_hmac_key", "cache_key"):
            check_key(name, getattr(self, name))
        if self.checkpoint_hmac_key is not None and self.deployment_id is None:
            raise ValueError(
                "PROBEGUARD_DEPLOYMENT_ID is required with PROBEGUARD_CHECKPOINT_HMAC_KEY: "
                "signatures bind it, so that deployments sharing the key (staging and "
                "production, whose Redis prefixes are alike by default) never verify each "
                "other's checkpoints. Give each deployment its own, e.g. `prod-eu`; to keep "
                "verifying what this deployment signed so far, set it to the Redis prefix "
                f"({self.redis_prefix!r})"
            )
        return self

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
