"""API keys and per-key rate limits of ``probeguard serve``.

A key is ``pg.<name>.<48 hex digits>``; only its scrypt hash is configured, one
``name:scrypt$N$r$p$salt$hash`` entry per key in ``PROBEGUARD_SERVE_API_KEYS``
(``probeguard serve key NAME`` prints a new key and its entry). The name inside the key
says which entry to check, so a wrong key costs one scrypt, not one per entry; a key that
verified is remembered (by its SHA-256) so later requests cost a dictionary lookup, and so
is one that failed, so retrying a wrong key costs nothing either.

Example::

    key, entry = new_key("chat-app")
    ring = KeyRing.parse(entry)
    ring.check(key)          # "chat-app"
    ring.check("pg.x.00")    # None
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from worker import scrypt
from worker.errors import ConfigError

__all__ = ["KeyRing", "RateLimiter", "new_key"]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")
_KEY = re.compile(r"pg\.([A-Za-z0-9][A-Za-z0-9_\-]{0,63})\.[0-9a-f]{48}")
_REMEMBERED = 4096  # verified and refused keys kept (by digest)


def new_key(name: str) -> tuple[str, str]:
    """A new random key for ``name`` and its settings entry (``name:scrypt$...``)."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"an API key name must match {NAME.pattern}, not {name[:40]!r}")
    key = f"pg.{name}.{secrets.token_hex(24)}"
    return key, f"{name}:{scrypt.hash_secret(key)}"


class KeyRing:
    """The configured keys: :meth:`check` a presented key, get its name."""

    def __init__(self, entries: dict[str, str]) -> None:
        self._hashes = entries  # name -> scrypt hash
        self._known: OrderedDict[bytes, str | None] = OrderedDict()
        self._lock = threading.Lock()

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
                raise ConfigError(f"{where}: expected name:scrypt$... (`probeguard serve key`)")
            why = scrypt.invalid(hashed)
            if why is not None:
                raise ConfigError(f"{where} ({name}): {why}; make one with `probeguard serve key`")
            if name in entries:
                raise ConfigError(f"{where}: key name {name!r} appears twice")
            entries[name] = hashed
        return cls(entries)

    def check(self, key: str) -> str | None:
        """The name of the entry ``key`` belongs to, or None."""
        known, name = self.lookup(key)
        return name if known else self.verify(key)

    def lookup(self, key: str) -> tuple[bool, str | None]:
        """``(True, name or None)`` for a key checked before; ``(False, None)`` for one that
        needs :meth:`verify` (one scrypt: run it off the event loop)."""
        digest = _digest(key)
        with self._lock:
            if digest in self._known:
                self._known.move_to_end(digest)
                return True, self._known[digest]
        return False, None

    def verify(self, key: str) -> str | None:
        """Check ``key`` against its entry (one scrypt) and remember the answer."""
        m = _KEY.fullmatch(key)
        hashed = self._hashes.get(m.group(1)) if m else None
        name = m.group(1) if m and hashed and scrypt.check(key, hashed) else None
        with self._lock:
            self._known[_digest(key)] = name
            while len(self._known) > _REMEMBERED:
                self._known.popitem(last=False)
        return name


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode(errors="replace")).digest()


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class RateLimiter:
    """A token bucket per key: ``rate`` requests a second, ``burst`` at once."""

    rate: float
    burst: int
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, key: str, now: float | None = None) -> float:
        """0 if ``key`` may send a request now (and count it); else the seconds until it
        may (for ``Retry-After``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = _Bucket(float(self.burst), now)
            b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
            b.at = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                return 0.0
            return (1.0 - b.tokens) / self.rate
