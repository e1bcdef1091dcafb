"""Connections of ``probeguard serve``: uvicorn's HTTP/1.1 protocol, with a deadline for a
request's headers and caps on open connections.

uvicorn closes an idle keep-alive connection, but not one that sends half a request line
and stops: 50 such connections stayed open for as long as their clients liked, and at 50
new ones a second the process would run out of descriptors. Here

- a request's headers must be complete within ``header_timeout_s`` of the connection
  opening, or of the first byte after a keep-alive pause; if not, the connection is
  closed (the body has its own deadline: :class:`worker.serve.bodies.BodyReader`);
- at most ``max_connections`` connections are open, and at most ``max_per_address`` from
  one client address; a connection over either cap is answered 503 with ``Retry-After``
  and closed at once, so a flood from one address costs other addresses nothing;
- one client address opens at most ``new_per_address_s`` connections a second (bursts
  of ``max_per_address``); the rest get the same 503 before any HTTP is parsed: a client
  that ignores its 429s and reconnects at once (every refused body closes its connection)
  costs the event loop an accept and a write, not a request;
- a refused connection gets its 503 after ``refusal_delay_s`` (the ``Retry-After`` it
  names), unread, with at most ``refusals_held`` connections waiting so (beyond them, at
  once). A client that reconnects the moment it is refused, as a flood does, then opens
  one connection per second per connection it holds, not hundreds: refused at once, the
  floods of ``bench/serve_abuse.py`` reconnected ~800 times a second each, and the
  accepts, transports and closes took a fifth of the event loop from valid requests.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from worker.serve.keys import RateLimiter

__all__ = ["guarded_protocol"]


# Bytes a connection waiting for its refusal may send (then it is no longer read).
_DISCARD = 64 * 1024


def _refusal(retry_after_s: float) -> bytes:
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %d\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n"
    ) % max(1, round(retry_after_s))


@dataclass
class _Guard:
    """One server's caps and what they count (shared by all its connections)."""

    header_timeout_s: float
    max_connections: int
    max_per_address: int
    opened: RateLimiter  # new connections per address
    refusal_delay_s: float
    refusals_held: int
    refused: bytes  # the 503
    per_address: Counter[str] = field(default_factory=Counter)
    held: set[asyncio.TimerHandle] = field(default_factory=set)  # refusals waiting


def guarded_protocol(
    *,
    header_timeout_s: float,
    max_connections: int,
    max_per_address: int,
    new_per_address_s: float,
    refusal_delay_s: float = 1.0,
    refusals_held: int = 256,
) -> type[asyncio.Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)``; its caps count the connections of
    the one server it is given to."""
    guard = _Guard(
        header_timeout_s=header_timeout_s,
        max_connections=max_connections,
        max_per_address=max_per_address,
        opened=RateLimiter(new_per_address_s, max_per_address),
        refusal_delay_s=refusal_delay_s,
        refusals_held=refusals_held,
        refused=_refusal(refusal_delay_s),
    )
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol under :attr:`guard`'s caps (bound by
    :func:`guarded_protocol`, one subclass per server)."""

    guard: ClassVar[_Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._address: str | None = None  # counted in per_address while open
        self._header_timer: asyncio.TimerHandle | None = None
        self._cycle_seen: object = None
        self._refusal_timer: asyncio.TimerHandle | None = None
        self._discard = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        g = self.guard
        address = self.client[0] if self.client else "?"
        if (
            len(self.connections) > g.max_connections
            or g.per_address[address] >= g.max_per_address
            or g.opened.take(address) > 0
        ):
            self._refuse(transport)
            return
        self._address = address
        g.per_address[address] += 1
        self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        g = self.guard
        if g.refusal_delay_s <= 0 or len(g.held) >= g.refusals_held:
            transport.write(g.refused)
            transport.close()
            return
        # What it sends meanwhile is read and dropped, up to a bound: unread bytes at the
        # close would make it a reset, and the client would lose the 503.
        self._discard = _DISCARD

        def answer() -> None:
            g.held.discard(timer)
            if not transport.is_closing():
                transport.write(g.refused)
                transport.close()

        timer = self.loop.call_later(g.refusal_delay_s, answer)
        g.held.add(timer)
        self._refusal_timer = timer

    def connection_lost(self, exc: Exception | None) -> None:
        g = self.guard
        if self._refusal_timer is not None:  # the client left before its answer
            self._refusal_timer.cancel()
            g.held.discard(self._refusal_timer)
            self._refusal_timer = None
        self._disarm()
        if self._address is not None:
            g.per_address[self._address] -= 1
            if g.per_address[self._address] <= 0:
                del g.per_address[self._address]
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal_timer is not None:
            self._discard -= len(data)
            if self._discard <= 0:
                self.transport.pause_reading()
            return
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._cycle_seen:
            self._cycle_seen = self.cycle  # a request's headers are complete
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.guard.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
