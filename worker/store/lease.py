"""Single-writer lease with a fencing token, in Redis.

One updater per probe holds ``{prefix}:{probe}:updater_lease``; its value is
``"<token>|<holder>"`` and expires after ``ttl_ms`` unless renewed. Tokens come
from a counter that only grows, so a holder that stalled past its TTL and lost
the lease carries an older token than the new holder; the registry's publish
script rejects any token that is not the current one (fencing).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from worker.store.redis import Breaker

__all__ = ["Lease", "LeaseKeeper"]

log = logging.getLogger(__name__)

# KEYS[1] lease, KEYS[2] token counter; ARGV[1] holder, ARGV[2] ttl ms.
# Returns the token held after the call, or false when someone else holds it.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local token, holder = string.match(cur, '^(%d+)|(.*)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return token
  end
  return false
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. '|' .. ARGV[1], 'PX', ARGV[2])
return tostring(token)
"""

# KEYS[1] lease; ARGV[1] the value we hold, ARGV[2] ttl ms. Extend only our own lease: a
# lease that expired is not taken again here (another holder may have come and gone).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] lease; ARGV[1] the value we hold. Delete only our own lease.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """A renewable, fenced lease (needs a Redis, so an example rather than a doctest)::

    lease = Lease(client, keys.updater_lease("tox"), holder="updater-a", ttl_ms=10_000)
    token = lease.acquire()  # None while another holder has it
    """

    def __init__(self, client: redis.Redis, key: str, holder: str, ttl_ms: int = 10_000) -> None:
        if "|" in holder:
            raise ValueError(f"lease holder {holder!r} must not contain '|'")
        # redis-py's return types are unions over decode_responses; ours is always bytes.
        self.client: Any = client
        self.key = key
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.token: str | None = None
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def acquire(self) -> str | None:
        """Take or renew the lease; the fencing token, or None if another holder has it."""
        result = self._acquire(
            keys=[self.key, f"{self.key}:token"], args=[self.holder, self.ttl_ms]
        )
        self.token = result.decode() if isinstance(result, bytes) else result
        return self.token

    def renew(self) -> bool:
        """Extend the lease held with :attr:`token`; False when it is no longer ours (it
        expired, whoever holds it now). Never takes it again with a new token."""
        if self.token is None:
            return False
        held = f"{self.token}|{self.holder}"
        return bool(self._renew(keys=[self.key], args=[held, self.ttl_ms]))

    def release(self) -> None:
        if self.token is not None:
            self._release(keys=[self.key], args=[f"{self.token}|{self.holder}"])
            self.token = None

    def current(self) -> tuple[str, str] | None:
        """``(token, holder)`` of whoever holds the lease now, or None."""
        raw = self.client.get(self.key)
        if raw is None:
            return None
        token, _, holder = raw.decode().partition("|")
        return token, holder


class LeaseKeeper:
    """Renews a held :class:`Lease` every ``ttl/3`` on its own thread, so a batch of any
    length keeps it. :attr:`lost` is set for good once the lease is no longer ours
    (renewal refused), or when it could not be renewed for a whole TTL (Redis
    unreachable: another holder may have taken over); ``on_lost`` runs then. Each renewal
    that fails or succeeds trips or resets ``breaker`` (the holder reports it on ``/readyz``).
    """

    def __init__(self, lease: Lease, on_lost: Any = None, breaker: Breaker | None = None) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self.breaker = breaker
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def holds(self) -> bool:
        """Renew now; whether the lease is still ours."""
        if not self.lost.is_set() and not self._renew_once():
            self._lose("renewal refused")
        return not self.lost.is_set()

    def mark_lost(self, why: str) -> None:
        """The lease is known not to be ours (e.g. a fenced write): lost for good, as
        when a renewal is refused; ``on_lost`` runs (once)."""
        self._lose(why)

    def _run(self) -> None:
        interval = self.lease.ttl_ms / 3000
        last_ok = time.monotonic()
        while not self._stop.wait(interval) and not self.lost.is_set():
            try:
                ok = self.lease.renew()
            except (redis.RedisError, OSError) as exc:
                if self.breaker is not None:
                    self.breaker.trip(exc)
                if time.monotonic() - last_ok > self.lease.ttl_ms / 1000:
                    self._lose(f"not renewed for a whole TTL ({exc})")
                continue
            if self.breaker is not None:
                self.breaker.reset()
            if not ok:
                self._lose("renewal refused: it expired or another holder has it")
            last_ok = time.monotonic()

    def _renew_once(self) -> bool:
        try:
            return self.lease.renew()
        except (redis.RedisError, OSError):
            return True  # unknown: the thread decides after a whole TTL; publish is fenced

    def _lose(self, why: str) -> None:
        if self.lost.is_set():
            return
        log.warning("lease %s lost: %s", self.lease.key, why)
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost()
