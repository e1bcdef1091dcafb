"""The review queue: ``moderation.review`` in, ``HumanLabel`` out.

    consumer thread   the shared :class:`~worker.kafka.batch_loop.BatchLoop` on the review
                      topic, as the console's own group (``PROBEGUARD_GROUP_CONSOLE``): a
                      record that does not decode costs only itself and is dead-lettered
                      bounded (``DeadLetter.bounded``: a prefix, its size and sha256); the
                      valid ones become items in memory, oldest first
    reviewer          next_item() claims the oldest free item (a TTL claim in Redis, see
                      claims.py), answer() / skip() / undo() / heartbeat() / leave()
                      (the reviewers' side, :class:`~worker.review.desk.ReviewDesk`)
    flusher thread    an answer waits ``console_undo_s`` for an undo, then is produced on
                      the labels topic; after the broker's acknowledgement the item is
                      marked done in Redis and its offset resolved (sender.py,
                      :class:`~worker.review.sender.LabelSender`)
    consumer thread   commits, per partition, up to the oldest offset still open
                      (:class:`~worker.kafka.offsets.OffsetTracker`: items are answered in
                      any order, so the loop's own per-batch commits are off)

An item leaves the queue when it is answered, or when it is put back at the end of the
review topic; nothing else holds it or its partition's commits:

- **A claim is a lease.** An item is on a reviewer's screen for ``console_claim_ttl_s``,
  renewed (with its Redis claim) while the page is open (``heartbeat``). A screen that is
  not renewed in time (a closed tab) loses the item: it is offered to the next reviewer
  who asks, and the late answer is refused (``claims_expired`` counts these).
- **A skip sets the item aside.** It is not offered to that reviewer again, and set-aside
  items do not count toward ``console_max_items``, so skips never pause the consumer.
  ``console_skip_s`` after its first skip, or at once while more than
  ``console_max_items`` items are set aside, an item that is not on a screen is put back
  at the end of the review topic: the same request is produced, and only once the broker
  has acknowledged it are the item's offsets resolved (``requeued`` counts these). Its
  partition's commits move past it, and it comes round again for everyone, the reviewers
  who skipped it included; an item that everyone keeps skipping circulates at the pace of
  the skips and never holds the queue.

So a review offset is committed only after the label for it (and for every item before it
in the partition) was acknowledged, or its request was acknowledged at the end of the
topic: a console killed at any point loses no label and asks again at most the items
whose labels were not acknowledged yet (a redelivered item that was labeled is
recognised by its ``done`` marker).

Items are keyed ``probe:message_id``: one message queued for two probes is two items.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from schemas import ProbeSpec, ReviewRequest
from worker.errors import TransientError
from worker.kafka.batch_loop import BatchLoop, Item, Outgoing
from worker.kafka.clients import consumer_lag, make_consumer, make_producer
from worker.review.claims import is_done
from worker.review.desk import HeadChoice, ReviewItem
from worker.review.sender import LabelSender, failure
from worker.settings import Settings

__all__ = ["QueueStats", "ReviewItem", "ReviewQueue"]

log = logging.getLogger(__name__)

SpecLookup = Callable[[str, int], ProbeSpec | None]


@dataclass(frozen=True)
class QueueStats:
    waiting: int  # fetched, nobody on this console has claimed or answered them
    claimed: int  # on a reviewer's screen now
    held: int  # answered, inside the undo window
    lag: int  # on the topic, not fetched yet (the consumer pauses at console_max_items)
    sent: int  # labels acknowledged by the broker since start
    rates: dict[str, int]  # reviewer -> answers in the last 10 minutes (all consoles)
    send_failures: int
    last_error: str
    set_aside: int = 0  # waiting items someone skipped (not counted toward the cap)
    claims_expired: int = 0  # screens that lost their item to the lease (closed tabs)
    requeued: int = 0  # skipped items put back at the end of the topic since start
    dead_letters: int = 0  # records that did not decode, dead-lettered since start

    @property
    def depth(self) -> int:
        """Items still waiting for a human: fetched and unanswered, plus not yet fetched."""
        return self.waiting + self.claimed + self.lag


class ReviewQueue(LabelSender):
    """The console's queue: the reviewers' desk (:class:`ReviewDesk`) fed from the review
    topic and emptied onto the labels topic (:class:`LabelSender`, the flusher thread);
    thread-safe (web requests call it from a thread pool)."""

    def __init__(
        self,
        settings: Settings,
        client: Any,
        *,
        spec_of: SpecLookup | None = None,
        worker_id: str = "console",
    ) -> None:
        super().__init__(settings, client)
        self.spec_of = spec_of or (lambda _probe, _version: None)
        self.worker_id = worker_id
        self.lag = 0
        self.requeued = 0
        self._read_to: dict[TopicPartition, int] = {}  # positions of completed batches
        self._threads: list[threading.Thread] = []
        self.consumer: Any = None
        self.loop: BatchLoop[ReviewRequest] | None = None
        self.ready = threading.Event()  # the consumer has joined its group
        # Since when the consumer thread's iterations have failed (a broker or Redis that
        # does not answer), for readiness; None while they succeed.
        self._failing_since: float | None = None

    # --- life cycle ------------------------------------------------------------

    def start(self) -> ReviewQueue:
        s = self.settings
        self.producer = make_producer(s)
        self.consumer = make_consumer(s, s.group_console)
        self.consumer.subscribe([s.topic_review], listener=_Revoked(self))
        self.loop = BatchLoop(
            consumer=self.consumer,
            producer=self.producer,
            model=ReviewRequest,
            decode=lambda raw: ReviewRequest.decode(raw, s.limits),
            handler=self._take,
            dead_letter_topic=s.topic_dead_letter,
            worker_id=self.worker_id,
            max_batch=200,
            max_wait_ms=200,
            defer_commits=True,  # committed by self.tracker, up to the oldest open item
        )
        for name, target in (("review-consumer", self._consume), ("review-flusher", self._flush)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Send every answer still in its undo window, commit, leave the group."""
        with self.lock:
            for stack in self.held.values():
                for h in stack:
                    h.due = 0.0
        self._send_due()
        self._stop.set()
        if self.loop is not None:
            self.loop.stop()
        for t in self._threads:
            t.join(30)
        if self.consumer is not None:
            self._commit()
            self.consumer.close()
        if self.producer is not None:
            self.producer.close(10)

    # --- counts -------------------------------------------------------------------

    def stats(self) -> QueueStats:
        with self.lock:
            self._expire_leases()
            busy = self._busy()
            claimed = len(self.current)
            held = sum(len(v) for v in self.held.values())
            waiting = sum(1 for k in self.items if k not in busy)
            aside = sum(
                1 for k, it in self.items.items() if k not in busy and it.set_aside is not None
            )
            lag, sent, failures, error = self.lag, self.sent, self.send_failures, self.last_error
            expired, requeued = self.claims_expired, self.requeued
        dead = self.loop.stats.dead_letters if self.loop is not None else 0
        try:
            rates = self.claims.rates()
        except (redis.RedisError, OSError):
            rates = {}
        return QueueStats(
            waiting,
            claimed,
            held,
            lag,
            sent,
            rates,
            failures,
            error,
            aside,
            expired,
            requeued,
            dead,
        )

    # --- the consumer thread ---------------------------------------------------

    def _consume(self) -> None:
        assert self.loop is not None
        while not self._stop.is_set():
            try:
                self.loop.run_once()  # decode, dead-letter, self._take, produce the letters
                self._read_to = _positions(self.consumer)
                if self.consumer.assignment():
                    self.ready.set()
                with self.lock:
                    self._expire_leases()
                self._requeue_due()
                self._commit()
                self._flow_control()
                self._failing_since = None
            except Exception as exc:  # the loop must outlive a Redis or broker outage
                log.warning("review consumer: %s; retrying", exc)
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                self._reread()
                self._stop.wait(1.0)

    def readiness(self) -> tuple[bool, str]:
        """For the console's ``/readyz``: whether review requests are being taken in.

        Not ready before the consumer has joined its group, or while taking requests in has
        failed for longer than ``stall_not_ready_s`` (Redis or the broker not answering:
        the queue retries by itself). Public, so it names no server and no exception."""
        if not self.ready.is_set():
            return False, "the review queue has not joined its consumer group yet"
        since = self._failing_since
        stalled = max(
            self.loop.stalled_s() if self.loop is not None else 0.0,
            time.monotonic() - since if since is not None else 0.0,
        )
        if stalled > self.settings.stall_not_ready_s:
            return False, (
                f"the review queue has taken in nothing for {stalled:.0f}s: Redis or the "
                "broker is not answering (it retries by itself; see the log)"
            )
        return True, "ok"

    def _take(self, items: list[Item[ReviewRequest]]) -> list[Outgoing]:
        """The batch loop's handler: valid requests become items (nothing to produce)."""
        for it in items:
            try:
                self._add(it)
            except (redis.RedisError, OSError) as exc:
                # The loop reads the batch again after a backoff; the items taken already
                # recognise their second delivery.
                raise TransientError(f"review items not taken: {exc}") from exc
        return []

    def _add(self, it: Item[ReviewRequest]) -> None:
        req, tp, offset = it.value, TopicPartition(it.topic, it.partition), it.offset
        key = f"{req.probe}:{req.message_id}"
        with self.lock:
            known = self.items.get(key)
            if known is not None:  # asked twice (e.g. redelivered): one answer serves both
                if (tp, offset) not in known.offsets:
                    known.offsets.append((tp, offset))
                self.tracker.seen(tp, offset)
                return
        done = is_done(self.claims.holder(key))
        spec = None if done else self.spec_of(req.probe, req.version)
        with self.lock:
            self.tracker.seen(tp, offset)
            if done:  # labeled already (a restart before the commit): nothing to ask
                self.tracker.resolve(tp, offset)
                return
            choices = tuple(spec.labels) if spec else tuple(req.scores)
            self.items[key] = ReviewItem(
                key=key,
                request=req,
                choices=choices,
                multilabel=spec is not None and spec.task == "multilabel",
                flag_labels=tuple(spec.flag_labels) if spec else (),
                heads=HeadChoice.of(spec),
                offsets=[(tp, offset)],
                arrived=time.time(),
                record_key=it.key,
            )

    def _reread(self) -> None:
        """After a failure outside the loop's own handling, read again from the end of
        the last completed batch (what was read since may not have become items)."""
        try:
            assigned = self.consumer.assignment()
            for tp, position in self._read_to.items():
                if tp in assigned:
                    self.consumer.seek(tp, position)
        except Exception as exc:  # the next poll reports a broken consumer
            log.warning("review consumer: cannot seek back (%s)", exc)

    def _requeue_due(self) -> None:
        """Put set-aside items back at the end of the topic (see the module docstring)."""
        now, s = time.monotonic(), self.settings
        with self.lock:
            busy = self._busy()
            aside = sorted(
                (it for k, it in self.items.items() if it.set_aside is not None and k not in busy),
                key=lambda it: it.set_aside or 0.0,
            )
            extra = len(aside) - s.console_max_items
            due = [
                it
                for i, it in enumerate(aside)
                if i < extra or (it.set_aside or 0.0) + s.console_skip_s <= now
            ]
            self.requeuing.update(it.key for it in due)
        for item in due:
            try:
                self.producer.send(
                    s.topic_review, key=item.record_key, value=item.request.encode()
                ).get(timeout=s.kafka_request_timeout_ms / 1000 + 60)
            except Exception as exc:  # kept aside; tried again after the next poll
                why = f"skipped item {item.key} not put back: {failure(exc)}"
                log.warning("%s; retrying", why)
                with self.lock:
                    self.requeuing.discard(item.key)
                    self.last_error = why[:300]
                continue
            with self.lock:
                self.requeuing.discard(item.key)
                self._drop(item)
                self.requeued += 1
            log.info("review item %s put back at the end of %s", item.key, s.topic_review)

    def _commit(self) -> None:
        # Only partitions this console owns now: a rebalance can run inside any consumer
        # call (a position lookup, a commit), after ``_read_to`` was taken, and committing
        # positions of a partition another console owns would move its offsets.
        assigned = set(self.consumer.assignment())
        with self.lock:
            self.tracker.keep_only(assigned)
            for tp, position in self._read_to.items():
                if tp in assigned:
                    self.tracker.reached(tp, position)  # dead letters and done items included
            offsets = self.tracker.committable()
        if not offsets:
            return
        try:
            self.consumer.commit({tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()})
        except KafkaError as exc:  # a rebalance: the next owner re-reads; never lost
            log.warning("review offsets not committed (%s); they will be read again", exc)
            return
        with self.lock:
            self.tracker.done(offsets)

    def _flow_control(self) -> None:
        """Pause while ``console_max_items`` items can be offered; set-aside ones do not
        count (they are bounded by being put back)."""
        consumer = self.consumer
        assigned = consumer.assignment()
        with self.lock:
            busy = self._busy()
            counted = sum(1 for k, it in self.items.items() if it.set_aside is None or k in busy)
        if counted >= self.settings.console_max_items:
            consumer.pause(*assigned)
        elif consumer.paused():
            consumer.resume(*consumer.paused())
        lag = consumer_lag(consumer)
        with self.lock:
            self.lag = sum(lag.values())

    def revoked(self, tps: set[TopicPartition]) -> None:
        """Partitions moved to another console: commit, then drop what it will re-read.
        Answers already given are still sent (the other console may ask again: a label
        can then arrive twice, never not at all)."""
        self._commit()
        released: list[tuple[str, str]] = []
        with self.lock:
            held = {h.item.key for stack in self.held.values() for h in stack} | self.sending
            for key, item in list(self.items.items()):
                if key not in held and any(tp in tps for tp, _ in item.offsets):
                    del self.items[key]
                    for skipped in self.skipped.values():  # else kept until sign-out
                        skipped.discard(key)
            for reviewer, key in list(self.current.items()):
                if key not in self.items:
                    self._unhold(reviewer)
                    released.append((key, reviewer))
            self.tracker.forget(tps)
            for tp in tps:
                self._read_to.pop(tp, None)
        # Redis last, and best-effort: a failure here used to leave the tracker holding
        # partitions another console owns (a later commit could move their offsets).
        # A claim not released expires with its TTL.
        for key, reviewer in released:
            try:
                self.claims.release(key, reviewer)
            except (redis.RedisError, OSError) as exc:
                log.warning("claim on a moved item not released (%s); it expires", exc)


class _Revoked(ConsumerRebalanceListener):
    def __init__(self, queue: ReviewQueue) -> None:
        self.queue = queue

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.queue.revoked(set(revoked))

    def on_partitions_assigned(self, assigned: Any) -> None:
        pass


def _positions(consumer: Any) -> dict[TopicPartition, int]:
    """Where the consumer stands on each assigned partition (after a completed batch:
    every record before it became an item, a dead letter, or was found done)."""
    out = {}
    for tp in consumer.assignment():
        position = consumer.position(tp)
        if position is not None:
            out[tp] = position
    return out
