"""The reviewers' side of the review queue: the items in memory and what reviewers do
to them (claim, answer, skip, undo, heartbeat, leave).

Items arrive from Kafka and answers leave for it in :mod:`worker.review.queue`; here
they are only held. A claim is a lease on a reviewer's screen, renewed by heartbeats; a
skip sets an item aside for that reviewer; an answer waits in the undo window
(:class:`Held`) until the queue's flusher sends it. Claims live in Redis
(:mod:`worker.review.claims`), so two consoles never show one item to two reviewers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kafka import TopicPartition

from schemas import HumanLabel, ProbeSpec, ReviewRequest, utcnow
from worker.errors import ReviewError
from worker.kafka.offsets import OffsetTracker
from worker.review.claims import ClaimStore, is_done
from worker.settings import Settings
from worker.store.redis import keys_for

__all__ = ["Held", "ReviewDesk", "ReviewItem"]

log = logging.getLogger(__name__)


@dataclass
class ReviewItem:
    key: str  # "probe:message_id"
    request: ReviewRequest
    choices: tuple[str, ...]  # the labels a reviewer picks from, in the probe's order
    multilabel: bool
    flag_labels: tuple[str, ...]
    offsets: list[tuple[TopicPartition, int]]  # more than one when the request came twice
    arrived: float
    record_key: bytes | None = None  # the Kafka key it came with (kept when put back)
    set_aside: float | None = None  # monotonic time of its first skip
    # A multi-head probe's heads: the reviewer judges every one (an exhaustive label).
    heads: tuple[HeadChoice, ...] = ()


@dataclass(frozen=True)
class HeadChoice:
    name: str
    labels: tuple[str, ...]
    multiclass: bool

    @classmethod
    def of(cls, spec: ProbeSpec | None) -> tuple[HeadChoice, ...]:
        heads = spec.heads if spec is not None else []
        return tuple(cls(h.name, tuple(h.labels), h.task == "multiclass") for h in heads)


@dataclass
class Held:
    item: ReviewItem
    reviewer: str
    label: HumanLabel
    due: float  # monotonic time at which it is sent


class ReviewDesk:
    """The items in memory and the reviewers' screens; thread-safe (``self.lock``)."""

    def __init__(self, settings: Settings, client: Any) -> None:
        self.settings = settings
        self.claims = ClaimStore(
            client,
            keys_for(settings),
            ttl_s=settings.console_claim_ttl_s,
            done_ttl_s=settings.text_cache_ttl_s,
        )
        self.lock = threading.RLock()
        self.items: dict[str, ReviewItem] = {}  # insertion order = arrival order
        self.current: dict[str, str] = {}  # reviewer -> item key on their screen
        self.leases: dict[str, float] = {}  # reviewer -> monotonic end of that screen's lease
        self.skipped: dict[str, set[str]] = {}
        self.held: dict[str, list[Held]] = {}  # reviewer -> answers in the undo window
        self.sending: set[str] = set()
        self.requeuing: set[str] = set()  # being put back at the end of the topic
        self.tracker = OffsetTracker()  # offsets of the items, resolved when they leave
        self.claims_expired = 0

    def next_item(self, reviewer: str) -> ReviewItem | None:
        """The reviewer's claimed item, else the oldest free one, now claimed; None if
        nothing is left for them."""
        with self.lock:
            if self._renew(reviewer):
                return self.items[self.current[reviewer]]
            self._expire_leases()
            busy = self._busy() | self.skipped.get(reviewer, set())
            free = [it for k, it in self.items.items() if k not in busy]
            for key in [it.key for it in sorted(free, key=lambda it: it.request.created_at)]:
                holder = self.claims.claim(key, reviewer)
                if holder == reviewer:
                    self._hold(reviewer, key)
                    return self.items[key]
                if is_done(holder):  # answered through another console
                    self._drop(self.items[key])
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
            self._unhold(reviewer)
            if holder != reviewer:
                raise ReviewError(_lost(holder))
            self.held.setdefault(reviewer, []).append(
                Held(item, reviewer, label, time.monotonic() + undo_s)
            )
            return label

    def skip(self, reviewer: str, key: str) -> None:
        """Hand the item back for the other reviewers; this reviewer is not offered it
        again until it comes round from the end of the topic (see :mod:`worker.review.queue`)."""
        with self.lock:
            item = self._mine(reviewer, key)
            self._unhold(reviewer)
            self.skipped.setdefault(reviewer, set()).add(key)
            if item.set_aside is None:
                item.set_aside = time.monotonic()
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
            previous = self._unhold(reviewer)
            if previous is not None and previous != h.item.key:
                self.claims.release(previous, reviewer)
            self.claims.claim(h.item.key, reviewer)
            self._hold(reviewer, h.item.key)
            return h.item

    def skipped_by(self, reviewer: str) -> int:
        """Items waiting that this reviewer skipped (not offered to them until they come
        round from the end of the topic)."""
        with self.lock:
            return len(self.skipped.get(reviewer, set()) & self.items.keys())

    def undoable(self, reviewer: str) -> int:
        with self.lock:
            return len(self.held.get(reviewer, []))

    def heartbeat(self, reviewer: str) -> bool:
        """Renew the lease and claim on the reviewer's current item; False if it was lost."""
        with self.lock:
            return reviewer not in self.current or self._renew(reviewer)

    def leave(self, reviewer: str) -> None:
        """The reviewer logs out: their claim is released, their answers are sent now."""
        with self.lock:
            key = self._unhold(reviewer)
            if key is not None:
                self.claims.release(key, reviewer)
            for h in self.held.get(reviewer, []):
                h.due = 0.0
            self.skipped.pop(reviewer, None)

    # --- inside ----------------------------------------------------------------

    def _busy(self) -> set[str]:
        """Keys on a screen, in an undo window, being sent or put back (not offered)."""
        held = {h.item.key for stack in self.held.values() for h in stack}
        return set(self.current.values()) | held | self.sending | self.requeuing

    def _hold(self, reviewer: str, key: str) -> None:
        """``key`` is on the reviewer's screen for one claim TTL (renewed by heartbeats)."""
        self.current[reviewer] = key
        self.leases[reviewer] = time.monotonic() + self.settings.console_claim_ttl_s

    def _unhold(self, reviewer: str) -> str | None:
        self.leases.pop(reviewer, None)
        return self.current.pop(reviewer, None)

    def _renew(self, reviewer: str) -> bool:
        """Renew the lease and claim on the reviewer's current item; False (and the
        item is off their screen) if the lease ran out or the claim was lost."""
        key = self.current.get(reviewer)
        if key is None:
            return False
        live = self.leases.get(reviewer, 0.0) > time.monotonic()
        if live and key in self.items and self.claims.claim(key, reviewer) == reviewer:
            self._hold(reviewer, key)
            return True
        if not live:
            self.claims_expired += 1
        self._unhold(reviewer)
        return False

    def _expire_leases(self) -> None:
        """Screens whose lease ran out (closed tabs) give their items up."""
        now = time.monotonic()
        for reviewer, until in list(self.leases.items()):
            if until <= now:
                key = self._unhold(reviewer)
                if key is not None:
                    self.claims_expired += 1
                    log.info("review item %s: %s's screen lease ran out", key, reviewer)

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
        # Built against the configured limits: a text longer than the default limit came
        # through (the queue decodes with them) and its label must be sendable too.
        limits = self.settings.limits
        if item.heads:
            # The reviewer saw every head: a head left blank is a no, not unknown.
            for head in item.heads:
                mine = [x for x in labels if x in head.labels]
                if head.multiclass and len(mine) > 1:
                    raise ReviewError(f"{head.name}: choose at most one of {mine}")
            return HumanLabel.build(limits, labels=list(labels), exhaustive=True, **common)
        if item.multilabel:
            return HumanLabel.build(limits, labels=list(labels), **common)
        if len(labels) != 1:
            raise ReviewError(f"choose exactly one label, got {len(labels)}")
        return HumanLabel.build(limits, label=labels[0], **common)

    def _drop(self, item: ReviewItem) -> None:
        """The item is done with (answered, or put back): out of memory, offsets resolved."""
        self.items.pop(item.key, None)
        for tp, offset in item.offsets:
            self.tracker.resolve(tp, offset)
        for keys in self.skipped.values():
            keys.discard(item.key)


def _lost(holder: str | None) -> str:
    if is_done(holder):
        return "this item was answered by someone else meanwhile; here is your next one"
    who = holder or "nobody"
    return f"your claim on this item timed out and it is with {who} now; here is your next one"
