"""The inline guard on the tiny LLM and the real Redis (no broker: verdicts are not sent)."""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from probes.probe import build_probe
from schemas import ChatMessage, utcnow
from tests.conftest import RedisNamespace
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.errors import ConfigError
from worker.guard import Guard, GuardedReply
from worker.llm.extract import HiddenStateExtractor
from worker.llm.model import LoadedLLM
from worker.llm.tiny import make_tiny_gemma3, make_tiny_llm
from worker.scoring.engine import Retain
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry


def chat_llm() -> LoadedLLM:
    """The tiny Llama with its LM head (its tokenizer has a chat template)."""
    return make_tiny_llm(lm_head="tied")


class Recorder:
    """A ``generate`` streamer that keeps what it is shown."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


@pytest.fixture
def llm() -> LoadedLLM:
    return chat_llm()


def no_blanks(llm: LoadedLLM) -> list[int]:
    """Token ids of whitespace: suppressed so the random model's reply has readable text."""
    vocab = llm.tokenizer.get_vocab()
    return [vocab[c] for c in string.whitespace if c in vocab]


def guard_settings(redis_ns: RedisNamespace, **kw: Any) -> Settings:
    """One probe (``toxicity``), no packaged default, nothing sent to Kafka (no broker)."""
    quiet = {"guard_verdicts": False, "guard_review": False}
    fields: dict[str, Any] = {"probes": "toxicity", "default_probe": False, **quiet, **kw}
    return Settings(redis_url=redis_ns.url, redis_prefix=redis_ns.prefix, **fields)


@contextlib.contextmanager
def run(
    llm: LoadedLLM,
    redis_ns: RedisNamespace,
    flag: str,
    threshold: float,
    text: str = "hello there",
    **kw: Any,
) -> Iterator[tuple[Guard, GuardedReply]]:
    """Serve a random probe flagging ``flag`` at ``threshold``; one guarded turn."""
    spec = toxicity_spec(llm.hidden_size, layers=[1, 4]).model_copy(
        update={"flag_labels": [flag], "thresholds": {flag: threshold}}
    )
    options = {"max_new_tokens": kw.pop("max_new_tokens", 8), "do_sample": False}
    options["suppress_tokens"] = no_blanks(llm)
    options.update(kw.pop("generate", {}))
    settings = guard_settings(redis_ns, **kw)
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    trained_on = HiddenStateExtractor.for_llm(llm, settings).fingerprint  # raw or chat form
    publish_probe(registry, trained_on, probe=build_probe(spec, seed=1))
    with Guard(llm, settings, redis_ns.client) as guard:
        assert guard.wait_ready(30)
        yield guard, guard.chat([{"role": "user", "content": text}], **options)


def one(llm: LoadedLLM, redis_ns: RedisNamespace, *args: Any, **kw: Any) -> GuardedReply:
    with run(llm, redis_ns, *args, **kw) as (_, reply):
        return reply


def test_a_flagged_prompt_is_refused_before_the_reply_and_nothing_is_shown(
    llm: LoadedLLM, redis_ns: RedisNamespace
) -> None:
    shown = Recorder()
    reply = one(llm, redis_ns, "toxic", 0.0, generate={"streamer": shown})
    assert reply.prompt is not None and reply.prompt.decision == "flag"
    assert reply.refused == "prompt" and reply.text == Settings().guard_refusal
    assert reply.tokens == 0 and reply.generated == "" and reply.reply is None
    assert len(shown.puts) == 1 and shown.ended  # the prompt, never a reply token


def test_continue_generates_and_the_reply_gets_its_own_verdict_naming_the_prompt(
    llm: LoadedLLM, redis_ns: RedisNamespace
) -> None:
    shown = Recorder()
    reply = one(llm, redis_ns, "toxic", 0.0, guard_on_flag="continue", generate={"streamer": shown})
    assert reply.refused is None and reply.tokens == 8 and reply.text == reply.generated
    assert reply.flagged and reply.prompt is not None and reply.reply is not None
    assert reply.reply.message_id == reply.reply_id != reply.prompt_id
    assert reply.reply.reply_to == reply.prompt_id and reply.prompt.reply_to is None
    assert reply.reply.conversation_id == reply.prompt.conversation_id
    assert sum(len(p) for p in shown.puts[1:]) == 8  # every reply token, after the verdicts


def test_the_text_cache_holds_prompt_and_reply_for_label_joins(
    llm: LoadedLLM, redis_ns: RedisNamespace
) -> None:
    reply = one(llm, redis_ns, "toxic", 1.0, text="what a day")
    assert reply.prompt is not None and reply.prompt.decision == "allow"
    cached = redis_ns.client.get(redis_ns.keys.text(reply.prompt_id))
    assert cached == b"what a day"
    assert redis_ns.client.get(redis_ns.keys.text(reply.reply_id)) == reply.generated.encode()


def test_a_streaming_check_stops_a_flagged_reply_and_withholds_it(
    llm: LoadedLLM, redis_ns: RedisNamespace
) -> None:
    # Find scores by which this prompt is allowed and its first reply tokens are flagged:
    # the same random probe reads both, so flag whichever label the reply scores higher.
    probe = one(llm, redis_ns, "toxic", 1.0, guard_on_flag="continue", max_new_tokens=4)
    assert probe.prompt is not None and probe.reply is not None
    p = probe.prompt.results[0].scores["toxic"]
    r = probe.reply.results[0].scores["toxic"]
    assert abs(p - r) > 1e-4, (p, r)
    flag, p, r = ("toxic", p, r) if r > p else ("ok", 1 - p, 1 - r)
    shown = Recorder()
    reply = one(
        llm,
        redis_ns,
        flag,
        (p + r) / 2,
        guard_stream_every=4,
        max_new_tokens=12,
        generate={"streamer": shown},
    )
    assert reply.prompt is not None and reply.prompt.decision == "allow"
    assert reply.refused == "reply" and reply.checks == 1 and reply.tokens == 4
    assert reply.text == Settings().guard_refusal and reply.generated
    assert shown.puts[1:] == [] and shown.ended  # nothing of the reply was shown
    # annotate: the same checks run and say when the reply went bad; nothing is stopped.
    marked = one(
        llm,
        redis_ns,
        flag,
        (p + r) / 2,
        guard_on_flag="annotate",
        guard_stream_every=4,
        max_new_tokens=12,
    )
    # Checks at 4 and 8; at 12 the final verdict reads the same states.
    assert marked.refused is None and marked.tokens == 12 and marked.checks == 2
    assert marked.flagged_at == 4 and marked.text == marked.generated


def test_a_model_without_its_lm_head_cannot_be_guarded(redis_ns: RedisNamespace) -> None:
    with pytest.raises(ConfigError, match="LM head"):
        Guard(make_tiny_llm(), Settings(redis_url=redis_ns.url), redis_ns.client)


def test_the_conversation_must_end_with_the_users_turn(
    llm: LoadedLLM, redis_ns: RedisNamespace
) -> None:
    with run(llm, redis_ns, "toxic", 1.0) as (guard, _):
        with pytest.raises(ValueError, match="user's turn"):
            guard.chat([{"role": "assistant", "content": "hi"}])
        with pytest.raises(ValueError, match="cannot be read"):
            guard.chat([{"role": "user", "content": " \x00 "}])


def test_the_tap_keeps_only_the_probes_layers_over_the_texts_span(llm: LoadedLLM) -> None:
    from worker.guard.tap import StateTap

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in llm.model.modules())

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    before = hooks()
    tap = StateTap(llm, (0, 2, 4), (2, 5), torch.float32)
    with tap.attached(), torch.no_grad():
        causal: Any = llm.causal
        out = causal.generate(ids, max_new_tokens=3, do_sample=False)
    assert hooks() == before  # removed
    assert set(tap.prompt) == {0, 2, 4} and tap.prompt_states().shape == (3, 1, 3, 32)
    assert tap.decoded == 2 and tap.reply_states().shape == (3, 1, 2, 32)
    # The states are the model's own: a plain forward over prompt + first reply tokens.
    with torch.no_grad():
        full = llm.model(out[:, :8], output_hidden_states=True).hidden_states
    assert torch.allclose(tap.prompt[2], full[2][0, 2:5], atol=1e-5)
    assert torch.allclose(tap.prompt[4], full[4][0, 2:5], atol=1e-5)  # top: after the norm
    assert torch.allclose(tap.reply_states()[1, 0], full[2][0, 6:8], atol=1e-5)


def test_states_handed_to_judge_are_scored_and_missing_layers_extracted(
    llm: LoadedLLM, redis_ns: RedisNamespace
) -> None:
    """``ScoringEngine.judge(states=)``, the guard's way in: states that hold the probe's
    layers are scored as they are (the verdict judged from the text, on the tiny model);
    states that lack one (a probe swapped in that reads other layers) are not, and the
    engine's own pass gives the text's verdict."""
    with run(llm, redis_ns, "toxic", 1.0) as (guard, _):  # the probe reads layers 1 and 4
        engine = guard.engine
        message = ChatMessage(
            message_id="m", conversation_id="c", text="hello there", created_at=utcnow()
        )

        def toxic(**kw: Any) -> float:
            judged = engine.judge([message], retain=[Retain.NOTHING], review=False, **kw)
            return judged.verdicts[0].results[0].scores["toxic"]

        from_text = toxic()
        ex = engine.extractor.extract([message.text], [4, 1, 2])  # more, in another order
        picked = ex.select([1, 4])  # what the probe reads, in its order, as handed over
        assert picked is not None and picked.layers == (1, 4)
        assert torch.equal(picked.hidden, ex.hidden[[1, 0]]) and ex.select([1, 3]) is None
        assert toxic(states=ex) == pytest.approx(from_text, abs=1e-6)
        marked = replace(ex, hidden=ex.hidden + 1.0)
        assert abs(toxic(states=marked) - from_text) > 1e-6  # handed over, not recomputed
        partial = replace(marked, hidden=marked.hidden[1:], layers=(1, 2))  # no layer 4
        assert toxic(states=partial) == pytest.approx(from_text, abs=1e-6)


@pytest.mark.parametrize(
    ("arch", "form"), [("llama", "chat"), ("llama", "raw"), ("gemma3", "chat")]
)
def test_in_the_chat_form_inline_scores_equal_the_scorers(
    redis_ns: RedisNamespace, arch: str, form: str
) -> None:
    # Gemma 3: sliding-window layers shorter than the prompts, a hybrid cache in generate.
    llm = make_tiny_gemma3(lm_head=True) if arch == "gemma3" else chat_llm()
    from worker.scoring.engine import ScoringEngine
    from worker.scoring.metrics import ScorerMetrics

    texts = ["what a lovely day", "XXXX ZZZZ QQQQ!!!", "see you tomorrow, friend"]
    inline = []
    with run(llm, redis_ns, "toxic", 1.0, text_form=form, chat_system_prompt="be brief") as (g, _):
        for text in texts:
            turn = g.chat([{"role": "user", "content": text}], max_new_tokens=1)
            assert turn.prompt is not None
            inline.append(turn.prompt.results[0].scores["toxic"])
        settings = g.settings
    extractor = HiddenStateExtractor.for_llm(llm, settings)
    engine = ScoringEngine(
        settings, extractor, redis_ns.client, worker_id="scorer", metrics=ScorerMetrics()
    )
    engine.watcher.refresh(force=True)
    messages = [
        ChatMessage(message_id=f"m{i}", conversation_id="c", text=t, created_at=utcnow())
        for i, t in enumerate(texts)
    ]
    judged = engine.judge(messages, review=False)
    scorer = [judged.verdicts[i].results[0].scores["toxic"] for i in range(len(texts))]
    gaps = [abs(a - b) for a, b in zip(inline, scorer, strict=True)]
    if form == "chat":  # the same ids, the same states: the same scores
        assert max(gaps) < 1e-4, gaps
    else:  # the text's states carry the template before them: close, not equal
        assert max(gaps) > 1e-4, gaps


@pytest.mark.parametrize("form", ["raw", "chat"])
def test_raw_probes_inside_the_template_are_called_approximate(
    llm: LoadedLLM, redis_ns: RedisNamespace, caplog: pytest.LogCaptureFixture, form: str
) -> None:
    settings = Settings(
        redis_url=redis_ns.url,
        redis_prefix=redis_ns.prefix,
        text_form=form,
        guard_verdicts=False,
        guard_review=False,
    )
    with (
        caplog.at_level("WARNING", logger="worker.guard.guard"),
        Guard(llm, settings, redis_ns.client),
    ):
        pass
    warned = any("approximate" in r.getMessage() for r in caplog.records)
    assert warned == (form == "raw")


def test_the_guards_own_pass_after_a_swap_runs_without_the_turns_hooks(
    llm: LoadedLLM, redis_ns: RedisNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45: after a mid-turn hot swap to a probe that reads other layers, the guard's
    fallback pass ran on the serving model with the turn's hooks attached (first its states
    were kept as if a reply token had been decoded; then the hooks were paused, still
    attached). Now the hooks are off while the engine judges, and on again after."""
    from worker.guard.guard import _Turn
    from worker.guard.tap import StateTap

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in llm.model.modules())

    with run(llm, redis_ns, "toxic", 1.0) as (guard, _):  # the probe now reads layers 1, 4
        extractor = guard.engine.extractor
        seen: list[int] = []
        own = extractor.extract

        def spied(*args: Any, **kw: Any) -> Any:
            seen.append(hooks())
            return own(*args, **kw)

        monkeypatch.setattr(extractor, "extract", spied)
        ids = llm.tokenizer("hello there", return_tensors="pt")["input_ids"]
        baseline = hooks()
        tap = StateTap(llm, [1], (0, ids.shape[1]), torch.float32)  # the turn's: layer 1
        message = ChatMessage(
            message_id="m", conversation_id="c", text="hello there", created_at=utcnow()
        )
        turn = _Turn(guard, tap, message, "r", ids.shape[1])
        with tap.attached(), torch.no_grad():
            llm.model(input_ids=ids)  # the prefill: the prompt's states
            verdict = guard._judge(message, tap.prompt_states(), Retain.NOTHING, turn, send=False)
            assert hooks() == baseline + 1  # the turn's hook, back for the next token
    assert verdict is not None and turn.errors == []
    assert seen == [baseline]  # a pass of its own (layer 4 was not kept), no hook on
    assert tap.decoded == 0 and tap.steps[1] == []  # and none of it kept as reply tokens
