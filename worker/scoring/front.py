"""One front door to the scoring engine for the roles that score on request rather than
from a topic: ``probeguard serve`` (:mod:`worker.serve`) and the inline guard
(:mod:`worker.guard`).

A :class:`FrontDoor` holds what both need around one :class:`ScoringEngine`: its probe
watcher on a thread (no batch loop polls it), a thread that waits for the first probes
(published, the bootstrap checkpoint or the packaged default) while the role already
answers, and the Kafka :class:`~worker.kafka.outbox.Outbox` for what it judged. What each
role reads of its own settings is its :class:`FrontSettings`; the Kafka scorer holds the
engine itself (its batch loop commits offsets after producing, which an outbox cannot).

Example::

    door = FrontDoor(settings, extractor, redis_client, FrontSettings.serve(settings))
    door.start()                       # watcher, outbox, the wait for probes
    judged = door.judge(messages, [Retain.ALL] * len(messages))
    door.send(judged)                  # verdicts and review requests, off the caller's path
    door.stop()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import redis

from schemas import ChatMessage
from worker.kafka.outbox import Outbox
from worker.llm.extract import Extraction, HiddenStateExtractor
from worker.scoring.engine import Judged, Retain, ScoringEngine
from worker.scoring.metrics import ScorerMetrics
from worker.settings import GuardSettings, ServeSettings, Settings

__all__ = ["FrontDoor", "FrontSettings"]


@dataclass(frozen=True)
class FrontSettings:
    """What a front door reads of its role's settings section (``ServeSettings``,
    ``GuardSettings``): the rest of those sections is the role's own."""

    role: Literal["serve", "guard"]  # names its worker id and its threads
    verdicts: bool  # each verdict goes to the verdicts topic
    review: bool  # review requests are asked for (within the shared budget) and sent

    @classmethod
    def serve(cls, settings: ServeSettings) -> FrontSettings:
        """``PROBEGUARD_SERVE_VERDICTS`` and ``PROBEGUARD_SERVE_REVIEW``."""
        return cls("serve", settings.serve_verdicts, settings.serve_review)

    @classmethod
    def guard(cls, settings: GuardSettings) -> FrontSettings:
        """``PROBEGUARD_GUARD_VERDICTS`` and ``PROBEGUARD_GUARD_REVIEW``."""
        return cls("guard", settings.guard_verdicts, settings.guard_review)


class FrontDoor:
    """The engine, its watcher and waiting threads, and the outbox, started and stopped
    together. ``worker_id`` defaults to the role and ``PROBEGUARD_WORKER_ID``."""

    def __init__(
        self,
        settings: Settings,
        extractor: HiddenStateExtractor,
        redis_client: redis.Redis,
        front: FrontSettings,
        *,
        worker_id: str | None = None,
    ) -> None:
        self.front = front
        self.metrics = ScorerMetrics()
        self.engine = ScoringEngine(
            settings,
            extractor,
            redis_client,
            worker_id=worker_id or f"{front.role}-{settings.resolved_worker_id()}",
            metrics=self.metrics,
            watch="thread",
        )
        self.outbox = Outbox(
            settings,
            self.metrics.collector,
            verdicts=front.verdicts,
            reviews=front.review,
            name=f"{front.role}-outbox",
        )
        self.stop_event = threading.Event()
        self._stack = contextlib.ExitStack()

    def start(self) -> FrontDoor:
        """The probe watcher and the outbox; probes load in the background (see
        :meth:`ready`)."""
        self._stack.enter_context(self.engine.watching())
        self.outbox.start()
        self._stack.callback(self.outbox.stop)
        self._stack.callback(self.stop_event.set)
        threading.Thread(
            target=self.engine.wait_for_probes,
            args=(self.stop_event, lambda: None),
            name=f"{self.front.role}-probes",
            daemon=True,
        ).start()
        return self

    def stop(self) -> None:
        self._stack.close()

    def ready(self) -> bool:
        """Every probe has a live version to score with."""
        return self.engine.batch_scorer.ready()

    def judge(
        self,
        messages: Sequence[ChatMessage],
        retain: Sequence[Retain],
        *,
        review: bool = True,
        states: Extraction | None = None,
    ) -> Judged:
        """:meth:`ScoringEngine.judge`, asking for review requests only when this role
        sends them (and ``review``)."""
        return self.engine.judge(
            messages, retain=retain, review=review and self.front.review, states=states
        )

    def send(self, judged: Judged) -> None:
        """The batch's verdicts and review requests to Kafka, as this role sends them
        (never blocks: see :class:`~worker.kafka.outbox.Outbox`)."""
        self.outbox.put_judged(judged.verdicts, judged.reviews)
