"""The review queue's send side: answers out of their undo window onto the labels topic.

The flusher thread (:meth:`LabelSender._flush`) takes every answer whose undo window
(``console_undo_s``) has passed, signs it as the console's (``PROBEGUARD_LABELER_KEYS``)
and produces it; after the broker's acknowledgement the item is marked done in Redis and
leaves the desk, which resolves its offsets; an answer not acknowledged is kept and sent
again. :class:`~worker.review.queue.ReviewQueue` adds the consumer side (requests in).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from worker.learning.labelers import CONSOLE_SIGNER, LabelerKeys
from worker.review.desk import Held, ReviewDesk
from worker.settings import Settings

__all__ = ["LabelSender", "failure"]

log = logging.getLogger(__name__)


def failure(exc: BaseException) -> str:
    """``Type: message`` of a send or requeue failure, for the log and ``last_error``."""
    return f"{type(exc).__name__}: {exc}"


class LabelSender(ReviewDesk):
    """The reviewers' desk with the flusher that sends their answers (see the module
    docstring); ``producer`` is set by whoever starts the threads."""

    def __init__(self, settings: Settings, client: Any) -> None:
        super().__init__(settings, client)
        self.sent = 0
        self.send_failures = 0
        self.last_error = ""
        self.producer: Any = None
        self._stop = threading.Event()
        raw_keys = settings.labeler_keys
        self.labelers = LabelerKeys.parse(raw_keys.get_secret_value() if raw_keys else None)

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
            value = h.label.encode()
            # Signed as the console's (its reviewers are signed in): the updater then counts
            # each reviewer as a labeler of its own (console/<reviewer>).
            signs = self.labelers.signs_for(CONSOLE_SIGNER)
            headers = self.labelers.sign(CONSOLE_SIGNER, value) if signs else None
            try:
                futures.append(
                    (
                        h,
                        self.producer.send(topic, key=mid.encode(), value=value, headers=headers),
                    )
                )
            except Exception as exc:  # e.g. KafkaTimeoutError: no metadata within max_block_ms
                for rest in due[i:]:  # the next sends would block as long: all wait a round
                    self._retry(rest, f"label for {mid} not sent: {failure(exc)}")
                break
        for h, future in futures:
            try:
                future.get(timeout=self.settings.kafka_request_timeout_ms / 1000 + 60)
            except Exception as exc:  # whatever it was, the answer is kept and sent again
                self._retry(h, f"label for {h.label.message_id} not acknowledged: {failure(exc)}")
                continue
            self._acknowledged(h)

    def _acknowledged(self, h: Held) -> None:
        try:
            self.claims.finish(h.item.key, h.reviewer)
        except (redis.RedisError, OSError) as exc:  # only the restart shortcut is lost
            log.warning("review item %s not marked done (%s)", h.item.key, exc)
        with self.lock:
            self.sending.discard(h.item.key)
            self._drop(h.item)
            self.sent += 1

    def _retry(self, h: Held, why: str) -> None:
        log.warning("%s; retrying", why)
        with self.lock:
            self.sending.discard(h.item.key)
            h.due = time.monotonic() + 2.0
            self.held.setdefault(h.reviewer, []).insert(0, h)
            self.send_failures += 1
            self.last_error = why[:300]
