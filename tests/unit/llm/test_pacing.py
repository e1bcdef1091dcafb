"""How a poll is cut into micro-batches (worker.scoring.pacing): by the latency target while
the queue is short, by the token budget on a backlog."""

from __future__ import annotations

import pytest

from worker.scoring.pacing import MicroBatchPlanner


def planner(target_s: float = 0.25, tokens: int | None = 100, size: int = 64) -> MicroBatchPlanner:
    return MicroBatchPlanner(latency_target_s=target_s, batch_tokens=tokens, batch_size=size)


def test_a_short_queue_is_cut_in_arrival_order_by_the_latency_target() -> None:
    p = planner(target_s=0.25)
    p.observe(tokens=100, seconds=0.5)  # 5 ms per token: 50 tokens per micro-batch
    assert p.plan([20, 20, 20, 45, 5, 60, 10], full=False) == [[0, 1], [2], [3, 4], [5], [6]]


def test_a_message_over_the_target_still_gets_a_micro_batch_of_its_own() -> None:
    p = planner(target_s=0.01)
    p.observe(tokens=10, seconds=1.0)
    assert p.plan([300, 2, 1], full=False) == [[0], [1], [2]]


def test_a_full_poll_is_cut_by_the_token_budget_oldest_first() -> None:
    p = planner(target_s=0.25, tokens=100)
    p.observe(tokens=100, seconds=0.5)
    # Sorted by length and cut at 100 padded tokens: [3], [1, 2], [0, 4, 5]; the group
    # holding the oldest message goes first.
    assert p.plan([10, 40, 40, 90, 10, 10], full=True) == [[0, 4, 5], [1, 2], [3]]


def test_until_a_batch_is_timed_a_short_queue_is_cut_by_the_token_budget() -> None:
    p = planner(target_s=0.25, tokens=100)
    assert p.seconds_per_token is None
    assert p.plan([10, 10, 10], full=False) == [[0, 1, 2]]


def test_target_zero_scores_the_poll_as_one_unit() -> None:
    p = planner(target_s=0.0)
    p.observe(tokens=1, seconds=10.0)
    assert p.plan([50, 50, 50], full=False) == [[0, 1, 2]]


def test_the_count_limit_holds_within_the_target() -> None:
    p = planner(target_s=10.0, size=2)
    p.observe(tokens=100, seconds=0.1)
    assert p.plan([1, 1, 1, 1, 1], full=False) == [[0, 1], [2, 3], [4]]


def test_the_cost_estimate_follows_recent_batches_without_jumping_on_one() -> None:
    p = planner()
    p.observe(tokens=100, seconds=1.0)  # 10 ms per token
    p.observe(tokens=100, seconds=11.0)  # one slow batch (110 ms per token)
    assert p.seconds_per_token == pytest.approx(0.03)  # moved a fifth of the way
    assert p.estimate_s(10) == pytest.approx(0.3)
    p.observe(tokens=0, seconds=1.0)  # nothing measured: ignored
    assert p.seconds_per_token == pytest.approx(0.03)


def test_token_counts_are_what_extraction_runs() -> None:
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.tiny import make_tiny_llm

    ex = HiddenStateExtractor(make_tiny_llm(), max_tokens=16, max_chunks=2)
    texts: list[str | bytes] = ["hello there", "word " * 40, b"\xff", "   "]
    counts = ex.token_counts(texts)
    assert counts[:2] == [len(ex.token_ids(texts[0])), len(ex.token_ids(texts[1]))]
    assert counts[1] == 32  # two chunks of max_tokens: the rest is truncated
    assert counts[2:] == [0, 0]  # not extractable: costs nothing
    out = ex.extract(texts, layers=[1])
    assert [int(n) for n in out.mask.sum(1)] == counts[:2]


def test_the_batching_is_chosen_by_device_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from worker.llm.plan import CUDA_BATCH_TOKENS, Batching
    from worker.settings import Settings

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    # The CPU keeps its length-sorted budgets (bench/batching.py).
    assert Batching.for_device(Settings(), cpu) == Batching(64, 4096, 0.5)
    # CUDA: one pass per call, whatever the lengths (a pass is launch-bound there), its
    # width padded up to a few sizes.
    buckets = (16, 32, 64, 128, 256)
    assert Batching.for_device(Settings(), cuda) == Batching(64, CUDA_BATCH_TOKENS, 0.0, buckets)
    monkeypatch.setenv("PROBEGUARD_BATCH_TOKENS", "2048")
    monkeypatch.setenv("PROBEGUARD_BATCH_MIN_FILL", "0.25")
    assert Batching.for_device(Settings(), cuda) == Batching(64, 2048, 0.25, buckets)  # kept


def test_the_extractor_takes_its_batching_from_the_settings_for_its_device() -> None:
    import torch

    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.plan import Batching
    from worker.llm.tiny import make_tiny_llm
    from worker.settings import Settings

    settings = Settings(batch_tokens=1024, batch_min_fill=0.3)
    ex = HiddenStateExtractor.for_llm(make_tiny_llm(), settings)
    assert ex.batching == Batching.for_device(settings, torch.device("cpu"))
    assert ex.batching == Batching(64, 1024, 0.3)
