"""Review claims in Redis: one reviewer per item at a time, with a timeout.

``{prefix}:review:claim:{probe}:{message_id}`` holds the reviewer's name and expires
after the claim TTL unless renewed (the review page renews it while it is open). Once the
item's label is acknowledged by the broker the key holds ``done|<reviewer>`` for the text
cache's TTL, so a redelivered review request (a restart before the offset commit) is
recognised and not asked again. ``{prefix}:review:answers`` records who answered what
when, for the per-reviewer rate.
"""

from __future__ import annotations

import time
from typing import Any

from worker.store.redis import Keys

__all__ = ["ClaimStore"]

DONE = "done|"
SEP = "\x1f"  # between reviewer and item in the answers set (neither may contain it)

# KEYS[1] claim; ARGV[1] reviewer, ARGV[2] ttl ms. Claim if free, renew if ours.
# Returns the holder after the call ('done|...' when the item is finished).
_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
if cur == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return cur
"""

# KEYS[1] claim; ARGV[1] reviewer. Delete only our own claim.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class ClaimStore:
    def __init__(self, client: Any, keys: Keys, *, ttl_s: float, done_ttl_s: int) -> None:
        self.client: Any = client
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)
        self.done_ttl_s = done_ttl_s
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)

    def claim(self, item: str, reviewer: str, *, ttl_s: float | None = None) -> str | None:
        """Claim (or renew) ``item`` for ``reviewer``; returns who holds it now
        (``reviewer`` on success, another name, or ``done|...``)."""
        ttl = self.ttl_ms if ttl_s is None else int(ttl_s * 1000)
        holder = self._claim(keys=[self.keys.review_claim(item)], args=[reviewer, ttl])
        return None if holder is None else _text(holder)

    def holder(self, item: str) -> str | None:
        raw = self.client.get(self.keys.review_claim(item))
        return None if raw is None else _text(raw)

    def holders(self, items: list[str]) -> list[str | None]:
        if not items:
            return []
        raw = self.client.mget([self.keys.review_claim(i) for i in items])
        return [None if r is None else _text(r) for r in raw]

    def release(self, item: str, reviewer: str) -> None:
        self._release(keys=[self.keys.review_claim(item)], args=[reviewer])

    def finish(self, item: str, reviewer: str) -> None:
        """The item's label was acknowledged: mark it done and count the answer."""
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.review_claim(item), DONE + reviewer, ex=self.done_ttl_s)
        pipe.zadd(self.keys.review_answers(), {f"{reviewer}{SEP}{item}": now})
        pipe.zremrangebyscore(self.keys.review_answers(), 0, now - 3600)
        pipe.execute()

    def rates(self, window_s: float = 600.0) -> dict[str, int]:
        """Answers per reviewer in the last ``window_s`` seconds."""
        now = time.time()
        members = self.client.zrangebyscore(self.keys.review_answers(), now - window_s, now)
        counts: dict[str, int] = {}
        for m in members:
            who = _text(m).split(SEP, 1)[0]
            counts[who] = counts.get(who, 0) + 1
        return counts


def is_done(holder: str | None) -> bool:
    return holder is not None and holder.startswith(DONE)


def _text(raw: bytes | str) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
