"""Who is calling ``probeguard serve``: a :class:`Caller` from the request's API key, with
unauthenticated traffic kept from hurting authenticated traffic.

- A key checked before (verified or refused) costs a dictionary lookup.
- A string that is not a key (``pg.NAME.<48 hex>``) is refused at once, without scrypt.
- An unseen well-formed key is rationed per client address
  (``PROBEGUARD_SERVE_NEW_KEYS_PER_ADDRESS`` a second, ``_NEW_KEYS_BURST`` at once; an
  IPv6 address counts by its /64), so one address's junk cannot spend another's.
- An unseen key whose name no entry has is refused without scrypt, after as long as a
  scrypt check takes here, so response times do not tell which names exist.
- A key's entry is a salted SHA-256 (:mod:`worker.serve.keys`): checked on the event
  loop in microseconds, so a flood of wrong keys on a real name costs about what junk does.
- Entries made before are scrypt (16 MiB, ~0.1 s each): while any is configured, checks
  run on at most ``SCRYPT_THREADS`` threads, at a lower CPU priority than the scoring
  (:mod:`worker.serve.niced`); at most ``SCRYPT_QUEUE`` more unseen keys wait for them, and
  the rest get a 503 with ``Retry-After``, so such a flood costs bounded memory and CPU.
  Every refusal of an unseen key then answers after as long as a scrypt check takes, a
  SHA-256 entry's included, so the time does not tell which names exist or how. A check
  waits at most ``PROBEGUARD_SERVE_TIMEOUT_S`` (the scrypt threads get no CPU while other
  processes keep every core busy), then the request is a 503 with ``Retry-After`` and the
  key is neither refused nor verified.

Identities come from here only: the key's name (or, without keys, the client address),
never from anything the client writes in its body.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request

from worker.serve.errors import ApiError
from worker.serve.keys import KeyRing, RateLimiter, Seen
from worker.serve.niced import NicedThreads, Rationed

__all__ = ["SCRYPT_QUEUE", "SCRYPT_THREADS", "Authenticator", "Caller", "client_address"]

SCRYPT_THREADS = 2
SCRYPT_QUEUE = 32
T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its key's name (None without keys) and its address."""

    name: str | None
    address: str

    @property
    def limit_key(self) -> str:
        """Whose rate limits this request draws from."""
        return f"key:{self.name}" if self.name is not None else f"addr:{self.address}"


def client_address(request: Request) -> str:
    """The client's address as rate limits count it: an IPv6 address by its /64 (one
    host usually holds a whole /64)."""
    host = request.client.host if request.client else "?"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Authenticator:
    """Turns a request's key into a :class:`Caller`, or refuses it."""

    def __init__(
        self,
        keys: KeyRing | None,
        new_keys: RateLimiter,
        collector: CollectorRegistry,
        timeout_s: float = 30.0,
    ) -> None:
        self.keys = keys
        self.new_keys = new_keys  # unseen keys per client address
        self._scrypt = NicedThreads(SCRYPT_THREADS, "serve-scrypt")
        # Unseen keys waiting for, or in, a scrypt thread; timeout_s: the longest one waits.
        self._places = Rationed(
            SCRYPT_THREADS + SCRYPT_QUEUE,
            timeout_s,
            what="the API key",
            busy="too many new API keys being checked",
        )
        self.checks = Counter(
            "probeguard_serve_key_checks",
            "API keys presented, by what their check found (verified, refused: from memory; "
            "malformed; unknown_name; sha256_ok, sha256_wrong, scrypt_ok, scrypt_wrong; "
            "limited: too many unseen keys from the address; busy: too many waiting for "
            "scrypt; timeout: not checked within PROBEGUARD_SERVE_TIMEOUT_S)",
            ["result"],
            registry=collector,
        )

    async def caller(self, request: Request, key: str, refuse: Callable[[str], ApiError]) -> Caller:
        """The caller ``key`` authenticates; ``refuse(code)`` builds the dialect's refusal
        of a missing or wrong key."""
        address = client_address(request)
        if self.keys is None:
            return Caller(None, address)
        if not key:
            raise refuse("missing_api_key")
        seen, name = self.keys.lookup(key)
        if seen is Seen.VERIFIED and name is not None:
            self.checks.labels("verified").inc()
            return Caller(name, address)
        if seen is not Seen.UNSEEN:
            self.checks.labels(seen.value).inc()
            raise refuse("invalid_api_key")
        wait = self.new_keys.take(address)
        if wait > 0:
            self.checks.labels("limited").inc()
            raise ApiError(
                429,
                "too many new API keys from this address (PROBEGUARD_SERVE_NEW_KEYS_PER_ADDRESS)",
                code="rate_limit_exceeded",
                retry_after_s=wait,
            )
        name = await self._check(key)
        if name is None:
            raise refuse("invalid_api_key")
        return Caller(name, address)

    async def _check(self, key: str) -> str | None:
        assert self.keys is not None
        ring = self.keys
        if not ring.slow:  # SHA-256 entries only: microseconds, on the loop
            return self._checked(key, ring.check(key))
        try:
            if not ring.names_an_entry(key) or ring.fast(key):
                # No scrypt (nor a place in its queue), but as late as one would answer
                # now, queue included, and as busy: a refusal must not tell which names exist.
                self._places.take(hold=False)
                check_s = ring.check_s
                if check_s is None:
                    check_s = await self._niced(ring.calibrate)
                name = ring.check(key)
                await anyio.sleep(check_s * (1 + self._places.taken // SCRYPT_THREADS))
                return self._checked(key, name)
            name = await self._niced(ring.verify, key)
        except ApiError as exc:  # busy, or not checked in time
            self.checks.labels(exc.code or "busy").inc()
            raise
        self.checks.labels("scrypt_ok" if name else "scrypt_wrong").inc()
        return name

    async def _niced(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a scrypt thread, in a place (:class:`Rationed`)."""
        return await self._places.run(lambda: self._scrypt.submit(fn, *args))

    def _checked(self, key: str, name: str | None) -> str | None:
        """Count a check that ran no scrypt; ``name``: what it found."""
        assert self.keys is not None
        if name is not None:
            result = "sha256_ok"
        else:
            result = "sha256_wrong" if self.keys.names_an_entry(key) else "unknown_name"
        self.checks.labels(result).inc()
        return name

    def close(self) -> None:
        """Stop the scrypt threads (checks still queued are dropped)."""
        self._scrypt.close()
