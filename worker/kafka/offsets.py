"""Offsets resolved out of order, committed in order.

:class:`~worker.kafka.batch_loop.BatchLoop` commits a batch once all of it is done: its
records finish together. A consumer whose records finish one by one, in any order (the
review queue: an item is done when a human answers it), needs more: per partition, the
offsets still open, so that a commit stops at the oldest of them.

    t = OffsetTracker()
    t.seen(tp, 5); t.seen(tp, 6); t.reached(tp, 8)  # 7 needed no work (a dead letter)
    t.resolve(tp, 6); t.committable()               # {tp: 5}: offset 5 is still open
    t.resolve(tp, 5); t.committable()               # {tp: 8}
"""

from __future__ import annotations

from kafka import TopicPartition

__all__ = ["OffsetTracker"]


class OffsetTracker:
    """Per partition: the offsets seen and not yet resolved; commits stop at the oldest."""

    def __init__(self) -> None:
        self.open: dict[TopicPartition, set[int]] = {}
        self.next: dict[TopicPartition, int] = {}  # how far the partition was read
        self.committed: dict[TopicPartition, int] = {}

    def seen(self, tp: TopicPartition, offset: int) -> None:
        """``offset`` was read and is open until :meth:`resolve`."""
        self.open.setdefault(tp, set()).add(offset)
        self.reached(tp, offset + 1)

    def reached(self, tp: TopicPartition, position: int) -> None:
        """Everything before ``position`` was read (what is not open needs no more work)."""
        self.next[tp] = max(self.next.get(tp, 0), position)

    def resolve(self, tp: TopicPartition, offset: int) -> None:
        self.open.get(tp, set()).discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        """Per partition, the position to commit when it moved since the last commit."""
        out = {}
        for tp, nxt in self.next.items():
            pending = self.open.get(tp)
            position = min(pending) if pending else nxt
            if position > self.committed.get(tp, -1):
                out[tp] = position
        return out

    def done(self, offsets: dict[TopicPartition, int]) -> None:
        """``offsets`` (from :meth:`committable`) were committed."""
        for tp, position in offsets.items():
            self.committed[tp] = max(self.committed.get(tp, -1), position)

    def keep_only(self, assigned: set[TopicPartition]) -> None:
        """Forget every partition not in ``assigned`` (moved away in a rebalance that ran
        inside some consumer call, between two looks at the assignment)."""
        self.forget((set(self.open) | set(self.next) | set(self.committed)) - assigned)

    def forget(self, tps: set[TopicPartition]) -> None:
        """The partitions went to another consumer: it reads them again from the commit."""
        for tp in tps:
            self.open.pop(tp, None)
            self.next.pop(tp, None)
            self.committed.pop(tp, None)
