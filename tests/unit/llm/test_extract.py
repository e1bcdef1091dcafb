"""HiddenStateExtractor on tiny random models: shapes, masks, layer indexing, early exit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from worker.errors import DeviceError, ExtractionError
from worker.llm.extract import Extraction, HiddenStateExtractor
from worker.llm.load import LoadedLLM
from worker.llm.tiny import HIDDEN_SIZE, NUM_LAYERS, make_tiny_llm

ALL = list(range(NUM_LAYERS + 1))
TEXTS = ["hello", "a much longer text, with punctuation!", "mid size", "x"]
ARCHS = ["llama", "bert"]
# Special tokens per text: <s> for the tiny Llama, [CLS] [SEP] for the tiny BERT.
SPECIALS = {"llama": 1, "bert": 2}


def extractor(llm: LoadedLLM, **kwargs: object) -> HiddenStateExtractor:
    kwargs.setdefault("max_tokens", 64)
    return HiddenStateExtractor(llm, **kwargs)  # type: ignore[arg-type]


def full_pass(llm: LoadedLLM, text: str) -> tuple[torch.Tensor, ...]:
    """transformers' own hidden states for one unpadded text: the reference."""
    enc = llm.tokenizer([text], return_tensors="pt")
    with torch.inference_mode():
        return llm.model(**enc, output_hidden_states=True).hidden_states


def real_tokens(out: Extraction, row: int) -> torch.Tensor:
    """[L_sel, n, D]: the row's states at its real tokens."""
    return out.hidden[:, row][:, out.mask[row]]


@contextmanager
def count_block_calls(llm: LoadedLLM) -> Iterator[list[int]]:
    calls = [0] * llm.num_layers

    def counter(i: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            calls[i] += 1

        return hook

    handles = [block.register_forward_hook(counter(i)) for i, block in enumerate(llm.layer_stack)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_shapes_mask_and_index(arch: str) -> None:
    llm = make_tiny_llm(arch=arch)  # type: ignore[arg-type]
    out = extractor(llm).extract(TEXTS, layers=[4, 0, 2])
    lengths = [len(t) + SPECIALS[arch] for t in TEXTS]
    assert out.layers == (4, 0, 2)
    assert out.hidden.shape == (3, len(TEXTS), max(lengths), HIDDEN_SIZE)
    assert out.mask.dtype == torch.bool
    assert out.mask.sum(1).tolist() == lengths
    assert out.index == [0, 1, 2, 3] and out.errors == {}
    # Padding is zero, real tokens are not.
    assert torch.all(out.hidden[:, ~out.mask] == 0)
    assert torch.all(out.hidden[:, out.mask].abs().sum(-1) > 0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_side_masks_and_states(arch: str, side: str) -> None:
    llm = make_tiny_llm(arch=arch, padding_side=side)  # type: ignore[arg-type]
    ex = extractor(llm)
    batch = ex.extract(TEXTS, layers=ALL)
    T = batch.mask.shape[1]
    for row, text in enumerate(TEXTS):
        n = len(text) + SPECIALS[arch]
        expected = torch.zeros(T, dtype=torch.bool)
        if side == "right":
            expected[:n] = True
        else:
            expected[T - n :] = True
        assert torch.equal(batch.mask[row], expected)
        # A text's states do not depend on its batch mates or where the padding goes.
        alone = ex.extract([text], layers=ALL)
        torch.testing.assert_close(real_tokens(batch, row), alone.hidden[:, 0])


def test_layer_indexing_matches_transformers(arch: str) -> None:
    """0 = embeddings, i = block i, num_layers = last_hidden_state (final norm applied)."""
    llm = make_tiny_llm(arch=arch)  # type: ignore[arg-type]
    text = "layer indexing"
    reference = full_pass(llm, text)
    assert len(reference) == NUM_LAYERS + 1
    out = extractor(llm).extract([text], layers=ALL)
    for i in ALL:
        torch.testing.assert_close(out.layer(i)[0], reference[i][0], rtol=0, atol=1e-6)


def test_top_layer_has_final_norm_applied() -> None:
    llm = make_tiny_llm(arch="llama")
    out = extractor(llm).extract(["norm check"], layers=[NUM_LAYERS])
    block_out: list[torch.Tensor] = []
    handle = llm.layer_stack[-1].register_forward_hook(lambda _m, _a, o: block_out.append(o))
    try:
        with torch.inference_mode():
            llm.model(**llm.tokenizer(["norm check"], return_tensors="pt"))
    finally:
        handle.remove()
    normed = llm.model.get_submodule("norm")(block_out[0])
    torch.testing.assert_close(out.layer(NUM_LAYERS), normed)
    assert not torch.allclose(out.layer(NUM_LAYERS), block_out[0])


@pytest.mark.parametrize("layers", [[0], [1], [2], [0, 2], [2, 1], [3]])
def test_early_exit_equals_full_pass_and_skips_upper_blocks(arch: str, layers: list[int]) -> None:
    llm = make_tiny_llm(arch=arch)  # type: ignore[arg-type]
    ex = extractor(llm, batch_size=2)
    full = ex.extract(TEXTS, layers=ALL)
    with count_block_calls(llm) as calls:
        early = ex.extract(TEXTS, layers=layers)
    deepest = max(layers)
    micro_batches = 2  # 4 texts, batch_size 2
    assert calls == [micro_batches] * deepest + [0] * (NUM_LAYERS - deepest)
    assert torch.equal(early.mask, full.mask)
    for slot, layer in enumerate(layers):
        torch.testing.assert_close(early.hidden[slot], full.layer(layer), rtol=0, atol=1e-6)


def test_full_depth_runs_every_block_once_per_micro_batch() -> None:
    llm = make_tiny_llm()
    with count_block_calls(llm) as calls:
        extractor(llm, batch_size=3).extract(TEXTS, layers=[NUM_LAYERS])
    assert calls == [2] * NUM_LAYERS


def test_length_bucketing_sorts_micro_batches() -> None:
    llm = make_tiny_llm()
    texts = ["a" * 2, "b" * 30, "c" * 5, "d" * 28, "e" * 1]
    widths: list[tuple[int, int]] = []
    handle = llm.layer_stack[0].register_forward_pre_hook(
        lambda _m, args: widths.append(tuple(args[0].shape[:2]))
    )
    try:
        bucketed = extractor(llm, batch_size=2).extract(texts, layers=[2])
    finally:
        handle.remove()
    # Sorted longest first: (30, 28), (5, 2), (1,); +1 for <s>.
    assert widths == [(2, 31), (2, 6), (1, 2)]
    one_batch = extractor(llm, batch_size=16).extract(texts, layers=[2])
    torch.testing.assert_close(bucketed.hidden, one_batch.hidden)
    assert bucketed.index == [0, 1, 2, 3, 4]


def test_token_budget_cuts_micro_batches_and_results_do_not_depend_on_it() -> None:
    llm = make_tiny_llm()
    texts = ["b" * 30, "a" * 2, "c" * 5, "d" * 28, "e" * 1, "f" * 3, "g" * 4]
    widths: list[tuple[int, int]] = []
    handle = llm.layer_stack[0].register_forward_pre_hook(
        lambda _m, args: widths.append(tuple(args[0].shape[:2]))
    )
    try:
        budgeted = extractor(llm, batch_size=16, batch_tokens=24).extract(texts, layers=[1, 3])
    finally:
        handle.remove()
    # Longest first, +1 for <s>: 31 alone (over budget on its own), 29 alone, then
    # 6, 5, 4, 3 (4 x 6 = 24 fits), then 2 alone as 5 x 6 > 24 started a new micro-batch.
    assert widths == [(1, 31), (1, 29), (4, 6), (1, 2)]
    assert sum(b * t for b, t in widths) < 7 * 31  # the padded tokens one batch would run
    one_batch = extractor(llm, batch_size=16).extract(texts, layers=[1, 3])
    one_by_one = extractor(llm, batch_size=1).extract(texts, layers=[1, 3])
    torch.testing.assert_close(budgeted.hidden, one_batch.hidden)
    torch.testing.assert_close(budgeted.hidden, one_by_one.hidden)
    torch.testing.assert_close(budgeted.mask, one_batch.mask)
    assert budgeted.index == list(range(7))


def test_truncation_head_and_head_tail() -> None:
    llm = make_tiny_llm()
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    head = extractor(llm, max_tokens=10).extract([text], layers=ALL)
    assert head.mask.sum().item() == 10  # <s> + 9 characters
    expected = extractor(llm).extract([text[:9]], layers=ALL)
    torch.testing.assert_close(head.hidden, expected.hidden)

    head_tail = extractor(llm, max_tokens=10, truncation="head_tail").extract([text], layers=ALL)
    assert head_tail.mask.sum().item() == 10
    expected = extractor(llm).extract([text[:5] + text[-4:]], layers=ALL)
    torch.testing.assert_close(head_tail.hidden, expected.hidden)


@pytest.mark.parametrize("side", ["right", "left"])
def test_chunked_long_text_concatenates_chunks(side: str) -> None:
    llm = make_tiny_llm(padding_side=side)  # type: ignore[arg-type]
    ex = extractor(llm, max_tokens=10, max_chunks=3, batch_size=2)
    text = "".join(chr(ord("a") + i % 26) for i in range(20))  # 20 > 9 content tokens
    out = ex.extract(["short", text], layers=[0, 3])
    # 20 characters -> chunks of 7, 7, 6, each with its own <s>.
    chunks = [text[:7], text[7:14], text[14:]]
    assert out.mask[1].sum().item() == 20 + 3
    assert out.mask[0].sum().item() == len("short") + 1
    pieces = [extractor(llm).extract([c], layers=[0, 3]).hidden[:, 0] for c in chunks]
    torch.testing.assert_close(real_tokens(out, 1), torch.cat(pieces, dim=1))


def test_chunking_caps_chunks_then_truncates() -> None:
    llm = make_tiny_llm()
    ex = extractor(llm, max_tokens=10, max_chunks=2)
    text = "".join(chr(ord("a") + i % 26) for i in range(50))
    out = ex.extract([text], layers=[1])
    assert out.mask.sum().item() == 2 * 10  # two full chunks; characters 18.. dropped
    first, second = (extractor(llm).extract([c], layers=[1]) for c in (text[:9], text[9:18]))
    expected = torch.cat([first.hidden[0, 0], second.hidden[0, 0]])  # [20, D]
    torch.testing.assert_close(out.hidden[0, 0], expected)


def test_bad_items_are_reported_and_do_not_affect_the_batch() -> None:
    llm = make_tiny_llm()
    ex = extractor(llm, batch_size=4)
    texts: list[object] = [
        "good one",
        "",
        "   \n\t ",
        b"\xff\xfe broken",
        "lone \ud800 surrogate",
        None,
        42,
        "\x00\x01\x02",
        b"valid utf-8 bytes",
        "another good one",
    ]
    out = ex.extract(texts, layers=[0, 2])  # type: ignore[arg-type]
    assert out.index == [0, 8, 9]
    kinds = {pos: reason.split(":")[0] for pos, reason in out.errors.items()}
    assert kinds == {
        1: "empty",
        2: "empty",
        3: "invalid_utf8",
        4: "invalid_unicode",
        5: "not_text",
        6: "not_text",
        7: "empty",
    }
    clean = ex.extract(["good one", "valid utf-8 bytes", "another good one"], layers=[0, 2])
    torch.testing.assert_close(out.hidden, clean.hidden)
    torch.testing.assert_close(out.mask, clean.mask)


def test_control_characters_are_removed() -> None:
    ex = extractor(make_tiny_llm())
    dirty = ex.extract(["he\x00ll\x1bo\x7f"], layers=[1])
    clean = ex.extract(["hello"], layers=[1])
    torch.testing.assert_close(dirty.hidden, clean.hidden)


def test_huge_text_is_truncated_not_rejected() -> None:
    ex = extractor(make_tiny_llm(), max_tokens=32)
    out = ex.extract(["x" * 2_000_000, "small"], layers=[1])
    assert out.index == [0, 1]
    assert out.mask.sum(1).tolist() == [32, 6]


def test_nothing_extractable_gives_empty_tensors() -> None:
    out = extractor(make_tiny_llm()).extract(["", b"\xff"], layers=[0, 1])
    assert out.hidden.shape == (2, 0, 0, HIDDEN_SIZE)
    assert out.mask.shape == (0, 0)
    assert out.index == [] and set(out.errors) == {0, 1}
    assert extractor(make_tiny_llm()).extract([], layers=[1]).hidden.shape == (1, 0, 0, HIDDEN_SIZE)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_failing_forward_only_fails_its_own_text(side: str) -> None:
    llm = make_tiny_llm(padding_side=side)  # type: ignore[arg-type]
    poison = int(llm.tokenizer.convert_tokens_to_ids("#"))  # type: ignore[arg-type]

    def explode_on_poison(_module: object, _args: object, kw: dict[str, torch.Tensor]) -> None:
        if kw["input_ids"].eq(poison).any():
            raise RuntimeError("simulated device failure")

    handle = llm.model.register_forward_pre_hook(explode_on_poison, with_kwargs=True)
    try:
        # The failing text is the longest: dropping it narrows the output too.
        out = extractor(llm, batch_size=4).extract(["fine", "bad # text", "also fine"], layers=[2])
    finally:
        handle.remove()
    assert out.index == [0, 2]
    assert list(out.errors) == [1]
    assert out.errors[1].startswith("failed:") and "simulated device failure" in out.errors[1]
    expected = extractor(llm).extract(["fine", "also fine"], layers=[2])
    torch.testing.assert_close(out.hidden, expected.hidden)
    assert torch.equal(out.mask, expected.mask)


@pytest.mark.parametrize(
    ("fault", "splits"),
    [
        (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (lambda: RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    ],
    ids=["oom", "sticky-cuda-error"],
)
def test_device_faults_are_transient_not_a_verdict_on_the_texts(
    fault: Callable[[], Exception], splits: bool
) -> None:
    # A device out of memory, or a broken CUDA context, says nothing about the texts: they
    # must be retried (TransientError: the batch is rewound), never dead-lettered.
    llm = make_tiny_llm()
    calls: list[int] = []

    def device_fails(_module: object, _args: object, kw: dict[str, torch.Tensor]) -> None:
        calls.append(int(kw["input_ids"].shape[0]))
        raise fault()

    handle = llm.model.register_forward_pre_hook(device_fails, with_kwargs=True)
    try:
        with pytest.raises(DeviceError):
            extractor(llm, batch_size=4).extract(["fine", "bad # text", "also fine"], layers=[2])
    finally:
        handle.remove()
    if splits:
        assert calls[0] == 3 and 1 in calls  # out of memory: smaller micro-batches first
    else:
        assert calls == [3]  # a sticky error: no point in trying text by text


@pytest.mark.parametrize("layers", [[], [-1], [NUM_LAYERS + 1], [1, 1], [True], [1.0]])
def test_invalid_layers_raise(layers: list[object]) -> None:
    with pytest.raises(ExtractionError, match="layers"):
        extractor(make_tiny_llm()).extract(["text"], layers=layers)  # type: ignore[arg-type]


def test_output_dtype_and_reduced_precision_model() -> None:
    reference = extractor(make_tiny_llm()).extract(TEXTS, layers=[0, 4])
    llm = make_tiny_llm()
    llm.model.to(torch.bfloat16)  # type: ignore[arg-type]
    native = extractor(llm).extract(TEXTS, layers=[0, 4])
    assert native.hidden.dtype == torch.bfloat16
    as_float = extractor(llm, dtype=torch.float32).extract(TEXTS, layers=[0, 4])
    assert as_float.hidden.dtype == torch.float32
    torch.testing.assert_close(as_float.hidden, reference.hidden, rtol=0.05, atol=0.05)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU only: CUDA kernels' states against the CPU's, and states copied off the device",
)
def test_gpu_only_cuda_states_match_the_cpus_and_arrive_on_the_cpu() -> None:
    # What only a GPU can check: CUDA's kernels give the CPU's states (within 1e-4) and the
    # extractor copies them to the device it was asked for. The rest of the device logic
    # (buckets, the planner's choice, states kept where they are) has CPU tests.
    reference = extractor(make_tiny_llm()).extract(TEXTS, layers=ALL)
    llm = make_tiny_llm()
    llm.model.to("cuda")  # type: ignore[arg-type]
    out = extractor(llm, device="cpu").extract(TEXTS, layers=ALL)
    assert out.hidden.device.type == "cpu"
    torch.testing.assert_close(out.hidden, reference.hidden, rtol=1e-4, atol=1e-4)


def test_properties_and_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.llm import extract as extract_module
    from worker.settings import Settings

    llm = make_tiny_llm()
    monkeypatch.setattr(extract_module, "load_llm", lambda settings: llm)
    settings = Settings(
        max_tokens=48, truncation="head_tail", batch_size=3, batch_tokens=96, max_chunks=2
    )
    ex = HiddenStateExtractor.from_settings(settings)
    assert (ex.max_tokens, ex.truncation, ex.batch_size, ex.max_chunks) == (48, "head_tail", 3, 2)
    assert ex.batch_tokens == 96
    assert (ex.num_layers, ex.hidden_size) == (NUM_LAYERS, HIDDEN_SIZE)
    assert ex.fingerprint == llm.fingerprint


def test_padding_side_is_read_at_call_time() -> None:
    llm = make_tiny_llm(padding_side="right")
    ex = extractor(llm)
    llm.tokenizer.padding_side = "left"
    out = ex.extract(["ab", "abcd"], layers=[1])
    assert out.mask[0].tolist() == [False, False, True, True, True]


def test_outputs_are_normal_tensors_usable_for_training() -> None:
    """The updater trains probes on these: they must not be inference-mode tensors."""
    out = extractor(make_tiny_llm()).extract(TEXTS, layers=[1, 4])
    assert not out.hidden.is_inference() and not out.mask.is_inference()
    weight = torch.zeros(HIDDEN_SIZE, requires_grad=True)
    loss = (out.hidden[:, out.mask] @ weight).square().sum() + weight.sum()
    loss.backward()
    assert weight.grad is not None


def test_min_fill_keeps_short_texts_out_of_long_passes_with_the_same_states() -> None:
    from worker.llm.plan import length_batches

    assert length_batches([6, 100, 40, 90, 10], budget=None, min_fill=0.5) == [[1, 3], [2], [4, 0]]
    assert length_batches([6, 100, 40, 90, 10], budget=None) == [[1, 3, 2, 4, 0]]
    llm = make_tiny_llm()
    texts = ["hi", "a much longer message " * 6, "short one", "mid length text here ok"]
    mixed = extractor(llm, batch_size=8).extract(texts, (1, 2))
    split = extractor(llm, batch_size=8, batch_min_fill=0.5).extract(texts, (1, 2))
    assert mixed.mask.tolist() == split.mask.tolist()
    torch.testing.assert_close(split.hidden, mixed.hidden, atol=1e-5, rtol=1e-4)


def aten_calls(run: Callable[[], object]) -> dict[str, int]:
    """How often each aten op ran during ``run()`` (what an accelerator launches)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        run()
    return dict(count.calls)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_pass_is_written_in_one_scatter_per_layer_whatever_its_rows(side: str) -> None:
    llm = make_tiny_llm(padding_side=side)  # type: ignore[arg-type]
    ex = extractor(llm, batch_size=64, scatter=True)  # one pass for every text
    texts = [f"text number {i}" + "!" * (i % 5) for i in range(16)]
    few = aten_calls(lambda: ex.extract(texts[:2], ALL))
    many = aten_calls(lambda: ex.extract(texts, ALL))
    # Rows cost no op of their own: no copy per row and layer (16 x 5 before), no tensor
    # per row for the inputs.
    assert many.get("aten.copy_", 0) == few.get("aten.copy_", 0) < len(ALL)
    assert many.get("aten.index_put_", 0) == len(ALL)
    # On the CPU a model's states are copied row by row by default (faster there).
    assert not extractor(llm).scatter and extractor(llm, scatter=True).scatter
    per_row = aten_calls(lambda: extractor(llm, batch_size=64).extract(texts, ALL))
    assert per_row.get("aten.copy_", 0) >= len(texts) * len(ALL)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("form", ["raw", "chat"])
def test_rows_of_a_shared_pass_equal_each_text_alone(side: str, form: str) -> None:
    llm = make_tiny_llm(padding_side=side)  # type: ignore[arg-type]
    long = "".join(chr(ord("a") + i % 26) for i in range(70))  # chunked at max_tokens 48
    texts = ["hi", long, "a mid sized text", "x", "another text of some length"]
    kwargs = dict(max_tokens=48, max_chunks=2, text_form=form)
    out = extractor(llm, batch_size=8, scatter=True, **kwargs).extract(texts, ALL)
    for row, text in enumerate(texts):
        alone = extractor(llm, **kwargs).extract([text], ALL)
        torch.testing.assert_close(
            real_tokens(out, row), real_tokens(alone, 0), atol=1e-5, rtol=1e-4
        )
        padding = out.hidden[:, row][:, ~out.mask[row]]  # [L, pad, D]
        assert padding.numel() == 0 or padding.abs().max().item() == 0


@pytest.mark.parametrize("side", ["right", "left"])
def test_passes_are_padded_up_to_a_bucket_with_the_same_states(side: str) -> None:
    llm = make_tiny_llm(padding_side=side)  # type: ignore[arg-type]
    widths: list[int] = []
    hook = llm.model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    texts = ["hi", "a text of twenty-one", "x" * 40]  # 3, 21 and 41 tokens with <s>
    try:
        plain = extractor(llm, batch_size=1).extract(texts, ALL)
        bucketed = extractor(llm, batch_size=1, buckets=(16, 32, 64)).extract(texts, ALL)
    finally:
        hook.remove()
    assert widths == [41, 21, 3, 64, 32, 16]  # longest first; then each up to its bucket
    assert bucketed.mask.tolist() == plain.mask.tolist()
    torch.testing.assert_close(bucketed.hidden, plain.hidden, atol=1e-5, rtol=1e-4)
