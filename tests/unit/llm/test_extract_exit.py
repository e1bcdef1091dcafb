"""The extractor's exit stage: rows decided at a shallow layer leave the forward pass; the
others continue in a smaller batch with the states a full pass gives them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from worker.errors import ExtractionError
from worker.llm.extract import ExitStage, Extraction, HiddenStateExtractor
from worker.llm.load import LoadedLLM
from worker.llm.tiny import NUM_LAYERS, make_tiny_gemma3, make_tiny_llm

TEXTS = ["hello", "a much longer text, with punctuation!", "mid size", "x", "another one here"]
ALL = list(range(NUM_LAYERS + 1))
SEEN: list[tuple[int, int]] = []  # (input position, tokens) of the rows the stage saw


def short_rows_exit(
    states: torch.Tensor, mask: torch.Tensor, positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exit the rows of fewer than 9 tokens; the payload sums their first 3 dims."""
    SEEN.extend(zip(positions, mask.sum(-1).tolist(), strict=True))
    return mask.sum(-1) < 9, (states[:, :, :3] * mask[..., None]).sum(1)


def same_rows(out: Extraction, full: Extraction, atol: float = 1e-5) -> None:
    for r, pos in enumerate(out.index):
        f = full.index.index(pos)
        torch.testing.assert_close(
            out.hidden[:, r][:, out.mask[r]], full.hidden[:, f][:, full.mask[f]], rtol=0, atol=atol
        )


@contextmanager
def real_block_calls(llm: LoadedLLM) -> Iterator[list[int]]:
    """Rows each block's own forward computed (a skipped block's pass-through is not one)."""
    rows = [0] * llm.num_layers
    originals = []
    for i, block in enumerate(llm.layer_stack):
        cls_forward = type(block).forward

        def counting(
            *args: object, _i: int = i, _f: object = cls_forward, _b: object = block, **kw: object
        ) -> object:
            states = args[0] if args else kw["hidden_states"]
            rows[_i] += int(states.shape[0])  # type: ignore[attr-defined]
            return _f(_b, *args, **kw)  # type: ignore[operator]

        originals.append(block)
        block.forward = counting
    try:
        yield rows
    finally:
        for block in originals:
            del block.forward


@pytest.mark.parametrize("scatter", [False, True])  # the CPU's row copies, accelerators' scatter
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", ["llama", "bert", "gemma3"])
def test_continuing_rows_get_the_full_pass_states_and_exited_rows_their_payload(
    arch: str, side: str, scatter: bool
) -> None:
    llm = make_tiny_gemma3() if arch == "gemma3" else make_tiny_llm(arch=arch)  # type: ignore[arg-type]
    llm.tokenizer.padding_side = side
    ex = HiddenStateExtractor(llm, max_tokens=64, batch_size=3, scatter=scatter)
    full = ex.extract(TEXTS, layers=ALL)
    SEEN.clear()
    out = ex.extract_staged(TEXTS, [1, 2, 4], ExitStage(2, short_rows_exit))
    assert sorted(pos for pos, _ in SEEN) == list(range(len(TEXTS)))
    assert len({n - len(TEXTS[pos]) for pos, n in SEEN}) == 1  # the positions are the rows'

    assert out.exit_layer == 2
    assert out.index == [1, 2, 4] and sorted(out.exited) == [0, 3]
    assert out.hidden.shape[:2] == (3, 3)
    same_rows(out, Extraction(full.hidden[[1, 2, 4]], full.mask, (1, 2, 4), full.index))
    for pos in (0, 3):
        states = full.layer(2)[pos][full.mask[pos]]  # [n, D]
        torch.testing.assert_close(out.exited[pos], states[:, :3].sum(0), rtol=0, atol=1e-5)


def test_exited_rows_skip_the_blocks_above_the_exit_layer() -> None:
    llm = make_tiny_llm()
    ex = HiddenStateExtractor(llm, max_tokens=64, batch_size=8)
    with real_block_calls(llm) as rows:
        ex.extract_staged(TEXTS, [4], ExitStage(1, short_rows_exit))
    # All 5 rows run block 1; the 3 that continue run blocks 2..4 (once: no block repeats).
    assert rows == [5, 3, 3, 3]


def test_nobody_exits_equals_plain_extraction_and_everybody_exits_leaves_no_rows() -> None:
    llm = make_tiny_llm()
    ex = HiddenStateExtractor(llm, max_tokens=64, batch_size=2)
    plain = ex.extract(TEXTS, layers=[1, 3])

    def nobody(
        states: torch.Tensor, mask: torch.Tensor, _: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(states), dtype=torch.bool), torch.zeros(len(states))

    def everybody(
        states: torch.Tensor, mask: torch.Tensor, _: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(len(states), dtype=torch.bool), torch.arange(len(states))

    same = ex.extract_staged(TEXTS, [1, 3], ExitStage(2, nobody))
    assert same.index == plain.index and not same.exited
    torch.testing.assert_close(same.hidden, plain.hidden, rtol=0, atol=1e-6)
    gone = ex.extract_staged(TEXTS, [1, 3], ExitStage(2, everybody))
    assert gone.index == [] and sorted(gone.exited) == list(range(len(TEXTS)))
    assert gone.hidden.shape[1] == 0


def test_a_failing_exit_head_runs_everything_to_full_depth() -> None:
    llm = make_tiny_llm()
    ex = HiddenStateExtractor(llm, max_tokens=64)

    def broken(
        states: torch.Tensor, mask: torch.Tensor, _: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("bad exit head")

    out = ex.extract_staged(TEXTS, [3], ExitStage(1, broken))
    assert out.index == list(range(len(TEXTS))) and not out.exited and not out.errors


def test_chunked_texts_never_exit_and_failures_are_not_exits() -> None:
    llm = make_tiny_llm()
    poison = int(llm.tokenizer.convert_tokens_to_ids("#"))  # type: ignore[arg-type]

    def explode_on_poison(_module: object, _args: object, kw: dict[str, torch.Tensor]) -> None:
        if kw["input_ids"].eq(poison).any():
            raise RuntimeError("simulated failure")

    ex = HiddenStateExtractor(llm, max_tokens=6, max_chunks=3, batch_size=8)
    texts = ["hi", "a long text cut in chunks", "bad #"]
    handle = llm.model.register_forward_pre_hook(explode_on_poison, with_kwargs=True)
    try:
        out = ex.extract_staged(texts, [3], ExitStage(1, short_rows_exit))
    finally:
        handle.remove()
    assert sorted(out.exited) == [0]  # every piece is short, but the chunked text continues
    assert out.index == [1] and list(out.errors) == [2]


def test_exit_stage_at_or_above_the_deepest_layer_is_ignored_and_bad_layers_raise() -> None:
    llm = make_tiny_llm()
    ex = HiddenStateExtractor(llm, max_tokens=64)
    out = ex.extract_staged(TEXTS, [1, 2], ExitStage(2, short_rows_exit))
    assert out.exit_layer is None and not out.exited and len(out.index) == len(TEXTS)
    for bad in (0, NUM_LAYERS):
        with pytest.raises(ExtractionError, match="exit layer"):
            ex.extract_staged(TEXTS, [NUM_LAYERS], ExitStage(bad, short_rows_exit))
