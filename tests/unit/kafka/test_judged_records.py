"""One encoder of a judged batch's Kafka records (:mod:`worker.kafka.judged`), for the
scorer's batch loop and for the outbox of ``serve`` and the inline guard."""

from __future__ import annotations

from typing import Any

from schemas import ReviewRequest, Verdict, utcnow
from tests.kafka_helpers import allow_verdict
from worker.kafka.judged import judged_records
from worker.kafka.records import Item


def review(mid: str) -> ReviewRequest:
    return ReviewRequest(
        message_id=mid,
        text="hi",
        probe="p",
        version=1,
        scores={"ok": 1.0},
        reason="audit",
        created_at=utcnow(),
    )


def test_verdicts_then_reviews_keyed_by_message_id_each_answering_its_input() -> None:
    verdicts = {0: allow_verdict("a"), 2: allow_verdict("c")}
    reviews = [(2, review("c"))]
    items: list[Item[Any]] = [
        Item(value=allow_verdict(m), topic="in", partition=0, offset=i, key=None, timestamp_ms=0)
        for i, m in enumerate("abc")
    ]
    out = judged_records(
        verdicts, reviews, verdict_topic="v", review_topic="r", source=items.__getitem__
    )
    assert [(o.topic, o.key) for o in out] == [("v", b"a"), ("v", b"c"), ("r", b"c")]
    assert Verdict.decode(out[1].value) == verdicts[2]
    assert ReviewRequest.decode(out[2].value) == reviews[0][1]
    assert [o.source for o in out] == [items[0], items[2], items[2]]


def test_a_kind_without_a_topic_is_not_sent() -> None:
    verdicts, reviews = {0: allow_verdict("a")}, [(0, review("a"))]
    only = judged_records(verdicts, reviews, verdict_topic=None, review_topic="r")
    assert [(o.topic, o.source) for o in only] == [("r", None)]
    assert judged_records(verdicts, reviews, verdict_topic=None, review_topic=None) == []
