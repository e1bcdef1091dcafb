"""The Explain page shows what ``probeguard explain`` computes, for the same probe and text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.browser.conftest import Stack, sign_in
from worker.explain.breakdown import explain
from worker.explain.source import source_from_registry, verify
from worker.llm.extract import HiddenStateExtractor

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def test_explain_page_matches_the_cli_decomposition(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: HiddenStateExtractor
) -> None:
    text = "you are an idiot, everyone says so"
    source = source_from_registry(stack.registry, "live", None)
    probe, manifest = verify(source, tiny_extractor)
    want = explain(probe, manifest, tiny_extractor, text, source.where)

    page = new_page()
    sign_in(page, stack.url, "rita", "/explain")
    page.fill("textarea[name=text]", text)
    with page.expect_navigation():
        page.keyboard.press("Control+Enter")  # keyboard only
    rows = page.locator("table.layers tbody tr")
    assert rows.count() == len(want["layers"])
    for i, layer in enumerate(want["layers"]):
        cells = rows.nth(i).locator("td").all_inner_texts()
        assert cells[0] == str(layer["layer"])
        assert cells[1] == f"{layer['weight']:.3f}"
        assert cells[3] == f"{layer['flag_score']:.3f}"
    verdict = page.inner_text("p.verdict")
    assert f"flag score {want['verdict']['flag_score']:.3f}" in verdict
    assert "No logit lens" in page.inner_text("#report")  # the tiny LLM has no LM head

    page.fill("textarea[name=text]", "   ")
    with page.expect_navigation() as nav:
        page.keyboard.press("Control+Enter")
    assert nav.value.status == 400
    assert "type a message" in page.inner_text(".flash.error")


def test_explain_page_says_which_depth_decides_in_a_cascade(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: HiddenStateExtractor
) -> None:
    from probes.probe import build_probe
    from schemas import ExitSpec
    from tests.registry_helpers import publish_probe, toxicity_spec

    spec = toxicity_spec(tiny_extractor.hidden_size, layers=[1, 3])
    exit_spec = ExitSpec(layer=1, temperature=1.0, allow_below=1.0)  # every message exits
    probe = build_probe(spec.model_copy(update={"exit": exit_spec}), seed=4)
    publish_probe(stack.registry, tiny_extractor.fingerprint, probe=probe)
    text = "<b>decided</b> early & shallow"
    source = source_from_registry(stack.registry, "live", None)
    want = explain(*verify(source, tiny_extractor), tiny_extractor, text, source.where)

    page = new_page()
    sign_in(page, stack.url, "rita", "/explain")
    page.fill("textarea[name=text]", text)
    with page.expect_navigation():
        page.keyboard.press("Control+Enter")
    depth = page.inner_text("p.depth")
    assert "decided at layer 1 by the exit head" in depth and "allow" in depth
    assert f"flag risk {want['exit']['flag_risk']:.3f}" in depth
    assert "A scorer stops there" in depth
