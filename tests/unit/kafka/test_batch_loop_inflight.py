"""Review L9: a record still in flight when the loop stops waiting is waited on again,
never sent a second time (the first copy may still land: the producer's own delivery
timeout is longer than the loop's wait)."""

from __future__ import annotations

import time
from typing import Any

from kafka.errors import KafkaTimeoutError

from schemas import ChatMessage
from worker.kafka.batch_loop import BatchLoop, Outgoing


class SlowFuture:
    """Acknowledged ``after_s`` after the send, like a record held up by a slow broker."""

    def __init__(self, after_s: float) -> None:
        self.done_at = time.monotonic() + after_s

    @property
    def is_done(self) -> bool:
        return time.monotonic() >= self.done_at

    def get(self, timeout: float) -> str:
        wait = self.done_at - time.monotonic()
        if wait > timeout:
            time.sleep(timeout)
            raise KafkaTimeoutError(f"Timeout after waiting for {timeout} secs.")
        time.sleep(max(0.0, wait))
        return "acknowledged"


class SlowProducer:
    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.sends: list[bytes | None] = []

    def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> SlowFuture:
        first = key not in self.sends
        self.sends.append(key)
        return SlowFuture(self.after_s if first else 0.0)  # the broker has caught up since

    def flush(self, timeout: float | None = None) -> None:
        pass


def test_a_slow_acknowledgement_is_waited_for_not_sent_again() -> None:
    producer = SlowProducer(after_s=0.5)
    loop: BatchLoop[ChatMessage] = BatchLoop(
        consumer=Any,  # delivery never polls
        producer=producer,
        model=ChatMessage,
        handler=lambda items: [],
        dead_letter_topic="dlq",
        worker_id="w",
        backoff_s=0.01,
        produce_timeout_s=0.1,  # the loop waits less than the record takes
    )
    out = [Outgoing("verdicts", f"m-{i}".encode(), b"{}") for i in range(3)]
    assert loop.delivery.deliver([(o, None) for o in out])
    assert sorted(k or b"" for k in producer.sends) == [b"m-0", b"m-1", b"m-2"]  # once each
    assert loop.stats.retries >= 1  # it did wait past produce_timeout_s
