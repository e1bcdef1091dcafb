"""The demo's traffic: the replayed chat and labels going in, the verdicts coming out.

:class:`Replay` sends every row of the labeled file as a ``ChatMessage`` at a rate and, for
a share of them, a ``HumanLabel`` a little later, like a review queue answering;
:class:`Observer` reads verdicts, review requests and dead letters as they arrive. Both run
on threads of :class:`~worker.demo.run.DemoRun` and write only to its :class:`Observed`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kafka import KafkaConsumer

from schemas import ChatMessage, HumanLabel, LabeledText, Verdict, utcnow
from worker.demo.figures import Observed
from worker.kafka.clients import make_producer, reader_config
from worker.settings import Settings

__all__ = ["Observer", "Replay"]


class Replay:
    """Replays ``rows`` ``repeat`` times at ``rate`` messages per second (0: as fast as it
    can); every message where ``label_share`` ticks over is labeled ``label_delay_s``
    later. Sets ``done`` when everything was sent (or it was stopped)."""

    def __init__(
        self,
        settings: Settings,
        rows: list[LabeledText],
        run_id: str,
        obs: Observed,
        stop: threading.Event,
        done: threading.Event,
        *,
        repeat: int,
        rate: float,
        label_share: float,
        label_delay_s: float,
    ) -> None:
        self.settings = settings
        self.rows = rows
        self.run_id = run_id
        self.obs = obs
        self.stop = stop
        self.done = done
        self.repeat = repeat
        self.rate = rate
        self.label_share = label_share
        self.label_delay_s = label_delay_s

    def run(self) -> None:
        settings = self.settings
        producer = make_producer(settings)
        pending: list[tuple[float, HumanLabel]] = []
        interval = 1.0 / self.rate if self.rate > 0 else 0.0
        n = 0
        try:
            for rep in range(self.repeat):
                for i, row in enumerate(self.rows):
                    if self.stop.is_set():
                        return
                    mid = f"{self.run_id}-{rep}-{i}"
                    msg = ChatMessage.build(
                        settings.limits,
                        message_id=mid,
                        conversation_id=f"conv-{i % 17}",
                        text=row.text[: settings.max_text_chars],
                        created_at=utcnow(),
                    )
                    with self.obs.lock:
                        self.obs.sent[mid] = time.time()
                    producer.send(settings.topic_chat, key=mid.encode(), value=msg.encode())
                    share = self.label_share  # label every message where the share ticks over
                    if int((n + 1) * share) > int(n * share):
                        pending.append((time.time() + self.label_delay_s, self._label(row, msg)))
                    n += 1
                    pending = self._send_due(producer, pending, settings.topic_labels)
                    self.stop.wait(interval)
            while pending and not self.stop.is_set():
                pending = self._send_due(producer, pending, settings.topic_labels)
                self.stop.wait(0.1)
        finally:
            producer.flush(30)
            producer.close()
            self.done.set()

    def _label(self, row: LabeledText, msg: ChatMessage) -> HumanLabel:
        """The reviewer's label of ``msg`` (the row's), with its text; noted as the truth."""
        label = HumanLabel.build(
            self.settings.limits,
            message_id=msg.message_id,
            probe="demo",
            label=row.label,
            labeler_id="demo-reviewer",
            created_at=utcnow(),
            text=msg.text,
        )
        with self.obs.lock:
            self.obs.truth[msg.message_id] = str(row.label)
        return label

    def _send_due(
        self, producer: Any, pending: list[tuple[float, HumanLabel]], topic: str
    ) -> list[tuple[float, HumanLabel]]:
        now = time.time()
        for _, label in (p for p in pending if p[0] <= now):
            producer.send(topic, key=label.message_id.encode(), value=label.encode())
            with self.obs.lock:
                self.obs.labels_sent += 1
        return [p for p in pending if p[0] > now]


class Observer:
    """Reads the verdicts, review requests and dead letters of a run into ``obs``."""

    def __init__(self, settings: Settings, obs: Observed, stop: threading.Event) -> None:
        self.settings = settings
        self.obs = obs
        self.stop = stop

    def run(self) -> None:
        settings = self.settings
        consumer = KafkaConsumer(
            settings.topic_verdicts,
            settings.topic_review,
            settings.topic_dead_letter,
            **reader_config(settings),
        )
        try:
            while not self.stop.is_set():
                for tp, records in consumer.poll(timeout_ms=200).items():
                    self._record(tp.topic, records)
        finally:
            consumer.close()

    def _record(self, topic: str, records: list[Any]) -> None:
        settings = self.settings
        now = time.time()
        with self.obs.lock:
            if topic == settings.topic_verdicts:
                for r in records:
                    v = Verdict.decode(r.value)
                    self.obs.verdicts.setdefault(v.message_id, (now, v))
            elif topic == settings.topic_review:
                self.obs.reviews += len(records)
            else:
                self.obs.dead_letters += len(records)
