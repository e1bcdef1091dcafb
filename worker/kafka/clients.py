"""Kafka plumbing: client configuration from settings, producer/consumer factories, topics.

The same code talks to Apache Kafka in production and to the embedded tansu
broker locally. Where tansu differs (a group forms in about half a session timeout;
auto-created topics get 4 partitions), the form that is correct on both is used:
explicit commits, ``auto_offset_reset="earliest"``, group timing of 6000/1000 ms
(a group forms in ~3 s instead of 23 s), lag from the consumer's high watermark.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from worker.errors import KafkaSetupError
from worker.settings import KafkaSettings

__all__ = [
    "all_topics",
    "client_config",
    "close_producer",
    "consumer_lag",
    "ensure_topics",
    "make_admin",
    "make_consumer",
    "make_producer",
]

log = logging.getLogger(__name__)


def client_config(settings: KafkaSettings) -> dict[str, Any]:
    """Connection and security options shared by producers, consumers and admin clients."""
    cfg: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in settings.kafka_bootstrap.split(",") if s.strip()],
        "client_id": settings.kafka_client_id,
        "security_protocol": settings.kafka_security_protocol,
        "request_timeout_ms": settings.kafka_request_timeout_ms,
    }
    if settings.kafka_security_protocol.startswith("SASL"):
        cfg["sasl_mechanism"] = settings.kafka_sasl_mechanism
        cfg["sasl_plain_username"] = settings.kafka_sasl_username
        if settings.kafka_sasl_password is not None:
            cfg["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    if settings.kafka_security_protocol in ("SSL", "SASL_SSL"):
        cfg["ssl_check_hostname"] = settings.kafka_ssl_check_hostname
        for key in ("cafile", "certfile", "keyfile"):
            value = getattr(settings, f"kafka_ssl_{key}")
            if value is not None:
                cfg[f"ssl_{key}"] = str(value)
        if settings.kafka_ssl_password is not None:
            cfg["ssl_password"] = settings.kafka_ssl_password.get_secret_value()
    return cfg


def all_topics(settings: KafkaSettings) -> list[str]:
    """Every topic probeguard reads or writes."""
    return [
        settings.topic_chat,
        settings.topic_labels,
        settings.topic_verdicts,
        settings.topic_review,
        settings.topic_dead_letter,
    ]


def make_admin(settings: KafkaSettings) -> KafkaAdminClient:
    try:
        return KafkaAdminClient(**client_config(settings))
    except KafkaError as exc:
        raise KafkaSetupError(f"cannot reach Kafka at {settings.kafka_bootstrap!r}: {exc}") from exc


def ensure_topics(
    settings: KafkaSettings,
    topics: Iterable[str] | None = None,
    partitions: int | None = None,
) -> list[str]:
    """Create missing topics with ``partitions`` partitions; existing ones are left alone.

    Idempotent and safe to race (another process creating the same topic is
    fine). Returns the topics this call created.
    """
    wanted = list(topics) if topics is not None else all_topics(settings)
    count = partitions or settings.topic_partitions
    admin = make_admin(settings)
    try:
        try:
            existing = set(admin.list_topics())
        except KafkaError as exc:  # e.g. a timeout: the broker went away after connecting
            raise KafkaSetupError(f"cannot list the topics: {exc}") from exc
        missing = [t for t in wanted if t not in existing]
        created = []
        for topic in missing:  # one at a time: a race on one must not hide the others
            try:
                admin.create_topics(
                    [
                        NewTopic(
                            topic,
                            num_partitions=count,
                            replication_factor=settings.topic_replication,
                        )
                    ]
                )
                created.append(topic)
            except TopicAlreadyExistsError:
                pass
            except KafkaError as exc:
                raise KafkaSetupError(f"cannot create topic {topic!r}: {exc}") from exc
        if created:
            log.info("created topics %s with %d partitions", created, count)
        return created
    finally:
        admin.close()


def make_producer(settings: KafkaSettings, **overrides: Any) -> KafkaProducer:
    """An idempotent, acks=all producer; ``overrides`` win over the defaults."""
    cfg = client_config(settings)
    cfg.update(
        acks="all",
        enable_idempotence=True,
        linger_ms=5,
        retries=2**31 - 1,
        delivery_timeout_ms=120_000,
    )
    cfg.update(overrides)
    try:
        return KafkaProducer(**cfg)
    except KafkaError as exc:
        raise KafkaSetupError(
            f"cannot create a producer for {settings.kafka_bootstrap!r}: {exc}"
        ) from exc


def close_producer(producer: KafkaProducer, timeout_s: float) -> bool:
    """Flush and close ``producer`` within ``timeout_s``; True if everything was sent.

    With a broker away, kafka-python's ``close`` raises its flush timeout and leaves the
    producer open, so its ``__del__`` tries again later in whatever thread collects it
    (a ``KafkaTimeoutError`` nobody can catch). Here what is still unsent is failed
    instead (at most once: its callbacks see the error) and the producer is closed for
    certain."""
    try:
        producer.flush(timeout=timeout_s)
        sent = True
    except KafkaError as exc:
        log.warning("closing a producer: %s; what was not sent is dropped", type(exc).__name__)
        sent = False
        producer._accumulator.abort_incomplete_batches()  # close's own flush then returns
    producer.close(timeout=0 if not sent else timeout_s)
    return sent


def reader_config(settings: KafkaSettings) -> dict[str, Any]:
    """``client_config`` for a consumer that reads a topic from the start outside any group
    (views, benchmarks, tests), with the settings' fetch wait."""
    return {
        **client_config(settings),
        "auto_offset_reset": "earliest",
        "enable_auto_commit": False,
        "fetch_max_wait_ms": settings.kafka_fetch_max_wait_ms,
    }


def make_consumer(
    settings: KafkaSettings,
    group_id: str,
    topics: Iterable[str] = (),
    **overrides: Any,
) -> KafkaConsumer:
    """A group consumer with manual commits, reading from the earliest uncommitted offset.

    Commit only after the work for the polled records is durable (at-least-once).
    """
    cfg = client_config(settings)
    cfg.update(
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.kafka_session_timeout_ms,
        heartbeat_interval_ms=settings.kafka_heartbeat_interval_ms,
        max_poll_interval_ms=settings.kafka_max_poll_interval_ms,
        fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
    )
    cfg.update(overrides)
    try:
        consumer = KafkaConsumer(**cfg)
    except KafkaError as exc:
        raise KafkaSetupError(
            f"cannot create a consumer for {settings.kafka_bootstrap!r}: {exc}"
        ) from exc
    topic_list = list(topics)
    if topic_list:
        consumer.subscribe(topic_list)
    return consumer


def consumer_lag(consumer: KafkaConsumer) -> dict[TopicPartition, int]:
    """Records behind the high watermark, per assigned partition (after a fetch).

    Uses ``highwater`` rather than ``end_offsets``: tansu answers "latest"
    ListOffsets wrongly, and the high watermark is correct on both brokers.
    """
    lag: dict[TopicPartition, int] = {}
    for tp in consumer.assignment():
        high = consumer.highwater(tp)
        if high is None:
            continue
        lag[tp] = max(0, high - consumer.position(tp))
    return lag
