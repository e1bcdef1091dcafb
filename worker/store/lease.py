"""Single-writer lease with a fencing token, in Redis.

One updater per probe holds ``{prefix}:{probe}:updater_lease``; its value is
``"<token>|<holder>"`` and expires after ``ttl_ms`` unless renewed. Tokens come
from a counter that only grows, so a holder that stalled past its TTL and lost
the lease carries an older token than the new holder; the registry's publish
script rejects any token that is not the current one (fencing).
"""

from __future__ import annotations

from typing import Any

import redis

__all__ = ["Lease"]

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
        self._release = client.register_script(_RELEASE)

    def acquire(self) -> str | None:
        """Take or renew the lease; the fencing token, or None if another holder has it."""
        result = self._acquire(
            keys=[self.key, f"{self.key}:token"], args=[self.holder, self.ttl_ms]
        )
        self.token = result.decode() if isinstance(result, bytes) else result
        return self.token

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
