"""The review page explains the item under review: the same decomposition as
``probeguard explain`` for the version that scored it, without the logit lens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.browser.conftest import Stack, sign_in
from worker.explain.breakdown import ExplainOptions, explain
from worker.explain.source import source_from_registry, verify
from worker.llm.extract import HiddenStateExtractor

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TEXT = "you are an idiot <b>and</b> everyone says so"


def test_review_page_shows_the_explanation_of_the_item(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: HiddenStateExtractor
) -> None:
    stack.review(1, texts=lambda _: TEXT)
    version = stack.registry.stages().live
    source = source_from_registry(stack.registry, "live", version)
    probe, manifest = verify(source, tiny_extractor)
    want = explain(probe, manifest, tiny_extractor, TEXT, source.where, ExplainOptions(lens=False))

    page = new_page()
    sign_in(page, stack.url, "rita")
    page.wait_for_selector("#item")
    why = page.locator("section.card", has=page.locator("h2", has_text="Why the probe says so"))
    assert why.count() == 1
    verdict = why.locator("p.verdict").inner_text()
    assert f"v{version}" in verdict
    assert f"flag score {want['verdict']['flag_score']:.3f}" in verdict
    rows = why.locator("table.layers tbody tr")
    assert rows.count() == len(want["layers"]) > 0
    for i, layer in enumerate(want["layers"]):
        cells = rows.nth(i).locator("td").all_inner_texts()
        assert cells[0] == str(layer["layer"])
        assert cells[1] == f"{layer['weight']:.3f}"
        assert cells[3] == f"{layer['flag_score']:.3f}"
    # The queue explains without the lens (and so without its views), and the text's
    # markup stays text.
    assert why.locator("table.lens").count() == 0 and why.locator("table.ranks").count() == 0
    message = page.locator("blockquote.message")
    assert TEXT in message.inner_text() and message.locator("b").count() == 0


def test_the_explanation_sits_beside_the_item_at_1280_px_and_below_it_at_390(
    stack: Stack, new_page: Callable[[], Any]
) -> None:
    stack.review(1, texts=lambda _: TEXT)
    page = new_page()
    page.set_viewport_size({"width": 1280, "height": 800})
    sign_in(page, stack.url, "rita")
    page.wait_for_selector("#item")
    message = page.locator("blockquote.message").bounding_box()
    heading = page.locator("#why h2").bounding_box()
    layers = page.locator("#why table.layers").bounding_box()
    assert message and heading and layers
    # In view without scrolling, to the right of the message a reviewer is reading.
    assert heading["y"] + heading["height"] <= 800 and layers["y"] < 800
    assert heading["x"] >= message["x"] + message["width"]
    # Each queue counter says what it counts (hover).
    for counter in ("depth", "waiting", "claimed", "held", "lag"):
        assert page.locator(f"[title]:has(#{counter})").first.get_attribute("title")
    page.set_viewport_size({"width": 390, "height": 800})
    message = page.locator("blockquote.message").bounding_box()
    heading = page.locator("#why h2").bounding_box()
    answer = page.locator("#answer").bounding_box()
    assert message and heading and answer
    # One column on a phone: the item and its answers first, the explanation after them.
    assert heading["y"] > answer["y"] + answer["height"] and heading["x"] < message["x"] + 40
