"""How a poll is cut into micro-batches, each scored and its verdicts sent before the next.

A poll is not one unit of work: verdicts leave per micro-batch (see
:class:`~worker.kafka.batch_loop.BatchLoop`'s ``split``), so a message waits for the
messages ahead of it, never for the ones behind it in the same poll. How big a micro-batch
is depends on the queue (Triton's ``max_queue_delay`` idea, with a token budget):

- **short queue** (the poll came back before it filled): micro-batches in arrival order,
  each expected to take at most ``latency_target_s`` (estimated from the tokens it holds
  and the seconds per token measured on recent batches), so the first messages of a poll
  do not wait for the last;
- **long queue** (a full poll: a backlog): the poll sorted by length and cut at the token
  budget, as the extractor would cut one big call (least padding, most messages per
  second); oldest micro-batch first. Latency is the queue's then, not the batch's.

Until the first batch has been timed, a poll is cut by the token budget alone.

    planner = MicroBatchPlanner(latency_target_s=0.25, batch_tokens=4096, batch_size=64)
    planner.observe(tokens=1200, seconds=0.9)  # a scored micro-batch
    planner.plan([40, 12, 300, 25], full=False)  # -> [[0], [1], [2], [3]] at 0.75 ms/token
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.llm.plan import length_batches

__all__ = ["MicroBatchPlanner"]

# Weight of the newest measurement in the seconds-per-token average: recent batches (a
# probe swap, a busier machine) count, one slow batch (a page fault, a GC) does not decide.
EWMA_WEIGHT = 0.2


class MicroBatchPlanner:
    """Cuts a poll's messages (their token counts) into micro-batches."""

    def __init__(
        self,
        *,
        latency_target_s: float,
        batch_tokens: int | None,
        batch_size: int,
        min_fill: float = 0.0,
    ) -> None:
        """``latency_target_s``: the longest a short queue's micro-batch should take
        (``0``: no cutting, a poll is one micro-batch); ``batch_tokens`` / ``batch_size`` /
        ``min_fill``: the extractor's budget, which cuts a long queue."""
        self.latency_target_s = latency_target_s
        self.batch_tokens = batch_tokens
        self.batch_size = batch_size
        self.min_fill = min_fill
        self.seconds_per_token: float | None = None  # measured; None until a batch is timed

    def observe(self, tokens: int, seconds: float) -> None:
        """A micro-batch of ``tokens`` real tokens took ``seconds`` to score."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + EWMA_WEIGHT * (rate - old)

    def estimate_s(self, tokens: int) -> float | None:
        """Expected seconds to score ``tokens`` (None until measured)."""
        return None if self.seconds_per_token is None else tokens * self.seconds_per_token

    def plan(self, tokens: Sequence[int], *, full: bool) -> list[list[int]]:
        """Indices of ``tokens`` (one count per message, in arrival order) grouped into
        micro-batches, in the order to score them. ``full``: the poll filled up (a long
        queue)."""
        n = len(tokens)
        if n == 0:
            return []
        if self.latency_target_s <= 0:
            return [list(range(n))]
        if full or self.seconds_per_token is None:
            groups = length_batches(tokens, self.batch_tokens, self.batch_size, self.min_fill)
            return sorted((sorted(g) for g in groups), key=lambda g: g[0])
        budget = self.latency_target_s / self.seconds_per_token  # tokens per micro-batch
        out: list[list[int]] = []
        current: list[int] = []
        spent = 0
        for i, count in enumerate(tokens):
            cost = max(1, count)
            if current and (spent + cost > budget or len(current) >= self.batch_size):
                out.append(current)
                current, spent = [], 0
            current.append(i)
            spent += cost
        out.append(current)
        return out
