"""Where every input of a fault test ended up, and the summary table the suite prints."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kafka import KafkaConsumer

from worker.kafka.clients import client_config
from worker.settings import Settings


@dataclass
class Outcome:
    """Records on the verdict and dead-letter topics, by Kafka key."""

    verdicts: Counter[str] = field(default_factory=Counter)
    dead: Counter[str] = field(default_factory=Counter)
    dead_by_topic: Counter[str] = field(default_factory=Counter)
    verdict_versions: dict[str, set[int]] = field(default_factory=dict)

    def missing(self, keys: set[str]) -> set[str]:
        return keys - set(self.verdicts) - set(self.dead)


class Tally:
    """Follows the verdict and dead-letter topics from their start (no group), counting
    records by Kafka key; ``wait`` polls until a condition on the :class:`Outcome` holds."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.outcome = Outcome()
        self._consumer = KafkaConsumer(
            settings.topic_verdicts,
            settings.topic_dead_letter,
            **client_config(settings),
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )

    def poll(self, timeout_ms: int = 200) -> None:
        from schemas import DeadLetter, Verdict

        out = self.outcome
        for records in self._consumer.poll(timeout_ms=timeout_ms).values():
            for r in records:
                key = r.key.decode() if r.key is not None else ""
                if r.topic == self.settings.topic_verdicts:
                    out.verdicts[key] += 1
                    versions = {x.version for x in Verdict.decode(r.value).results}
                    out.verdict_versions.setdefault(key, set()).update(versions)
                else:
                    out.dead[key] += 1
                    out.dead_by_topic[DeadLetter.decode(r.value).source_topic] += 1

    def wait(self, done: Callable[[Outcome], bool], timeout_s: float, what: str) -> Outcome:
        deadline = time.monotonic() + timeout_s
        while not done(self.outcome):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
            self.poll()
        return self.outcome

    def settle(self, keys: set[str], timeout_s: float = 180.0, extra_s: float = 2.0) -> Outcome:
        """Wait until every key has an outcome (or the timeout), then ``extra_s`` more to
        catch late duplicates; never raises (the caller asserts on ``missing``)."""
        deadline = time.monotonic() + timeout_s
        while self.outcome.missing(keys) and time.monotonic() < deadline:
            self.poll()
        end = time.monotonic() + extra_s
        while time.monotonic() < end:
            self.poll()
        return self.outcome

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> Tally:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Row:
    fault: str
    messages_in: int
    verdicts: int
    dead_letters: int
    missing: int
    note: str = ""


ROWS: list[Row] = []


def record(row: Row) -> None:
    ROWS.append(row)


def table(rows: list[Row]) -> str:
    head = ("fault", "messages in", "verdicts", "dead letters", "missing", "note")
    cells = [head] + [
        (r.fault, str(r.messages_in), str(r.verdicts), str(r.dead_letters), str(r.missing), r.note)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
