"""Join the consumer group while the role is still loading (the scorer's LLM).

A consumer group forms in about three seconds (half a session timeout on the embedded
broker, a rebalance round on Kafka), and loading the LLM takes about five: done one after
the other, they are most of the time from ``probeguard score`` to the first verdict.
:class:`EarlyJoin` makes the topics, creates the consumer and joins the group on a thread
while the main thread loads; the role takes the joined consumer for its batch loop.

Joining does not fetch: kafka-python's group coordinator is polled on its own
(``consumer._coordinator.poll``, the step ``KafkaConsumer.poll`` runs before fetching), so
no record is read before the role can handle it, and nothing is committed. The heartbeat
runs on kafka-python's IO thread, so the membership holds while the load goes on (up to
``max_poll_interval_ms``). Until the role takes the consumer, the thread keeps polling the
coordinator (never fetching): a member that stops polling would hold up every rebalance of
the group (another scorer starting or leaving) until it polls again.

A role that cannot start work at once (a scorer with no probe to serve yet) must
:meth:`release` the consumer: a member that holds partitions without polling stalls them.
Any failure here is logged and the role makes its own consumer later, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kafka import KafkaConsumer

from worker.kafka.clients import ensure_topics, make_consumer

__all__ = ["EarlyJoin", "join_group"]

log = logging.getLogger(__name__)
KEEP_UP_S = 0.2  # how often a joined, waiting member answers the group coordinator


def join_group(consumer: KafkaConsumer, timeout_s: float) -> bool:
    """Join ``consumer``'s group without fetching records; True once partitions are assigned
    (a member of a group with more members than partitions may get none: False then, and
    the first poll carries on). Never raises: the first poll retries whatever failed."""
    coordinator: Any = getattr(consumer, "_coordinator", None)
    if coordinator is None or not hasattr(coordinator, "poll"):
        return False  # another kafka-python: the first poll joins, as without this
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            joined = coordinator.poll(timeout_ms=min(remaining_ms, 1000))
            # In the group (True only once a join completed), with or without partitions.
            if consumer.assignment() or (joined and not coordinator.need_rejoin()):
                return bool(consumer.assignment())
    except Exception as exc:  # the broker, the coordinator: the first poll retries
        log.info("joining the group early failed (%s); the first poll joins", exc)
    return False


class EarlyJoin:
    """Make the topics and join ``group_id`` on ``topic`` from a thread; :meth:`take` the
    consumer when the role is ready for it (or :meth:`release` it). Both wait for the
    thread, so the consumer is only ever used by one thread at a time."""

    def __init__(self, settings: Any, group_id: str, topic: str, *, timeout_s: float = 30.0):
        self.settings = settings
        self.group_id = group_id
        self.topic = topic
        self.timeout_s = timeout_s
        self.joined = threading.Event()  # set once partitions are assigned
        self._consumer: KafkaConsumer | None = None
        self._taken = threading.Event()  # the role takes (or releases) the consumer
        self._thread = threading.Thread(target=self._run, name="early-join", daemon=True)

    @classmethod
    def start(cls, settings: Any, group_id: str, topic: str) -> EarlyJoin:
        join = cls(settings, group_id, topic)
        join._thread.start()
        return join

    def _run(self) -> None:
        started = time.monotonic()
        try:
            ensure_topics(self.settings)
            self._consumer = make_consumer(self.settings, self.group_id, [self.topic])
        except Exception as exc:  # the role retries its own setup and says why
            log.info("could not join %s early (%s); joining when ready", self.group_id, exc)
            return
        if join_group(self._consumer, self.timeout_s):
            log.info(
                "joined %s in %.1f s while loading: %d partition(s) of %s",
                self.group_id,
                time.monotonic() - started,
                len(self._consumer.assignment()),
                self.topic,
            )
            self.joined.set()
        # Take part in the group's rebalances while the role loads (see the module docstring).
        while not self._taken.wait(KEEP_UP_S):
            if join_group(self._consumer, KEEP_UP_S):
                self.joined.set()

    @property
    def holding(self) -> bool:
        """Whether it still holds its consumer (joining or joined, not taken or released)."""
        return self._consumer is not None

    def take(self) -> KafkaConsumer | None:
        """The consumer, subscribed and (normally) in the group; None when the early join
        failed or the consumer was taken or released before (the role makes its own)."""
        self._taken.set()
        self._thread.join()
        consumer, self._consumer = self._consumer, None
        return consumer

    def release(self) -> None:
        """Leave the group (the role is not ready to consume); idempotent."""
        consumer = self.take()
        if consumer is not None:
            log.info("leaving %s until there is something to serve", self.group_id)
            try:
                consumer.close()
            except Exception as exc:  # a broker gone away: the session expires on its own
                log.info("leaving the group: %s", exc)
