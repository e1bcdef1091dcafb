"""What the routes of ``probeguard serve`` use (:mod:`worker.serve.openai_api`,
:mod:`worker.serve.perspective_api`, built into one app by :mod:`worker.serve.app`).

:class:`Service` holds a :class:`~worker.scoring.front.FrontDoor` (the
:class:`~worker.scoring.engine.ScoringEngine` the Kafka scorer uses: the same probes,
hot-swapped by the same watcher; the same canary assignment, evidence, decided records
and review budget; and the Kafka outbox, as the inline guard has), the
:class:`~worker.serve.batcher.MicroBatcher` that scores concurrent requests together on
one thread, the API keys and the per-key rate limiter. A route refuses a request by
raising :class:`ApiError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import anyio
import redis

from schemas import ChatMessage, ProbeSpec
from worker.errors import ExtractionInputError
from worker.llm.extract import HiddenStateExtractor, clean_text
from worker.scoring.engine import Retain
from worker.scoring.front import FrontDoor, FrontSettings
from worker.serve.auth import Authenticator
from worker.serve.batcher import Expired, MicroBatcher, Scored
from worker.serve.bodies import Parser
from worker.serve.errors import ApiError
from worker.serve.keys import KeyRing, RateLimiter
from worker.settings import Settings

__all__ = ["ApiError", "Service"]

# OpenAI's model names a client may send: they mean the default probe.
OPENAI_MODELS = ("omni-moderation", "text-moderation")
STALE_AFTER_S = 120.0  # the scoring thread's longest silence before /healthz fails
MEASURE_THREADS = 2  # requests tokenized at once to be measured (off the event loop)


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
        self.settings = settings
        self.keys = keys
        self.door = FrontDoor(
            settings, extractor, redis_client, FrontSettings.serve(settings), worker_id=worker_id
        )
        self.engine = self.door.engine
        self.collector = self.door.metrics.collector
        self.batcher = MicroBatcher(
            lambda messages, retain: self.door.judge(messages, retain),
            self.collector,
            max_batch=settings.serve_max_batch,
            max_wait_s=settings.serve_max_wait_ms / 1000.0,
            pass_tokens=settings.serve_pass_tokens,
            after=lambda judged, _: self.door.send(judged),
        )
        self.limiter = RateLimiter(settings.serve_rate_per_key, settings.serve_rate_burst)
        self.tokens = RateLimiter(settings.serve_tokens_per_key, settings.serve_tokens_burst)
        self._measuring = anyio.CapacityLimiter(MEASURE_THREADS)
        self.auth = Authenticator(
            keys,
            RateLimiter(settings.serve_new_keys_per_address, settings.serve_new_keys_burst),
            self.collector,
            settings.serve_timeout_s,
        )
        self.parser = Parser(self.collector, settings.serve_timeout_s)
        self._stack = contextlib.ExitStack()

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        # Listen at once; /readyz says when a probe is served (published, bootstrap or
        # the packaged default), and requests before then get a 503 with Retry-After.
        self.door.start()
        self._stack.callback(self.door.stop)
        self.batcher.start()
        self._stack.callback(self.batcher.stop)
        self._stack.callback(self.auth.close)
        self._stack.callback(self.parser.close)

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

    def live_spec(self, probe: str) -> ProbeSpec:
        """The spec of ``probe``'s live version, before scoring (what a request may ask
        of it); a scored result's own is in :attr:`Scored.specs`."""
        live = self.engine.watcher.slots[probe].live
        if live is None:
            raise ApiError(503, "no probe is loaded yet", retry_after_s=1.0)
        return live.probe.spec

    async def measure(self, texts: Sequence[str]) -> list[int]:
        """The tokens each text costs the LLM (0: nothing in it the model can read), counted
        on a worker thread before anything is scored."""
        counts = self.engine.extractor.token_counts
        return await anyio.to_thread.run_sync(counts, list(texts), limiter=self._measuring)

    def charge(self, limit_key: str, tokens: int) -> None:
        """Spend ``tokens`` of the caller's token budget, or refuse the request: a 413 when
        it costs more than the whole burst, a 429 with ``Retry-After`` when it must wait."""
        s = self.settings
        if tokens > s.serve_tokens_burst:
            raise ApiError(
                413,
                f"the request is {tokens} tokens; at most {s.serve_tokens_burst} per request "
                "(PROBEGUARD_SERVE_TOKENS_BURST)",
                code="request_too_large",
            )
        wait = self.tokens.take(limit_key, cost=float(tokens))
        if wait > 0:
            raise ApiError(
                429,
                f"token rate of {s.serve_tokens_per_key:g}/s for this key reached "
                "(PROBEGUARD_SERVE_TOKENS_PER_KEY)",
                code="rate_limit_exceeded",
                retry_after_s=wait,
            )

    async def score(
        self,
        messages: Sequence[ChatMessage],
        retain: Sequence[Retain],
        costs: Sequence[int] = (),
    ) -> Scored:
        """The request's share of a batch. A request whose batch has not started within
        ``PROBEGUARD_SERVE_TIMEOUT_S`` is a 503 and is never scored; one whose batch has
        started is answered when the batch ends (its inputs are cached and counted by
        then: a 503 would make the caller send them again)."""
        if not self.door.ready():
            raise ApiError(503, "no probe is loaded yet", code="not_ready", retry_after_s=1.0)
        timeout_s = self.settings.serve_timeout_s
        future = self.batcher.submit(messages, retain, time.monotonic() + timeout_s, costs)
        waiting = asyncio.wrap_future(future)
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
            except TimeoutError:
                if future.cancel():  # not started: now it never will be
                    raise Expired() from None
                return await waiting  # being scored: wait for the batch to end
        except Expired:
            raise ApiError(
                503,
                f"scoring did not start within {timeout_s:g}s (PROBEGUARD_SERVE_TIMEOUT_S); "
                "nothing of the request was scored",
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


def unreadable(text: str) -> str:
    """Why the model reads nothing of ``text`` (for a 400)."""
    try:
        clean_text(text)
    except ExtractionInputError as exc:
        return str(exc).partition(": ")[2] or str(exc)
    return "it yields no tokens"
