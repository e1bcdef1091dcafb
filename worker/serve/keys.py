"""API keys and per-key rate limits of ``probeguard serve``.

A key is ``pg.<name>.<48 hex digits>``: 192 random bits. Only a hash of it is configured,
one ``name:sha256$salt$hash`` entry per key in ``PROBEGUARD_SERVE_API_KEYS``
(``probeguard serve key NAME`` prints a new key and its entry). A salted SHA-256 is enough
for a secret that no one chose: guessing one of 2**192 keys is out of reach at any hash
speed, which is why GitHub and Stripe check their tokens the same way. Slow hashes are for
passwords people pick (the console's are scrypt); on API keys they only made every wrong
key cost the server 16 MiB and ~0.1 s of CPU. Entries made before, ``name:scrypt$N$r$p$salt$hash``,
still verify, with scrypt (:mod:`worker.serve.auth` rations those checks).

The name inside the key says which entry to check, so a wrong key costs one check, not
one per entry; a string that is not a key at all, or names no entry, costs none. A key that
verified is kept (by its SHA-256) for as long as the server runs, apart from the keys that
failed, so later requests cost a dictionary lookup and no flood of wrong keys can push a
good one out; a key that failed is kept too (a bounded, least-recently-used set), so
retrying it costs nothing either. How unseen keys are rationed is :mod:`worker.serve.auth`'s
job.

Example::

    key, entry = new_key("chat-app")
    ring = KeyRing.parse(entry)
    ring.check(key)          # "chat-app"
    ring.check("pg.x.00")    # None
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from worker import scrypt
from worker.errors import ConfigError

__all__ = ["KeyRing", "RateLimiter", "Scheme", "Seen", "new_key"]

Scheme = Literal["sha256", "scrypt"]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")
_KEY = re.compile(r"pg\.([A-Za-z0-9][A-Za-z0-9_\-]{0,63})\.[0-9a-f]{48}")
_REFUSED = 4096  # refused keys remembered (by digest), least recently seen dropped first
_SHA256 = re.compile(r"sha256\$([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+)")


class Seen(enum.Enum):
    """What a key lookup found, before any scrypt."""

    VERIFIED = "verified"  # checked before and good: its name comes with it
    REFUSED = "refused"  # checked before and wrong
    MALFORMED = "malformed"  # not ``pg.NAME.<48 hex>``: wrong without a check
    UNSEEN = "unseen"  # well-formed, not checked yet


def new_key(name: str, scheme: Scheme = "sha256") -> tuple[str, str]:
    """A new random key for ``name`` and its settings entry (``name:sha256$...``; the
    ``scrypt`` scheme is how entries were made before, kept for tests of old entries)."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"an API key name must match {NAME.pattern}, not {name[:40]!r}")
    key = f"pg.{name}.{secrets.token_hex(24)}"
    hashed = scrypt.hash_secret(key) if scheme == "scrypt" else _sha256_hash(key)
    return key, f"{name}:{hashed}"


def _sha256_hash(key: str) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.sha256(salt + key.encode()).digest()
    return f"sha256${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _sha256_parts(hashed: str) -> tuple[bytes, bytes] | None:
    m = _SHA256.fullmatch(hashed)
    if m is None:
        return None
    try:
        salt, digest = (base64.b64decode(x, validate=True) for x in m.group(1, 2))
    except binascii.Error:
        return None
    return (salt, digest) if len(salt) >= 16 and len(digest) == 32 else None


def _invalid(hashed: str) -> str | None:
    """Why ``hashed`` is no usable entry hash (None: it is)."""
    if hashed.startswith("sha256$"):
        return None if _sha256_parts(hashed) else "not a sha256$salt$hash of a key"
    return scrypt.invalid(hashed)


def _sha256_matches(key: str, salt: bytes, want: bytes) -> bool:
    return hmac.compare_digest(hashlib.sha256(salt + key.encode()).digest(), want)


class KeyRing:
    """The configured keys: :meth:`check` a presented key, get its name."""

    def __init__(self, entries: dict[str, str]) -> None:
        self._hashes = entries  # name -> sha256 or scrypt hash
        # The SHA-256 entries' salt and digest, decoded once: name -> (salt, digest).
        self._sha256 = {n: p for n, h in entries.items() if (p := _sha256_parts(h)) is not None}
        # Any scrypt entry: checks are slow, and run rationed on threads (worker.serve.auth).
        self.slow = len(self._sha256) < len(entries)
        # Good keys: at most one per entry (a hash matches one key), so never evicted.
        self._verified: dict[bytes, str] = {}
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self.check_s: float | None = None  # how long a scrypt check takes (moving average)
        self.running = 0  # scrypt checks running now
        self.peak = 0  # the most that ever ran at once (`serve` caps it; tests read it)

    def __len__(self) -> int:
        return len(self._hashes)

    def __repr__(self) -> str:  # never a hash
        return f"KeyRing(names={sorted(self._hashes)})"

    @classmethod
    def parse(cls, raw: str | None) -> KeyRing:
        """``PROBEGUARD_SERVE_API_KEYS``; a malformed entry is a ConfigError naming its
        position and name, never its hash."""
        entries: dict[str, str] = {}
        for i, entry in enumerate(e.strip() for e in (raw or "").split(",")):
            if not entry:
                continue
            where = f"PROBEGUARD_SERVE_API_KEYS entry {i + 1}"
            name, sep, hashed = entry.partition(":")
            if not sep or not NAME.fullmatch(name):
                raise ConfigError(f"{where}: expected name:sha256$... (`probeguard serve key`)")
            why = _invalid(hashed)
            if why is not None:
                raise ConfigError(f"{where} ({name}): {why}; make one with `probeguard serve key`")
            if name in entries:
                raise ConfigError(f"{where}: key name {name!r} appears twice")
            entries[name] = hashed
        return cls(entries)

    def check(self, key: str) -> str | None:
        """The name of the entry ``key`` belongs to, or None (may run one hash check)."""
        seen, name = self.lookup(key)
        if seen is not Seen.UNSEEN:
            return name
        if self.names_an_entry(key):
            return self.verify(key)
        self.refuse(key)
        return None

    def lookup(self, key: str) -> tuple[Seen, str | None]:
        """What is known of ``key`` without a check, and its name when it verified."""
        if not _KEY.fullmatch(key):
            return Seen.MALFORMED, None
        digest = _digest(key)
        with self._lock:
            name = self._verified.get(digest)
            if name is not None:
                return Seen.VERIFIED, name
            if digest in self._refused:
                self._refused.move_to_end(digest)
                return Seen.REFUSED, None
        return Seen.UNSEEN, None

    def names_an_entry(self, key: str) -> bool:
        """Whether a well-formed ``key`` names a configured entry (only then is it worth a
        check; say so to no client: the time of the refusal must not tell)."""
        m = _KEY.fullmatch(key)
        return m is not None and m.group(1) in self._hashes

    def fast(self, key: str) -> bool:
        """Whether ``key``'s entry is a SHA-256 one (a check in microseconds)."""
        m = _KEY.fullmatch(key)
        return m is not None and m.group(1) in self._sha256

    def verify(self, key: str) -> str | None:
        """Check ``key`` against its entry (a scrypt one off the event loop) and remember
        the answer."""
        m = _KEY.fullmatch(key)
        hashed = self._hashes.get(m.group(1)) if m else None
        if m is None or hashed is None:
            self.refuse(key)
            return None
        if (parts := self._sha256.get(m.group(1))) is not None:
            good = _sha256_matches(key, *parts)
        else:
            with self._lock:
                self.running += 1
                self.peak = max(self.peak, self.running)
            t0 = time.perf_counter()
            try:
                good = scrypt.check(key, hashed)
            finally:
                with self._lock:
                    self.running -= 1
            self._timed(time.perf_counter() - t0)
        if not good:
            self.refuse(key)
            return None
        with self._lock:
            self._verified[_digest(key)] = m.group(1)
        return m.group(1)

    def refuse(self, key: str) -> None:
        """Remember ``key`` as wrong (the oldest refused key is forgotten past 4,096)."""
        with self._lock:
            self._refused[_digest(key)] = None
            self._refused.move_to_end(_digest(key))
            while len(self._refused) > _REFUSED:
                self._refused.popitem(last=False)

    def calibrate(self) -> float:
        """How long a scrypt check takes here (runs one on a throwaway key the first time:
        the time an unknown name's refusal waits so that it looks like a check)."""
        slow = [h for n, h in self._hashes.items() if n not in self._sha256]
        if self.check_s is None and slow:
            hashed = slow[0]
            t0 = time.perf_counter()
            scrypt.check("pg.calibration." + "0" * 48, hashed)
            self._timed(time.perf_counter() - t0)
        return self.check_s or 0.0

    def _timed(self, seconds: float) -> None:
        with self._lock:
            self.check_s = seconds if self.check_s is None else 0.8 * self.check_s + 0.2 * seconds


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode(errors="replace")).digest()


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class RateLimiter:
    """A token bucket per key: ``rate`` units a second, ``burst`` at once. At most
    ``max_keys`` buckets are kept (the least recently used go first; a bucket forgotten
    starts full again), so a limiter keyed by client address stays bounded."""

    rate: float
    burst: float
    max_keys: int = 100_000
    _buckets: OrderedDict[str, _Bucket] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, key: str, now: float | None = None, cost: float = 1.0) -> float:
        """0 if ``key`` may spend ``cost`` now (and spend it); else the seconds until it
        may (for ``Retry-After``). A cost over the burst is never granted: check it first."""
        now = time.monotonic() if now is None else now
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = _Bucket(float(self.burst), now)
                while len(self._buckets) > self.max_keys:
                    self._buckets.popitem(last=False)
            self._buckets.move_to_end(key)
            b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
            b.at = now
            if b.tokens >= cost:
                b.tokens -= cost
                return 0.0
            return (cost - b.tokens) / self.rate
