"""The Explain page shows what ``probeguard explain`` computes, for the same probe and text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.browser.conftest import Stack, sign_in
from worker.explain.breakdown import explain, source_from_registry, verify
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
