"""What the batch loop and its role hand each other: :class:`Item` in, :class:`Outgoing`
records and :class:`Reject` results out, :class:`Between` after each batch, and the dead
letters the loop builds (:func:`dead_letter`). The loop itself, and what it guarantees, is
:mod:`worker.kafka.batch_loop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from kafka.errors import (
    InvalidRecordError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)

from schemas import DeadLetter, DeadLetterKind, WireModel, utcnow

__all__ = [
    "REFUSED",
    "Between",
    "Item",
    "LoopStats",
    "Outgoing",
    "Reject",
    "dead_letter",
]

T = TypeVar("T", bound=WireModel)

# Errors that say "this record will never be accepted", as opposed to "not now": retrying
# them cannot succeed. Other errors, even non-retriable ones such as a missing ACL, are
# about the deployment, not the record, and are retried (the loop stalls visibly).
REFUSED: tuple[type[KafkaError], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    InvalidRecordError,
)


@dataclass(frozen=True)
class Item(Generic[T]):
    """A decoded record and where it came from."""

    value: T
    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    raw: bytes = field(default=b"", repr=False)  # the payload as it arrived
    headers: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)  # record headers

    @property
    def payload(self) -> bytes:
        return self.raw or self.value.encode()


@dataclass(frozen=True)
class Outgoing:
    """A record the handler wants produced before the batch is committed.

    ``source`` is the input it answers: if the broker refuses this record, that input is
    dead-lettered as ``refused``. ``fallback`` is sent instead when it is refused.
    """

    topic: str
    key: bytes | None
    value: bytes
    source: Item[Any] | None = field(default=None, repr=False)
    fallback: Outgoing | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Reject:
    """An input the handler cannot process (a label that names no known class, a text
    the model cannot read): the loop dead-letters it as ``kind`` with ``reason``, bounded
    like every dead letter (:meth:`schemas.DeadLetter.bounded`)."""

    item: Item[Any] = field(repr=False)
    kind: DeadLetterKind
    reason: str


class Between(Enum):
    """What the loop does after ``between_batches``: the role's answer."""

    POLL = "poll"  # poll the next batch
    COMMIT = "commit"  # commit every offset pending so far (``defer_commits``), then poll
    STOP = "stop"  # poll no more (e.g. the lease was lost); nothing pending is committed


@dataclass
class LoopStats:
    batches: int = 0
    records: int = 0
    handled: int = 0
    dead_letters: int = 0
    produced: int = 0
    retries: int = 0
    commit_failures: int = 0
    refused: int = 0  # records the broker refused (replaced by a dead letter)
    dropped: int = 0  # refused records with nothing to replace them by (logged)
    last_batch_s: float = 0.0
    dead_letter_kinds: dict[str, int] = field(default_factory=dict)


def dead_letter(
    dead_letter_topic: str,
    source: tuple[str, int, int],
    key: bytes | None,
    payload: bytes,
    kind: DeadLetterKind,
    message: str,
    worker_id: str,
) -> Outgoing:
    """A DeadLetter record for the input at ``source`` (topic, partition, offset).

    Bounded whatever the payload (a prefix, its size and sha256); should the broker
    still refuse it, a letter without the payload prefix is sent instead (``fallback``).
    """
    topic, partition, offset = source
    fields: dict[str, Any] = {
        "source_topic": topic,
        "source_partition": partition,
        "source_offset": offset,
        "error_kind": kind,
        "error_message": message,
        "worker_id": worker_id,
        "created_at": utcnow(),
    }
    letter = DeadLetter.bounded(payload=payload, key=key, **fields)
    bare = DeadLetter.bounded(payload=b"", key=None, **fields).model_copy(
        update={"payload_size": letter.payload_size, "payload_sha256": letter.payload_sha256}
    )
    dlq_key = key if key is None or len(key) <= 1024 else key[:1024]
    return Outgoing(
        dead_letter_topic,
        dlq_key,
        letter.encode(),
        fallback=Outgoing(dead_letter_topic, dlq_key, bare.encode()),
    )
