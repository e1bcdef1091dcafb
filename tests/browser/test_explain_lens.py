"""The Explain page's lens views (seed 004, Ecco) in a real browser, on a tiny LLM that has an
LM head: the lens at a chosen position, a token's rank at every layer and position, two
candidate tokens compared; hostile text stays text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.browser.conftest import Stack, sign_in
from worker.explain.breakdown import ExplainOptions, explain
from worker.explain.render import rank_class
from worker.explain.source import source_from_registry, verify
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import NUM_LAYERS, make_tiny_llm

pytestmark = [pytest.mark.browser, pytest.mark.integration]

HOSTILE = "<img src=x onerror=alert(1)> is it"


@pytest.fixture(scope="module")
def tiny_extractor() -> HiddenStateExtractor:
    """Overrides the session's head-less tiny LLM: the lens views need an LM head."""
    return HiddenStateExtractor(make_tiny_llm(lm_head="own"), max_tokens=64, batch_size=1)


def submit(page: Any, **fields: str) -> Any:
    for name, value in fields.items():
        page.fill(f"[name={name}]", value)
    with page.expect_navigation() as nav:
        page.click("#explain-form button[type=submit]")
    return nav.value


def test_lens_views_render_what_explain_computes(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: HiddenStateExtractor
) -> None:
    source = source_from_registry(stack.registry, "live", None)
    probe, manifest = verify(source, tiny_extractor)
    options = ExplainOptions(position=3, rank="e", compare=("a", "' '"))
    want = explain(probe, manifest, tiny_extractor, HOSTILE, source.where, options)

    page = new_page()
    sign_in(page, stack.url, "rita", "/explain")
    response = submit(page, text=HOSTILE, position="3", rank="e", compare_a="a", compare_b="' '")
    assert response.status == 200
    report = page.locator("#report")
    assert "(position 3;" in report.inner_text()  # the lens reads the chosen token
    # The rank grid: one row per lens layer (top first), one column per token.
    grid = page.locator("table.ranks")
    heads = grid.locator("thead tr").first.locator("th").all_inner_texts()
    assert heads[1:] == want["rank"]["tokens"]
    rows = grid.locator("tbody tr")
    assert rows.count() == NUM_LAYERS + 1
    for i, layer in enumerate(reversed(want["rank"]["layers"])):
        cells = rows.nth(i).locator("td")
        assert rows.nth(i).locator("th").inner_text() == str(layer["layer"])
        assert cells.all_inner_texts() == [str(x) for x in layer["ranks"]]
        assert cells.first.get_attribute("class") == rank_class(layer["ranks"][0])
    # Two tokens at position 3: per layer, the logit difference and both ranks.
    compare = page.locator("table.compare tbody tr")
    assert compare.count() == NUM_LAYERS + 1
    for i, layer in enumerate(reversed(want["compare"]["layers"])):
        cells = compare.nth(i).locator("td").all_inner_texts()
        assert cells[0] == str(layer["layer"])
        assert cells[1] == f"{layer['difference']:+.2f}"
        assert cells[5:] == [str(r) for r in layer["ranks"]]
    # Hostile text and tokens are shown as text: nothing of it became markup.
    assert page.locator("#report img").count() == 0
    assert page.locator("table.ranks code.tok", has_text="<").count() >= 1
    # The form keeps what was asked.
    assert page.input_value("[name=rank]") == "e" and page.input_value("[name=position]") == "3"

    # The actual next tokens instead of one token; the last position has none.
    page.fill("[name=rank]", "")
    page.check("[name=rank_next]")
    submit(page, compare_a="", compare_b="", position="-1")
    last = page.locator("table.ranks tbody tr").first.locator("td").last.inner_text()
    assert last == "–" and "actual next token" in page.inner_text("#report")
    assert page.locator("table.compare").count() == 0


@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        ({"rank": "is"}, 422, "token 'is' is 2 tokens for this model"),
        ({"position": "99"}, 422, "position 99 is out of range"),
        ({"position": "two"}, 400, "is not a whole number"),
        ({"compare_a": "a"}, 400, "name both tokens to compare"),
    ],
)
def test_lens_view_errors_say_what_is_wrong(
    stack: Stack, new_page: Callable[[], Any], fields: dict[str, str], status: int, message: str
) -> None:
    page = new_page()
    sign_in(page, stack.url, "rita", "/explain")
    assert submit(page, text="hello there", **fields).status == status
    assert message in page.inner_text(".flash.error")
