"""The chat text form (PROBEGUARD_TEXT_FORM=chat) on the tiny models: the template's ids
around a text, states equal to running the model by hand on ``context + text + suffix``
(only the positions after the context are output), and a fingerprint that tells the forms
apart so a probe of one form is refused on the other."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic import ValidationError

from probes.checkpoint import checkpoint_to_bytes, probe_from_bytes
from probes.errors import IncompatibleCheckpoint
from probes.probe import build_probe
from schemas import LLMFingerprint
from tests.registry_helpers import toxicity_spec
from worker.defaults import folder_name
from worker.errors import ConfigError
from worker.llm.chat_form import prompt_ids, turn_ids
from worker.llm.extract import ExitStage, HiddenStateExtractor
from worker.llm.load import LoadedLLM
from worker.llm.tiny import NUM_LAYERS, make_tiny_llm, tiny_tokenizer
from worker.offline.build_cache import llm_variant
from worker.settings import Settings
from worker.settings.llm import PROMPT_TEMPLATE

ALL = list(range(NUM_LAYERS + 1))
TEXTS = ["hello", "a much longer text, with punctuation!", "mid size", "x"]
CONTEXT = "system: be nice\nuser: "  # the tiny template's, one token per character
SUFFIX = "\nassistant: "


def chat(llm: LoadedLLM, **kwargs: object) -> HiddenStateExtractor:
    kwargs.setdefault("max_tokens", 128)
    return HiddenStateExtractor(llm, text_form="chat", **kwargs)  # type: ignore[arg-type]


def by_hand(llm: LoadedLLM, context: list[int], ids: list[int]) -> torch.Tensor:
    """``[L, n, D]``: transformers' own states of ``context + ids`` alone (no padding, no
    hooks), at the positions of ``ids``."""
    with torch.inference_mode():
        out = llm.model(input_ids=torch.tensor([context + ids]), output_hidden_states=True)
    return torch.stack(out.hidden_states)[:, 0, len(context) :]


def content(llm: LoadedLLM, text: str) -> list[int]:
    return list(llm.tokenizer(text, add_special_tokens=False)["input_ids"])


# --- the template's ids ------------------------------------------------------------------


def test_turn_ids_split_the_template_around_the_text() -> None:
    tok = tiny_tokenizer()
    turn = turn_ids(tok)
    assert list(turn.context) == content_ids(CONTEXT) and list(turn.suffix) == content_ids(SUFFIX)
    assert turn.key.startswith("chat-") and len(turn.key) == 5 + 16
    own = turn_ids(tok, system_prompt="be strict")
    assert list(own.context) == content_ids("system: be strict\nuser: ")
    assert own.suffix == turn.suffix and own.key != turn.key
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    later = turn_ids(tok, history)
    assert list(later.context) == content_ids(CONTEXT + "hi\nassistant: yo\nuser: ")
    with pytest.raises(ConfigError, match="no chat template"):
        turn_ids(tiny_tokenizer("bert"))


def content_ids(text: str) -> list[int]:
    return list(tiny_tokenizer()(text, add_special_tokens=False)["input_ids"])


def test_one_frame_says_what_is_pooled_for_the_extractor_and_the_guard() -> None:
    tok = tiny_tokenizer()
    turn = turn_ids(tok)
    text = content_ids("hi")
    chat_form, raw_inside = turn.frame(), turn.frame(pool_suffix=False)
    ids = chat_form.ids(text)
    assert ids == raw_inside.ids(text) == content_ids(CONTEXT + "hi" + SUFFIX)
    start, end = chat_form.span(len(text))
    assert ids[start:end] == content_ids("hi" + SUFFIX)  # what the extractor outputs
    start, end = raw_inside.span(len(text))
    assert ids[start:end] == text  # the text alone: raw-form probes in the guard
    ex = HiddenStateExtractor(make_tiny_llm(), max_tokens=64, text_form="chat")
    assert ex.token_ids("hi") == ids[slice(*chat_form.span(len(text)))]


# --- states --------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
def test_chat_states_are_those_after_the_context_of_a_pass_by_hand(side: str) -> None:
    llm = make_tiny_llm(padding_side=side)  # type: ignore[arg-type]
    ex = chat(llm, batch_size=len(TEXTS))  # mixed lengths in one forward pass
    turn = turn_ids(llm.tokenizer)
    out = ex.extract(TEXTS, layers=ALL)
    assert out.index == list(range(len(TEXTS))) and out.errors == {}
    # The row is the text and the suffix: the context ran but is not output.
    assert out.mask.sum(1).tolist() == [len(t) + len(SUFFIX) for t in TEXTS]
    assert torch.all(out.hidden[:, ~out.mask] == 0)
    for row, text in enumerate(TEXTS):
        ids = content(llm, text) + list(turn.suffix)
        want = by_hand(llm, list(turn.context), ids)  # [L, n, D]
        got = out.hidden[:, row][:, out.mask[row]]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        first = int(out.mask[row].nonzero()[0])
        # Padding on the tokenizer's side, as in the raw form.
        assert first == (out.mask.shape[1] - len(ids) if side == "left" else 0)


def test_token_ids_are_the_output_and_token_counts_the_forward_cost() -> None:
    llm = make_tiny_llm()
    ex = chat(llm)
    assert ex.token_ids("hi there") == content_ids("hi there" + SUFFIX)
    assert ex.token_counts(["hi there", b"\xff"]) == [len(CONTEXT + "hi there" + SUFFIX), 0]


def test_every_chunk_gets_the_context_and_the_suffix() -> None:
    llm = make_tiny_llm()
    around = len(CONTEXT) + len(SUFFIX)
    ex = chat(llm, max_tokens=around + 10, max_chunks=3)
    text = "abcdefghijklmnopqrst"  # 20 content tokens: two chunks of 10
    turn = turn_ids(llm.tokenizer)
    chunks = [content(llm, part) + list(turn.suffix) for part in (text[:10], text[10:])]
    assert ex.token_ids(text) == chunks[0] + chunks[1]
    assert ex.token_counts([text]) == [2 * (around + 10)]
    out = ex.extract([text, "short"], layers=[0, 2, 4])
    assert out.mask.sum(1).tolist() == [2 * (10 + len(SUFFIX)), 5 + len(SUFFIX)]
    want = torch.cat([by_hand(llm, list(turn.context), c) for c in chunks], dim=1)[[0, 2, 4]]
    torch.testing.assert_close(out.hidden[:, 0][:, out.mask[0]], want, rtol=0, atol=1e-5)


def test_max_tokens_bounds_the_whole_input_context_included() -> None:
    llm = make_tiny_llm()
    around = len(CONTEXT) + len(SUFFIX)
    with pytest.raises(ConfigError, match="leaves no room"):
        chat(llm, max_tokens=around)
    ex = chat(llm, max_tokens=around + 4)
    assert ex.token_ids("abcdefgh") == content_ids("abcd" + SUFFIX)  # head truncation
    assert ex.token_counts(["abcdefgh"]) == [around + 4]


def test_the_chat_form_needs_a_chat_template() -> None:
    with pytest.raises(ConfigError, match="no chat template"):
        chat(make_tiny_llm(arch="bert"))
    with pytest.raises(ConfigError, match="text_form must be"):
        HiddenStateExtractor(make_tiny_llm(), max_tokens=64, text_form="templated")  # type: ignore[arg-type]


def test_from_settings_reads_the_form(tmp_path: Path) -> None:
    make_tiny_llm(tmp_path)
    settings = Settings(
        model=str(tmp_path / "tiny-llama-0"),
        cache_dir=tmp_path / "cache",
        text_form="chat",
        chat_system_prompt="be strict",
    )
    ex = HiddenStateExtractor.from_settings(settings)
    assert ex.text_form == "chat"
    assert ex.token_counts(["hi"]) == [len("system: be strict\nuser: hi" + SUFFIX)]
    assert ex.fingerprint.text_form == turn_ids(ex.llm.tokenizer, system_prompt="be strict").key
    assert Settings().text_form == "raw" and Settings().chat_system_prompt is None


def test_an_exit_stage_pools_the_output_tokens_only() -> None:
    seen: list[tuple[int, int]] = []  # (input position, tokens in the decide mask)

    def half_exit(
        states: torch.Tensor, mask: torch.Tensor, positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seen.extend(zip(positions, mask.sum(-1).tolist(), strict=True))
        exits = torch.tensor([p % 2 == 0 for p in positions])
        return exits, (states * mask[..., None]).sum(1)  # [b, D]: the masked sum

    sides: tuple[Literal["right", "left"], ...] = ("right", "left")
    for side in sides:
        llm = make_tiny_llm(padding_side=side)
        ex = chat(llm, batch_size=3)
        full = ex.extract(TEXTS, layers=[2, 4])
        seen.clear()
        out = ex.extract_staged(TEXTS, [2, 4], ExitStage(2, half_exit))
        assert sorted(seen) == [(p, len(t) + len(SUFFIX)) for p, t in enumerate(TEXTS)]
        assert out.index == [1, 3] and sorted(out.exited) == [0, 2]
        for pos in (0, 2):  # the payload pooled exactly the full probe's tokens
            want = full.layer(2)[pos][full.mask[pos]].sum(0)
            torch.testing.assert_close(out.exited[pos], want, rtol=0, atol=1e-5)
        for r, pos in enumerate(out.index):  # the rows that went on: the full pass's states
            torch.testing.assert_close(
                out.hidden[:, r][:, out.mask[r]],
                full.hidden[:, pos][:, full.mask[pos]],
                rtol=0,
                atol=1e-5,
            )


# --- the fingerprint ---------------------------------------------------------------------------


def test_the_fingerprint_names_the_chat_form_and_raw_is_unchanged() -> None:
    llm = make_tiny_llm()
    raw = HiddenStateExtractor(llm, max_tokens=64).fingerprint
    assert raw == llm.fingerprint and raw.text_form is None
    assert b"text_form" not in raw.encode()  # old digests, signatures and caches hold
    fp = chat(llm).fingerprint
    assert fp.text_form == turn_ids(llm.tokenizer).key
    assert fp.model_copy(update={"text_form": None}) == raw and fp.digest != raw.digest
    assert LLMFingerprint.decode(fp.encode()) == fp
    assert "text_form: this None vs that 'chat-" in raw.diff(fp)
    # A fingerprint of fixed fields digests as it did before text_form existed.
    fixed = LLMFingerprint(
        model_id="m", source_sha256="a" * 64, num_layers=2, hidden_size=8, tokenizer_sha256="b" * 64
    )
    assert fixed.digest == "ad8cc227d542d578"
    with pytest.raises(ValidationError, match="text_form"):
        LLMFingerprint.model_validate({**fixed.model_dump(), "text_form": "Chat form!"})


@pytest.mark.parametrize("trained_on", ["raw", "chat"])
def test_a_probe_is_refused_in_the_other_text_form(trained_on: str) -> None:
    llm = make_tiny_llm()
    raw, chatted = HiddenStateExtractor(llm, max_tokens=64).fingerprint, chat(llm).fingerprint
    mine, other = (raw, chatted) if trained_on == "raw" else (chatted, raw)
    blob, manifest = checkpoint_to_bytes(build_probe(toxicity_spec(32)), llm=mine, version=3)
    probe_from_bytes(blob, manifest, mine)  # fine on the form it was trained on
    with pytest.raises(IncompatibleCheckpoint, match="trained on another LLM: text_form"):
        probe_from_bytes(blob, manifest, other)


def test_chat_caches_live_apart() -> None:
    llm = make_tiny_llm()
    assert llm_variant(HiddenStateExtractor(llm, max_tokens=64)) == "none"
    assert llm_variant(chat(llm)) == "none-chat"


# --- the prompt form -----------------------------------------------------------------------


def test_the_prompt_form_runs_the_text_inside_the_prompt_and_pools_it_and_what_follows() -> None:
    """PROBEGUARD_TEXT_FORM=prompt (issue 42): the text inside ``TEXT_PROMPT``; the ids
    before it run unpooled, the text and the ids after it (where the model has read the
    whole message) are the output, as a pass by hand computes them."""
    llm = make_tiny_llm()
    template = "Message: {text} -> verdict:"
    ex = HiddenStateExtractor(llm, max_tokens=128, text_form="prompt", text_prompt=template)
    turn = prompt_ids(llm.tokenizer, template)
    assert turn.context == tuple(content(llm, "Message: "))
    assert turn.suffix == tuple(content(llm, " -> verdict:"))
    out = ex.extract(TEXTS, layers=ALL)
    assert out.mask.sum(1).tolist() == [len(t) + len(turn.suffix) for t in TEXTS]
    for row, text in enumerate(TEXTS):
        want = by_hand(llm, list(turn.context), content(llm, text) + list(turn.suffix))
        torch.testing.assert_close(out.hidden[:, row][:, out.mask[row]], want, rtol=0, atol=1e-5)
    assert ex.token_counts(["hi"]) == [len("Message: hi -> verdict:")]


def test_the_prompt_is_part_of_the_form(tmp_path: Path) -> None:
    """Probes of one prompt are refused under another: the key names the form and the ids."""
    llm = make_tiny_llm()
    one = HiddenStateExtractor(llm, max_tokens=64, text_form="prompt").fingerprint
    other = HiddenStateExtractor(
        llm, max_tokens=64, text_form="prompt", text_prompt="{text} means:"
    ).fingerprint
    assert one.text_form is not None and one.text_form.startswith("prompt-")
    assert other.text_form is not None and other.text_form != one.text_form
    assert one.digest != chat(llm).fingerprint.digest != llm.fingerprint.digest
    assert llm_variant(HiddenStateExtractor(llm, max_tokens=64, text_form="prompt")) == (
        "none-prompt"
    )
    assert folder_name(one).endswith("-prompt")
    make_tiny_llm(tmp_path)
    settings = Settings(
        model=str(tmp_path / "tiny-llama-0"), cache_dir=tmp_path / "c", text_form="prompt"
    )
    assert settings.text_prompt == PROMPT_TEMPLATE
    ex = HiddenStateExtractor.from_settings(settings)
    assert ex.fingerprint.text_form == prompt_ids(ex.llm.tokenizer, PROMPT_TEMPLATE).key
    for bad in ("no placeholder here", "{text} and {text}"):
        with pytest.raises(ValidationError, match="exactly once"):
            Settings(text_form="prompt", text_prompt=bad)
        with pytest.raises(ConfigError, match="exactly once"):
            prompt_ids(llm.tokenizer, bad)
