"""What the routes of ``probeguard serve`` (:mod:`worker.serve.app`) use.

:class:`Service` holds the :class:`~worker.scoring.engine.ScoringEngine` the Kafka scorer
uses (the same probes, hot-swapped by the same watcher; the same canary assignment,
evidence, decided records and review budget), the
:class:`~worker.serve.batcher.MicroBatcher` that scores concurrent requests together on
one thread, the Kafka :class:`~worker.serve.outbox.Outbox`, the API keys and the per-key
rate limiter. A route refuses a request by raising :class:`ApiError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence

import redis

from schemas import ChatMessage, ProbeSpec
from worker.llm.extract import HiddenStateExtractor
from worker.scoring.engine import Retain, ScoringEngine
from worker.scoring.metrics import ScorerMetrics
from worker.serve.batcher import MicroBatcher, Scored
from worker.serve.keys import KeyRing, RateLimiter
from worker.serve.outbox import Outbox
from worker.settings import Settings

__all__ = ["ApiError", "Service"]

# OpenAI's model names a client may send: they mean the default probe.
OPENAI_MODELS = ("omni-moderation", "text-moderation")
STALE_AFTER_S = 120.0  # the scoring thread's longest silence before /healthz fails


class ApiError(Exception):
    """A refusal: its HTTP status, a message for the caller, and what the dialects need."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


class Service:
    def __init__(
        self,
        settings: Settings,
        extractor: HiddenStateExtractor,
        redis_client: redis.Redis,
        *,
        keys: KeyRing | None,
        worker_id: str | None = None,
    ) -> None:
        # The watcher always runs on its own thread here: there is no batch loop to poll it.
        settings = settings.model_copy(update={"probe_watch": "thread"})
        self.settings = settings
        self.keys = keys
        self.metrics = ScorerMetrics()
        self.collector = self.metrics.collector
        self.engine = ScoringEngine(
            settings,
            extractor,
            redis_client,
            worker_id=worker_id or f"serve-{settings.resolved_worker_id()}",
            metrics=self.metrics,
        )
        self.outbox = Outbox(settings, self.collector)
        self.batcher = MicroBatcher(
            lambda messages, retain: self.engine.judge(
                messages, retain=retain, review=settings.serve_review
            ),
            self.collector,
            max_batch=settings.serve_max_batch,
            max_wait_s=settings.serve_max_wait_ms / 1000.0,
            after=self.outbox.put,
        )
        self.limiter = RateLimiter(settings.serve_rate_per_key, settings.serve_rate_burst)
        self.stop_event = threading.Event()
        self._stack = contextlib.ExitStack()

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._stack.enter_context(self.engine.watching())
        self.outbox.start()
        self._stack.callback(self.outbox.stop)
        self.batcher.start()
        self._stack.callback(self.batcher.stop)
        self._stack.callback(self.stop_event.set)
        # Listen at once; /readyz says when a probe is served (published, bootstrap or
        # the packaged default), and requests before then get a 503 with Retry-After.
        threading.Thread(
            target=self.engine.wait_for_probes,
            args=(self.stop_event, lambda: None),
            name="serve-probes",
            daemon=True,
        ).start()

    def stop(self) -> None:
        self._stack.close()

    # --- what the routes use ---------------------------------------------------

    def probe_for(self, model: str | None) -> str:
        """The probe a request's ``model`` names (OpenAI's names: the first probe)."""
        names = self.settings.probe_names
        if model is None or model in names or model.startswith(OPENAI_MODELS):
            return model if model in names else names[0]
        raise ApiError(
            404,
            f"The model {model[:64]!r} does not exist: the probes served are {names}",
            param="model",
            code="model_not_found",
        )

    def spec(self, probe: str, version: int | None) -> ProbeSpec:
        """The spec of ``probe``'s served ``version`` (None: the live one)."""
        slot = self.engine.watcher.slots[probe]
        for p in (slot.live, slot.canary):
            if p is not None and (version is None or p.version == version):
                return p.probe.spec
        if slot.live is None:
            raise ApiError(503, "no probe is loaded yet", retry_after_s=1.0)
        return slot.live.probe.spec  # swapped since: the labels are the same or near

    async def score(self, messages: Sequence[ChatMessage], retain: Sequence[Retain]) -> Scored:
        if not self.engine.batch_scorer.ready():
            raise ApiError(503, "no probe is loaded yet", code="not_ready", retry_after_s=1.0)
        future = self.batcher.submit(messages, retain)
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(future), self.settings.serve_timeout_s
            )
        except TimeoutError:
            raise ApiError(
                503,
                f"scoring took longer than {self.settings.serve_timeout_s:g}s "
                "(PROBEGUARD_SERVE_TIMEOUT_S)",
                code="timeout",
                retry_after_s=1.0,
            ) from None
        except Exception as exc:  # the batch failed; the server goes on
            why = f"scoring failed ({type(exc).__name__})"
            raise ApiError(503, why, code="unavailable", retry_after_s=1.0) from None

    def alive(self) -> tuple[bool, str]:
        if not self.batcher.alive():
            return False, "the scoring thread is not running"
        age = time.monotonic() - self.batcher.beat
        if age > STALE_AFTER_S:
            return False, f"the scoring thread is stuck: last iteration {age:.0f}s ago"
        return True, f"ok (last iteration {age:.1f}s ago)"

    def ready(self) -> tuple[bool, str]:
        return self.engine.serving_note()
