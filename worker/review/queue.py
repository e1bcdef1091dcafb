"""The review queue behind the console: ``moderation.review`` in, ``HumanLabel`` out.

    consumer thread   polls the review topic as its own group (``PROBEGUARD_GROUP_CONSOLE``)
                      -> items in memory, oldest first (bounded: the consumer pauses
                      at ``console_max_items``); bad payloads -> dead-letter topic
    reviewer          next_item() claims the oldest free item in Redis (a TTL claim, see
                      claims.py), answer() / skip() / undo() / leave()
    flusher thread    an answer waits ``console_undo_s`` for an undo, then is produced on
                      the labels topic; after the broker's acknowledgement the item is
                      marked done in Redis and its offset becomes committable
    consumer thread   commits, per partition, up to the oldest item still unanswered

So a review offset is committed only after the label for it (and for every item
before it in the partition) was acknowledged; a console killed at any point loses no
label and asks again at most the items whose labels were not acknowledged yet (a
redelivered item that was labeled is recognised by its ``done`` marker).

Items are keyed ``probe:message_id``: one message queued for two probes is two items.
"""

from __future__ import annotations

import base64
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
from pydantic import ValidationError

from schemas import DeadLetter, HumanLabel, ProbeSpec, ReviewRequest, describe_error, utcnow
from worker.errors import ReviewError
from worker.kafka.clients import consumer_lag, make_consumer, make_producer
from worker.review.claims import ClaimStore, is_done
from worker.settings import Settings
from worker.store.redis import Keys

__all__ = ["OffsetTracker", "QueueStats", "ReviewItem", "ReviewQueue"]

log = logging.getLogger(__name__)

SpecLookup = Callable[[str, int], ProbeSpec | None]


@dataclass
class ReviewItem:
    key: str  # "probe:message_id"
    request: ReviewRequest
    choices: tuple[str, ...]  # the labels a reviewer picks from, in the probe's order
    multilabel: bool
    flag_labels: tuple[str, ...]
    offsets: list[tuple[TopicPartition, int]]  # more than one when the request came twice
    arrived: float


@dataclass
class _Held:
    item: ReviewItem
    reviewer: str
    label: HumanLabel
    due: float  # monotonic time at which it is sent


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

    @property
    def depth(self) -> int:
        """Items still waiting for a human: fetched and unanswered, plus not yet fetched."""
        return self.waiting + self.claimed + self.lag


class OffsetTracker:
    """Per partition: the offsets seen and not yet resolved; commits stop at the oldest."""

    def __init__(self) -> None:
        self.open: dict[TopicPartition, set[int]] = {}
        self.next: dict[TopicPartition, int] = {}  # highest offset seen + 1
        self.committed: dict[TopicPartition, int] = {}

    def seen(self, tp: TopicPartition, offset: int) -> None:
        self.open.setdefault(tp, set()).add(offset)
        self.next[tp] = max(self.next.get(tp, 0), offset + 1)

    def resolve(self, tp: TopicPartition, offset: int) -> None:
        self.open.get(tp, set()).discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        out = {}
        for tp, nxt in self.next.items():
            pending = self.open.get(tp)
            position = min(pending) if pending else nxt
            if position > self.committed.get(tp, -1):
                out[tp] = position
        return out

    def done(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, position in offsets.items():
            self.committed[tp] = max(self.committed.get(tp, -1), position)

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self.open.pop(tp, None)
            self.next.pop(tp, None)
            self.committed.pop(tp, None)


class ReviewQueue:
    """The console's queue; thread-safe (web requests call it from a thread pool)."""

    def __init__(
        self,
        settings: Settings,
        client: Any,
        *,
        spec_of: SpecLookup | None = None,
        worker_id: str = "console",
    ) -> None:
        self.settings = settings
        self.claims = ClaimStore(
            client,
            Keys(settings.redis_prefix),
            ttl_s=settings.console_claim_ttl_s,
            done_ttl_s=settings.text_cache_ttl_s,
        )
        self.spec_of = spec_of or (lambda _probe, _version: None)
        self.worker_id = worker_id
        self.lock = threading.RLock()
        self.items: dict[str, ReviewItem] = {}  # insertion order = arrival order
        self.current: dict[str, str] = {}  # reviewer -> item key on their screen
        self.skipped: dict[str, set[str]] = {}
        self.held: dict[str, list[_Held]] = {}  # reviewer -> answers in the undo window
        self.sending: set[str] = set()
        self.tracker = OffsetTracker()
        self.lag = 0
        self.sent = 0
        self.send_failures = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.producer: Any = None
        self.consumer: Any = None
        self.ready = threading.Event()  # the consumer has joined its group

    # --- life cycle ------------------------------------------------------------

    def start(self) -> ReviewQueue:
        s = self.settings
        self.producer = make_producer(s)
        self.consumer = make_consumer(s, s.group_console)
        self.consumer.subscribe([s.topic_review], listener=_Revoked(self))
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
        for t in self._threads:
            t.join(30)
        if self.consumer is not None:
            self._commit()
            self.consumer.close()
        if self.producer is not None:
            self.producer.close(10)

    # --- reviewers ---------------------------------------------------------------

    def next_item(self, reviewer: str) -> ReviewItem | None:
        """The reviewer's claimed item, else the oldest free one, now claimed; None if
        nothing is left for them."""
        with self.lock:
            key = self.current.get(reviewer)
            if key is not None:
                if key in self.items and self.claims.claim(key, reviewer) == reviewer:
                    return self.items[key]
                self.current.pop(reviewer, None)
            busy = self._busy() | self.skipped.get(reviewer, set())
            free = [it for k, it in self.items.items() if k not in busy]
            for key in [it.key for it in sorted(free, key=lambda it: it.request.created_at)]:
                holder = self.claims.claim(key, reviewer)
                if holder == reviewer:
                    self.current[reviewer] = key
                    return self.items[key]
                if is_done(holder):  # answered through another console
                    self._resolve(self.items.pop(key))
            return None

    def answer(self, reviewer: str, key: str, labels: list[str]) -> HumanLabel:
        """Record the reviewer's labels for their current item; it is sent after the
        undo window. Refused (ReviewError) unless the item is still theirs."""
        with self.lock:
            item = self._mine(reviewer, key)
            label = self._label(item, reviewer, labels)
            undo_s = self.settings.console_undo_s
            holder = self.claims.claim(
                key, reviewer, ttl_s=self.settings.console_claim_ttl_s + undo_s
            )
            if holder != reviewer:
                self.current.pop(reviewer, None)
                raise ReviewError(_lost(holder))
            self.held.setdefault(reviewer, []).append(
                _Held(item, reviewer, label, time.monotonic() + undo_s)
            )
            self.current.pop(reviewer, None)
            return label

    def skip(self, reviewer: str, key: str) -> None:
        """Hand the item back for the other reviewers; this reviewer is not offered it again."""
        with self.lock:
            self._mine(reviewer, key)
            self.current.pop(reviewer, None)
            self.skipped.setdefault(reviewer, set()).add(key)
            self.claims.release(key, reviewer)

    def undo(self, reviewer: str) -> ReviewItem:
        """Take back the reviewer's last answer that has not been sent yet; its item
        becomes their current one again."""
        with self.lock:
            stack = self.held.get(reviewer)
            if not stack:
                raise ReviewError(
                    "nothing to undo: answers go to the updater "
                    f"{self.settings.console_undo_s:g} s after they are given"
                )
            h = stack.pop()
            previous = self.current.pop(reviewer, None)
            if previous is not None and previous != h.item.key:
                self.claims.release(previous, reviewer)
            self.claims.claim(h.item.key, reviewer)
            self.current[reviewer] = h.item.key
            return h.item

    def undoable(self, reviewer: str) -> int:
        with self.lock:
            return len(self.held.get(reviewer, []))

    def heartbeat(self, reviewer: str) -> bool:
        """Renew the claim on the reviewer's current item; False if it was lost."""
        with self.lock:
            key = self.current.get(reviewer)
            if key is None:
                return True
            if self.claims.claim(key, reviewer) == reviewer:
                return True
            self.current.pop(reviewer, None)
            return False

    def leave(self, reviewer: str) -> None:
        """The reviewer logs out: their claim is released, their answers are sent now."""
        with self.lock:
            key = self.current.pop(reviewer, None)
            if key is not None:
                self.claims.release(key, reviewer)
            for h in self.held.get(reviewer, []):
                h.due = 0.0
            self.skipped.pop(reviewer, None)

    def stats(self) -> QueueStats:
        with self.lock:
            busy = self._busy()
            claimed = len(self.current)
            held = sum(len(v) for v in self.held.values())
            waiting = sum(1 for k in self.items if k not in busy)
            lag, sent, failures, error = self.lag, self.sent, self.send_failures, self.last_error
        try:
            rates = self.claims.rates()
        except (redis.RedisError, OSError):
            rates = {}
        return QueueStats(waiting, claimed, held, lag, sent, rates, failures, error)

    # --- inside ----------------------------------------------------------------

    def _busy(self) -> set[str]:
        """Keys on a screen, in an undo window, or being sent (not offered again)."""
        held = {h.item.key for stack in self.held.values() for h in stack}
        return set(self.current.values()) | held | self.sending

    def _mine(self, reviewer: str, key: str) -> ReviewItem:
        item = self.items.get(key)
        if item is None or self.current.get(reviewer) != key:
            raise ReviewError(
                "that item is no longer yours (its claim timed out, or it was answered); "
                "here is your next one"
            )
        return item

    def _label(self, item: ReviewItem, reviewer: str, labels: list[str]) -> HumanLabel:
        unknown = [lb for lb in labels if lb not in item.choices]
        if unknown:
            raise ReviewError(f"unknown label(s) {unknown[:4]}; choose from {list(item.choices)}")
        if len(set(labels)) != len(labels):
            raise ReviewError("a label was given twice")
        req = item.request
        common: dict[str, Any] = {
            "message_id": req.message_id,
            "labeler_id": reviewer,
            "created_at": utcnow(),
            "text": req.text,
            "probe": req.probe,  # the probe that asked learns it (and no other)
        }
        if item.multilabel:
            return HumanLabel(labels=list(labels), **common)
        if len(labels) != 1:
            raise ReviewError(f"choose exactly one label, got {len(labels)}")
        return HumanLabel(label=labels[0], **common)

    def _resolve(self, item: ReviewItem) -> None:
        for tp, offset in item.offsets:
            self.tracker.resolve(tp, offset)

    # --- the consumer thread ---------------------------------------------------

    def _consume(self) -> None:
        consumer = self.consumer
        while not self._stop.is_set():
            try:
                batch = consumer.poll(timeout_ms=200, max_records=200)
                if consumer.assignment():
                    self.ready.set()
                for tp, records in batch.items():
                    self._arrive(tp, records)
                self._commit()
                self._flow_control()
            except Exception as exc:  # the loop must outlive a Redis or broker hiccup
                log.warning("review consumer: %s; retrying", exc)
                self._stop.wait(1.0)

    def _arrive(self, tp: TopicPartition, records: list[Any]) -> None:
        for r in records:
            try:
                self._add(tp, r)
            except (redis.RedisError, OSError, KafkaError) as exc:
                # Not taken: read it again (and everything after it in this partition).
                log.warning("review item %s@%d not taken (%s); re-reading", tp, r.offset, exc)
                self.consumer.seek(tp, r.offset)
                return

    def _add(self, tp: TopicPartition, r: Any) -> None:
        try:
            req = ReviewRequest.decode(r.value or b"", self.settings.limits)
        except ValidationError as exc:
            self._dead_letter(r, *describe_error(exc))
            with self.lock:
                self.tracker.seen(tp, r.offset)
                self.tracker.resolve(tp, r.offset)
            return
        key = f"{req.probe}:{req.message_id}"
        with self.lock:
            if key in self.items:  # asked twice (e.g. redelivered): one answer serves both
                self.items[key].offsets.append((tp, r.offset))
                self.tracker.seen(tp, r.offset)
                return
        done = is_done(self.claims.holder(key))
        spec = None if done else self.spec_of(req.probe, req.version)
        with self.lock:
            self.tracker.seen(tp, r.offset)
            if done:  # labeled already (a restart before the commit): nothing to ask
                self.tracker.resolve(tp, r.offset)
                return
            choices = tuple(spec.labels) if spec else tuple(req.scores)
            self.items[key] = ReviewItem(
                key=key,
                request=req,
                choices=choices,
                multilabel=spec is not None and spec.task == "multilabel",
                flag_labels=tuple(spec.flag_labels) if spec else (),
                offsets=[(tp, r.offset)],
                arrived=time.time(),
            )

    def _dead_letter(self, r: Any, kind: Any, message: str) -> None:
        letter = DeadLetter(
            source_topic=r.topic,
            source_partition=r.partition,
            source_offset=r.offset,
            key_b64=base64.b64encode(r.key).decode() if r.key is not None else None,
            payload_b64=base64.b64encode(r.value or b"").decode(),
            error_kind=kind,
            error_message=message[:4000],
            worker_id=self.worker_id,
            created_at=utcnow(),
        )
        log.info("review dead letter %s:%d@%d: %s", r.topic, r.partition, r.offset, message[:200])
        future = self.producer.send(
            self.settings.topic_dead_letter, key=r.key, value=letter.encode()
        )
        future.get(timeout=60)

    def _commit(self) -> None:
        with self.lock:
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
        consumer = self.consumer
        assigned = consumer.assignment()
        with self.lock:
            full = len(self.items) >= self.settings.console_max_items
        if full:
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
        with self.lock:
            held = {h.item.key for stack in self.held.values() for h in stack} | self.sending
            for key, item in list(self.items.items()):
                if key not in held and any(tp in tps for tp, _ in item.offsets):
                    del self.items[key]
            for reviewer, key in list(self.current.items()):
                if key not in self.items:
                    del self.current[reviewer]
                    self.claims.release(key, reviewer)
            self.tracker.forget(tps)

    # --- the flusher thread ----------------------------------------------------

    def _flush(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._send_due()
            except Exception as exc:  # keep the thread; _send_due keeps the answers
                log.warning("sending labels: %s", exc)

    def _send_due(self) -> None:
        now = time.monotonic()
        with self.lock:
            due = [h for stack in self.held.values() for h in stack if h.due <= now]
            for h in due:
                self.held[h.reviewer].remove(h)
                self.sending.add(h.item.key)
        if not due:
            return
        topic = self.settings.topic_labels
        futures = []
        for i, h in enumerate(due):
            mid = h.label.message_id
            try:
                futures.append(
                    (h, self.producer.send(topic, key=mid.encode(), value=h.label.encode()))
                )
            except Exception as exc:  # e.g. KafkaTimeoutError: no metadata within max_block_ms
                for rest in due[i:]:  # the next sends would block as long: all wait a round
                    self._retry(rest, f"label for {mid} not sent: {_why(exc)}")
                break
        for h, future in futures:
            try:
                future.get(timeout=self.settings.kafka_request_timeout_ms / 1000 + 60)
            except Exception as exc:  # whatever it was, the answer is kept and sent again
                self._retry(h, f"label for {h.label.message_id} not acknowledged: {_why(exc)}")
                continue
            self._acknowledged(h)

    def _acknowledged(self, h: _Held) -> None:
        try:
            self.claims.finish(h.item.key, h.reviewer)
        except (redis.RedisError, OSError) as exc:  # only the restart shortcut is lost
            log.warning("review item %s not marked done (%s)", h.item.key, exc)
        with self.lock:
            self.sending.discard(h.item.key)
            self.items.pop(h.item.key, None)
            self._resolve(h.item)
            self.sent += 1

    def _retry(self, h: _Held, why: str) -> None:
        log.warning("%s; retrying", why)
        with self.lock:
            self.sending.discard(h.item.key)
            h.due = time.monotonic() + 2.0
            self.held.setdefault(h.reviewer, []).insert(0, h)
            self.send_failures += 1
            self.last_error = why[:300]


class _Revoked(ConsumerRebalanceListener):
    def __init__(self, queue: ReviewQueue) -> None:
        self.queue = queue

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.queue.revoked(set(revoked))

    def on_partitions_assigned(self, assigned: Any) -> None:
        pass


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _lost(holder: str | None) -> str:
    if is_done(holder):
        return "this item was answered by someone else meanwhile; here is your next one"
    who = holder or "nobody"
    return f"your claim on this item timed out and it is with {who} now; here is your next one"
