"""What the labels topic may teach a probe: each labeler's label for a message once, and at
most ``LABELER_MAX_LABELS`` labels per labeler and ``LABELER_WINDOW_S``.

Anyone who can produce to the labels topic (a misused reviewer credential, a buggy client)
could otherwise send one label ten thousand times, or a flood of labels, and dominate the
Lion steps, the replay buffer and the evidence. One Lua script per batch, in the text
cache's Redis, decides for every label, atomically across updaters (a standby taking
over sees the same markers):

- ``ok``: learn it. The first label of a labeler for a message, within the limit.
- ``duplicate``: that labeler labeled that message before (another record): dropped and
  counted.
- ``over``: past the labeler's limit in this window: quarantined (dead-lettered as
  ``quarantined``, naming the labeler) and counted.

The marker remembers the record (partition and offset) that was admitted, and its verdict:
a redelivered record (a crash before the version reflecting it was published) gets the
same verdict again and is learned again, rather than being taken for a duplicate of
itself; a script re-run by redis-py after a lost reply likewise counts nothing twice. A
duplicate does not count against the limit. Markers live as long as cached texts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import redis

from schemas import HumanLabel
from worker.errors import TransientError
from worker.kafka.records import Item
from worker.settings import Settings
from worker.store.redis import Keys, id_digest, keys_for

__all__ = ["LabelAdmission", "Verdict"]

Verdict = Literal["ok", "duplicate", "over"]

# KEYS: per label, its seen marker and its labeler's window counter
# ARGV: marker TTL, window TTL, limit (0 = none), then each label's position
_ADMIT = """
local out = {}
local limit = tonumber(ARGV[3])
for i = 1, #KEYS / 2 do
  local seen, count, pos = KEYS[2 * i - 1], KEYS[2 * i], ARGV[3 + i]
  local mark = redis.call('GET', seen)
  if mark then
    local was, verdict = string.match(mark, '^(.*)|(%a+)$')
    if was == pos then out[i] = verdict else out[i] = 'duplicate' end
  else
    local verdict = 'ok'
    if limit > 0 then
      local n = redis.call('INCR', count)
      if n == 1 then redis.call('EXPIRE', count, ARGV[2]) end
      if n > limit then verdict = 'over' end
    end
    redis.call('SET', seen, pos .. '|' .. verdict, 'EX', ARGV[1])
    out[i] = verdict
  end
end
return out
"""


class LabelAdmission:
    """Admits one probe's labels (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        keys: Keys,
        probe: str,
        *,
        max_labels: int,
        window_s: int,
        marker_ttl_s: int,
    ) -> None:
        self.client: Any = client
        self.keys = keys
        self.probe = probe
        self.max_labels = max_labels
        self.window_s = window_s
        self.marker_ttl_s = marker_ttl_s
        self._admit = client.register_script(_ADMIT)

    @classmethod
    def from_settings(cls, client: Any, settings: Settings, probe: str) -> LabelAdmission:
        """``client``: the text cache's (the markers are per message, like cached texts)."""
        return cls(
            client,
            keys_for(settings),
            probe,
            max_labels=settings.labeler_max_labels,
            window_s=settings.labeler_window_s,
            marker_ttl_s=settings.text_cache_ttl_s,
        )

    def admit(self, items: Sequence[Item[HumanLabel]]) -> list[Verdict]:
        """A verdict per item. Raises :class:`TransientError` when Redis cannot be reached
        (the batch is retried: nothing is learned unchecked)."""
        if not items:
            return []
        window = int(time.time()) // self.window_s
        keys: list[str] = []
        for item in items:
            label = item.value
            seen = id_digest(label.labeler_id, label.message_id)
            keys.append(self.keys.label_seen(self.probe, seen))
            keys.append(self.keys.labeler_count(self.probe, window, id_digest(label.labeler_id)))
        positions = [f"{i.partition}:{i.offset}" for i in items]
        try:
            raw = self._admit(
                keys=keys,
                args=[self.marker_ttl_s, self.window_s, self.max_labels, *positions],
            )
        except (redis.RedisError, OSError) as exc:
            raise TransientError(f"label gate unreachable: {exc}") from exc
        verdicts: list[Verdict] = []
        for v in raw:
            text = v.decode() if isinstance(v, bytes) else str(v)
            verdicts.append(text if text in ("ok", "duplicate", "over") else "over")  # type: ignore[arg-type]
        return verdicts
