"""A judged batch as Kafka records: each verdict on the verdicts topic and each review
request on the review topic, keyed by message id (verdicts are idempotent by it).

One encoder for every role that sends them: the Kafka scorer hands the records to its
batch loop (produced before the offsets are committed, each answering its input record),
``probeguard serve`` and the inline guard to their :class:`~worker.kafka.outbox.Outbox`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from schemas import ReviewRequest, Verdict
from worker.kafka.records import Item, Outgoing

__all__ = ["judged_records"]


def judged_records(
    verdicts: Mapping[int, Verdict],
    reviews: Iterable[tuple[int, ReviewRequest]],
    *,
    verdict_topic: str | None,
    review_topic: str | None,
    source: Callable[[int], Item[Any]] | None = None,
) -> list[Outgoing]:
    """The verdicts (by input position), then the review requests, as records; a topic of
    None sends none of that kind. ``source``: the input record each position answers (the
    batch loop dead-letters it if the broker refuses the record)."""

    def record(topic: str, pos: int, message_id: str, value: bytes) -> Outgoing:
        return Outgoing(topic, message_id.encode(), value, source=source(pos) if source else None)

    out: list[Outgoing] = []
    if verdict_topic is not None:
        out += [record(verdict_topic, p, v.message_id, v.encode()) for p, v in verdicts.items()]
    if review_topic is not None:
        out += [record(review_topic, p, r.message_id, r.encode()) for p, r in reviews]
    return out
