"""The review queue in a real browser: keyboard labeling, claims, hostile text."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from schemas import HumanLabel
from tests.browser.conftest import Stack, sign_in
from tests.kafka_helpers import committed_total, drain
from tests.process_helpers import Threaded, wait_until
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.store.redis import Keys, make_redis

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def shown_id(page: Any) -> str:
    return str(page.get_attribute("#item", "data-item")).split(":", 1)[1]


def committed(stack: Stack) -> int:
    """Offsets the console's group has committed on the review topic, summed."""
    s = stack.settings
    return committed_total(s, s.group_console, s.topic_review)


def test_twenty_labels_by_keyboard_reach_the_topic_and_the_updater(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: HiddenStateExtractor
) -> None:
    s = stack.settings.model_copy(
        update={
            "stats_warmup": 4,
            "publish_every_labels": 8,
            "publish_every_s": 1.0,
            "metrics_port": 0,
            "train_probe": "toxicity",
        }
    )
    updater = Updater(s, tiny_extractor, make_redis(s), worker_id="updater")
    running = Threaded(updater.run, updater.stop)
    try:
        ids = stack.review(20)
        page = new_page()
        sign_in(page, stack.url, "rita")
        answers: dict[str, str] = {}
        for i in range(20):
            page.wait_for_selector("#item")
            mid = shown_id(page)
            assert mid not in answers, f"{mid} was offered twice"
            key = "2" if i % 2 else "1"  # 1 = ok, 2 = toxic (the probe's label order)
            with page.expect_navigation():
                page.keyboard.press(key)
            answers[mid] = "toxic" if key == "2" else "ok"
        assert set(answers) == set(ids)
        page.wait_for_selector("#empty")

        labels = drain(s, s.topic_labels, lambda rs: len(rs) >= 20, timeout_s=30)
        time.sleep(1.0)  # anything beyond the 20 would have arrived by now
        labels = drain(s, s.topic_labels, lambda rs: len(rs) > 20, timeout_s=2)
        decoded = [HumanLabel.decode(r.value) for r in labels]
        assert len(decoded) == 20
        assert {lb.message_id: lb.label for lb in decoded} == answers
        assert {lb.labeler_id for lb in decoded} == {"rita"}
        assert all(lb.text for lb in decoded)
        wait_until(
            lambda: updater.labels_seen == 20,
            "the updater to learn the 20 labels",
            timeout_s=60,
        )
        wait_until(lambda: committed(stack) == 20, "the console to commit the review offsets")
    finally:
        running.stop()


def test_two_reviewers_never_see_the_same_item(stack: Stack, new_page: Callable[[], Any]) -> None:
    ids = stack.review(12)
    rita, rob = new_page(), new_page()
    sign_in(rita, stack.url, "rita")
    sign_in(rob, stack.url, "rob")
    seen: dict[str, str] = {}
    for _ in range(6):
        rita.wait_for_selector("#item")
        rob.wait_for_selector("#item")
        a, b = shown_id(rita), shown_id(rob)
        assert a != b, f"both reviewers were shown {a}"
        rita.reload()  # a reload keeps the reviewer's own item, never the other's
        assert shown_id(rita) == a
        for page, mid, who in ((rita, a, "rita"), (rob, b, "rob")):
            assert mid not in seen, f"{mid} shown to {seen.get(mid)} and then to {who}"
            seen[mid] = who
            with page.expect_navigation():
                page.keyboard.press("1")
    assert set(seen) == set(ids)
    assert sorted(seen.values()).count("rita") == 6
    for page in (rita, rob):
        page.wait_for_selector("#empty")


def test_skip_hands_the_item_to_the_other_reviewer_and_undo_takes_an_answer_back(
    stack: Stack, new_page: Callable[[], Any]
) -> None:
    s = stack.settings
    first, second = stack.review(2)
    rita, rob = new_page(), new_page()
    sign_in(rita, stack.url, "rita")
    rita.wait_for_selector("#item")
    skipped = shown_id(rita)
    with rita.expect_navigation():
        rita.keyboard.press("s")
    other = shown_id(rita)
    assert other != skipped
    sign_in(rob, stack.url, "rob")
    assert shown_id(rob) == skipped  # free again, and rob had not skipped it

    # rita answers "toxic", takes it back within the undo window, answers "ok".
    with rita.expect_navigation():
        rita.keyboard.press("2")
    with rita.expect_navigation():
        rita.keyboard.press("u")
    assert shown_id(rita) == other
    with rita.expect_navigation():
        rita.keyboard.press("1")
    with rob.expect_navigation():
        rob.keyboard.press("2")
    labels = drain(s, s.topic_labels, lambda rs: len(rs) >= 2, timeout_s=20)
    time.sleep(1.0)
    labels = drain(s, s.topic_labels, lambda rs: len(rs) > 2, timeout_s=2)
    got = {HumanLabel.decode(r.value).message_id: HumanLabel.decode(r.value) for r in labels}
    assert len(labels) == 2  # the undone answer never left the console
    assert got[other].label == "ok" and got[other].labeler_id == "rita"
    assert got[skipped].label == "toxic" and got[skipped].labeler_id == "rob"
    assert {first, second} == set(got)


def test_keyboard_only_without_shortcuts(stack: Stack, new_page: Callable[[], Any]) -> None:
    """Tab to an answer and press Enter: the page works without its key bindings too."""
    s = stack.settings
    (mid,) = stack.review(1)
    page = new_page()
    sign_in(page, stack.url, "rita")
    page.wait_for_selector("#item")
    for _ in range(30):
        page.keyboard.press("Tab")
        focused = page.evaluate("document.activeElement.value")
        if focused == "toxic":
            break
    else:
        pytest.fail("Tab never reached the 'toxic' button")
    with page.expect_navigation():
        page.keyboard.press("Enter")
    (record,) = drain(s, s.topic_labels, lambda rs: len(rs) >= 1, timeout_s=20)
    label = HumanLabel.decode(record.value)
    assert (label.message_id, label.label) == (mid, "toxic")


XSS = (
    '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    "<b>bold?</b> &amp; \"quotes\" 'single'"
)


def test_hostile_text_shows_as_text_and_runs_nothing(
    stack: Stack, new_page: Callable[[], Any]
) -> None:
    stack.review(1, texts=lambda _: XSS)
    page = new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, stack.url, "rita")
    page.wait_for_selector("#item")
    assert page.inner_text("#message") == XSS  # every character, as characters
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#message script, #message img, #message b").count() == 0
    # Tokens of the text in the explanation are text too.
    assert page.locator("code.tok img, code.tok script").count() == 0
    # The same text on the explain page.
    page.goto(f"{stack.url}/explain")
    page.fill("textarea[name=text]", XSS)
    with page.expect_navigation():
        page.click("#explain-form button[type=submit]")
    assert page.inner_text("#report blockquote.message") == XSS
    assert page.evaluate("window.__pwned") is None
    assert not errors


def test_a_models_reply_is_shown_under_the_message_it_answers(
    stack: Stack, new_page: Callable[[], Any], tmp_path: Any
) -> None:
    s = stack.settings
    client = make_redis(s)
    client.set(Keys(s.redis_prefix).text("p-1"), XSS.encode())  # the prompt, as a guard wrote it
    stack.review(1, texts=lambda _: "Sure, here is how.", reply_to="p-1")
    stack.review(1, texts=lambda _: "And the cache forgot this one's prompt.", reply_to="p-gone")
    page = new_page()
    sign_in(page, stack.url, "rita")
    page.wait_for_selector("#item")
    seen = {}
    for _ in range(2):
        page.wait_for_selector("#item")
        note = page.inner_text("#reply-note")
        seen[page.inner_text("#message")] = note
        if page.locator("#prompt").count():
            assert page.inner_text("#prompt") == XSS  # hostile text shows as text
            assert page.evaluate("window.__pwned") is None
            page.screenshot(path=str(tmp_path / "review-reply.png"), full_page=True)
        with page.expect_navigation():
            page.keyboard.press("s")
    assert "message p-1, which said:" in seen["Sure, here is how."]
    assert "no longer cached" in seen["And the cache forgot this one's prompt."]


def test_multilabel_probe_toggles_with_digits_and_submits_with_enter(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: HiddenStateExtractor
) -> None:
    from probes.probe import build_probe
    from schemas import ProbeSpec
    from tests.registry_helpers import publish_probe

    spec = ProbeSpec(
        name="toxicity",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=tiny_extractor.hidden_size,
        task="multilabel",
        labels=["insult", "threat", "spam"],
        flag_labels=["insult", "threat"],
    )
    publish_probe(stack.registry, tiny_extractor.fingerprint, probe=build_probe(spec, seed=3))
    s = stack.settings
    (mid,) = stack.review(1)
    page = new_page()
    sign_in(page, stack.url, "rita")
    page.wait_for_selector("#item")
    assert page.locator("input[type=checkbox][name=label]").count() == 3
    page.keyboard.press("1")
    page.keyboard.press("3")
    page.keyboard.press("3")  # toggled off again
    page.keyboard.press("2")
    with page.expect_navigation():
        page.keyboard.press("Enter")
    (record,) = drain(s, s.topic_labels, lambda rs: len(rs) >= 1, timeout_s=20)
    label = HumanLabel.decode(record.value)
    assert label.message_id == mid and label.label is None
    assert label.labels == ["insult", "threat"]
