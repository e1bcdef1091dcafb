"""Request bodies of ``probeguard serve``: read within a size and a time bound, then parsed
and validated off the event loop, with errors cut short.

A body's cost is decided before the work: the schema (:mod:`schemas.moderation_api`) caps
inputs per call, characters per input and the length of every other string, so validating
the largest body the server reads takes milliseconds and yields a handful of errors, not
one per item. At most ``PARSE_THREADS`` bodies are validated at once, off the event loop:

- a body of at most ``INLINE_BYTES`` (every ordinary request) on a worker thread;
- a larger one first in one of ``PARSE_THREADS`` worker processes at the lowest CPU
  priority (``SCHED_IDLE``, :mod:`worker.serve.niced`; started on the first such body,
  their imports done at the server's priority). pydantic holds the GIL while it validates,
  so a client sending megabyte bodies of wrong items (~40-90 ms each) took the interpreter
  from the scoring thread and the event loop; in a process of its own it takes only CPU,
  and only what the machine leaves idle. Only a body the schema accepts is then validated
  again here, which for valid text costs about a millisecond per megabyte. What crosses
  between the processes is the body as ``bytes`` and the refusal's fields: no client data
  is ever unpickled as objects.

A large body's check can so wait for as long as the machine's cores are busy (a scorer or a
build beside the server): it waits at most ``PROBEGUARD_SERVE_TIMEOUT_S``, then is a 503
with ``Retry-After``; at most ``CHECK_QUEUE`` large bodies wait for or hold a checker
process at once (a check past its time still holds one until it ends), the rest are 503
at once; and small bodies never wait behind large ones (they have places of their own).
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from schemas import describe_error
from schemas.moderation_api import HARD_MAX_INPUTS
from worker.serve.errors import ApiError
from worker.serve.niced import Rationed, lower_priority

__all__ = [
    "CHECK_QUEUE",
    "INLINE_BYTES",
    "PARSE_THREADS",
    "BodyReader",
    "Parser",
    "declared_length",
]

PARSE_THREADS = 2  # bodies validated at once (a third waits; the event loop never does)
INLINE_BYTES = 64 * 1024  # larger bodies are checked in a worker process first
CHECK_QUEUE = 8  # large bodies waiting for, or in, a checker process (each <= the body cap)


def declared_length(request: Request) -> int:
    """The body's ``Content-Length`` (0 when absent or not a plain number)."""
    length = request.headers.get("content-length", "")
    return int(length) if length.isdigit() and len(length) < 19 else 0


class BodyReader:
    """Reads a body of at most ``limit`` bytes within ``timeout_s`` seconds.

    A body declared (``Content-Length``) or found larger than ``limit`` is a 413; the rest
    of it is read and dropped, up to ``drain_bytes``, so a client that writes its whole
    body before reading (Python's urllib, most blocking clients) reads the 413 instead of
    a reset connection. A body still arriving after ``timeout_s`` is a 408.
    """

    def __init__(self, limit: int, timeout_s: float, drain_bytes: int) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self.drain_bytes = drain_bytes

    async def read(self, request: Request) -> bytes:
        too_large = ApiError(
            413,
            f"request body over {self.limit} bytes (PROBEGUARD_SERVE_MAX_BODY_BYTES)",
            code="request_too_large",
            close=True,
        )
        slow = ApiError(
            408,
            f"the request body did not arrive within {self.timeout_s:g}s "
            "(PROBEGUARD_SERVE_BODY_TIMEOUT_S)",
            code="request_timeout",
            close=True,
        )
        declared = declared_length(request)
        if declared > self.drain_bytes:
            raise too_large  # not worth reading: the client may see the connection reset
        body = bytearray()
        total = 0
        try:
            with anyio.fail_after(self.timeout_s):
                async for chunk in request.stream():
                    total += len(chunk)
                    if total <= self.limit and declared <= self.limit:
                        body += chunk
                    elif total > self.drain_bytes:
                        break
        except TimeoutError:
            raise slow from None
        except ClientDisconnect:
            raise ApiError(400, "the client closed the connection", close=True) from None
        if total > self.limit or declared > self.limit:
            raise too_large
        return bytes(body)

    async def discard(self, request: Request, budget: int) -> bool:
        """Read and drop a body of at most ``budget`` bytes (declared or found); False
        when it is larger, slow or cut off (then the connection should be closed)."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > budget:
            return False
        try:
            with anyio.fail_after(min(self.timeout_s, 5.0)):
                async for chunk in request.stream():
                    budget -= len(chunk)
                    if budget < 0:
                        return False
        except (TimeoutError, ClientDisconnect, RuntimeError):
            return False
        return True


class Parser:
    """Validates request bodies against a schema (module docstring): a 400 naming the
    first few offending fields, or a 413 when the body holds more inputs or longer texts
    than the schema's ceilings."""

    def __init__(self, collector: CollectorRegistry, timeout_s: float = 30.0) -> None:
        self._limiter = anyio.CapacityLimiter(PARSE_THREADS)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # the pool, started on the first large body
        self._places = Rationed(  # timeout_s: longest a large body waits for its check
            CHECK_QUEUE,
            timeout_s,
            what="the body",
            busy=f"{CHECK_QUEUE} large bodies are waiting for their checks; try again",
        )
        self.checks = Counter(
            "probeguard_serve_body_checks",
            "Request bodies validated, by where: thread (small ones), process (larger than "
            "INLINE_BYTES: checked in a niced worker process first)",
            ["where"],
            registry=collector,
        )

    async def parse(self, model: type[Any], body: bytes, *, max_inputs: int) -> Any:
        if len(body) > INLINE_BYTES:
            self.checks.labels("process").inc()
            await self._check_elsewhere(model, body, max_inputs)
        else:
            self.checks.labels("thread").inc()
        async with self._limiter:
            return await anyio.to_thread.run_sync(_validate, model, body, max_inputs)

    async def _check_elsewhere(self, model: type[Any], body: bytes, max_inputs: int) -> None:
        ref = f"{model.__module__}:{model.__qualname__}"
        pool = self._workers()
        try:
            refusal = await self._places.run(
                lambda: pool.submit(_refusal_fields, ref, body, max_inputs)
            )
        except BrokenProcessPool:  # a worker died (killed, out of memory): start anew
            raise self._restarted(pool) from None
        if refusal is not None:
            raise ApiError(**refusal)

    def _restarted(self, pool: ProcessPoolExecutor) -> ApiError:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        return ApiError(
            503, "the body checker restarted; try again", code="busy", retry_after_s=1.0
        )

    def _workers(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    PARSE_THREADS,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_lowered,
                )
            return self._pool

    def close(self) -> None:
        """Stop the worker processes, if any were started."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _lowered() -> None:
    """A checker process's initializer: by now this module and the request schemas
    (:mod:`schemas.moderation_api`) are imported, at the server's priority (imported at the
    lowest, the first check took over a minute on a busy machine); the checks run at the
    lowest."""
    lower_priority()


def _refusal_fields(ref: str, body: bytes, max_inputs: int) -> dict[str, Any] | None:
    """In a worker process: None when ``body`` is valid for the schema ``ref``
    (``module:Class``), else the refusal's fields."""
    module, name = ref.split(":")
    model = getattr(importlib.import_module(module), name)
    try:
        _count_inputs(body, max_inputs)
        _validate(model, body, max_inputs)
    except ApiError as e:
        return {"status": e.status, "message": e.message, "code": e.code, "param": e.param}
    return None


def _count_inputs(body: bytes, max_inputs: int) -> None:
    """A list ``input`` longer than the schema allows (``HARD_MAX_INPUTS``) is refused on its
    length alone, as the schema would refuse it: the JSON parser reads 0.9 MB of items in
    ~17 ms where validating them took ~49 ms. Anything else (not JSON, another shape, a
    length within the ceiling) is left to the schema's own errors."""
    try:
        data = json.loads(body)
    except ValueError:
        return
    items = data.get("input") if isinstance(data, dict) else None
    if isinstance(items, list) and len(items) > HARD_MAX_INPUTS:
        raise _too_many_inputs(len(items), max_inputs)


def _validate(model: type[Any], body: bytes, max_inputs: int) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _refusal(exc, max_inputs) from None


def _refusal(exc: ValidationError, max_inputs: int) -> ApiError:
    # The schema caps lists and strings, so there are at most a few thousand errors here.
    errors: list[Any] = exc.errors(include_url=False, include_input=False)
    for err in errors:
        field = str(err["loc"][0]) if err["loc"] else ""
        ctx = err.get("ctx") or {}
        if err["type"] == "too_long" and field == "input":
            return _too_many_inputs(ctx.get("actual_length", "too many"), max_inputs)
        if err["type"] == "string_too_long" and field in {"input", "comment"}:
            param = "input" if field == "input" else "comment.text"
            return ApiError(
                413,
                f"{param} is longer than {ctx.get('max_length')} characters "
                "(PROBEGUARD_MAX_TEXT_CHARS)",
                param=param,
                code="text_too_long",
            )
    kind, why = describe_error(exc)
    message = f"the body is not JSON: {why}" if kind == "invalid_json" else why
    return ApiError(400, message, code=kind)


def _too_many_inputs(n: object, max_inputs: int) -> ApiError:
    return ApiError(
        413,
        f"{n} inputs; at most {max_inputs} per request (PROBEGUARD_SERVE_MAX_INPUTS)",
        param="input",
        code="too_many_inputs",
    )
