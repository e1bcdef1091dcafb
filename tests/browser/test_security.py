"""Authentication, roles, CSRF and the Content-Security-Policy, in a real browser."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import SecretStr

from tests.browser.conftest import Stack, sign_in
from tests.registry_helpers import publish_probe

pytestmark = [pytest.mark.browser, pytest.mark.integration]

PAGES = ["/review", "/probes", "/explain", "/"]
POSTS = [
    "/review/answer",
    "/review/skip",
    "/review/undo",
    "/review/heartbeat",
    "/probes/change",
    "/explain",
    "/logout",
]


def csrf_of(page: Any) -> str:
    return str(page.get_attribute('meta[name="csrf-token"]', "content"))


def test_every_page_and_change_needs_a_session(stack: Stack, new_page: Callable[[], Any]) -> None:
    page = new_page()
    for path in PAGES:
        page.goto(stack.url + path)
        assert "/login" in page.url, f"{path} served without a session"
        assert page.locator("input[name=password]").count() == 1
    for path in POSTS:
        r = page.request.post(
            stack.url + path, form={"item": "x", "probe": "toxicity", "action": "pin"}
        )
        assert r.status == 401, f"POST {path} without a session answered {r.status}"
    assert not stack.registry.stages().pinned
    assert page.request.get(stack.url + "/static/console.js").ok  # assets need no session


def test_wrong_passwords_are_refused_and_throttled(
    stack: Stack, new_page: Callable[[], Any]
) -> None:
    page = new_page()
    page.goto(stack.url + "/login")
    for _ in range(5):
        page.fill("input[name=username]", "otto")
        page.fill("input[name=password]", "not-the-password")
        with page.expect_navigation():
            page.click("button[type=submit]")
        assert "wrong password" in page.inner_text("main")
    page.fill("input[name=username]", "otto")
    page.fill("input[name=password]", "otto-operates-it")  # right, but too late
    with page.expect_navigation() as nav:
        page.click("button[type=submit]")
    assert nav.value.status == 429 and "too many failed attempts" in page.inner_text("main")
    page.goto(stack.url + "/probes")
    assert "/login" in page.url


def test_a_reviewer_cannot_change_stages(stack: Stack, new_page: Callable[[], Any]) -> None:
    live = stack.registry.stages().live
    page = new_page()
    sign_in(page, stack.url, "rita", "/probes")
    assert page.locator("#rollback").count() == 0
    assert page.get_by_role("button", name="Promote…").count() == 0
    assert "operator role" in page.inner_text("main")
    events = len(stack.registry.history(100))
    for action in ("rollback", "promote", "pin"):
        r = page.request.post(
            stack.url + "/probes/change",
            form={
                "csrf": csrf_of(page),
                "probe": "toxicity",
                "action": action,
                "version": str(live),
                "confirm": "true",
                "seen_live": str(live),
            },
        )
        assert r.status == 403, f"a reviewer's {action} answered {r.status}"
        assert "operator role" in r.text()
    assert stack.registry.stages().live == live and not stack.registry.stages().pinned
    assert len(stack.registry.history(100)) == events


def test_state_changes_need_the_csrf_token_and_this_origin(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: Any
) -> None:
    publish_probe(stack.registry, tiny_extractor.fingerprint, seed=5, set_live=False)
    page = new_page()
    sign_in(page, stack.url, "otto", "/probes")
    form = {"probe": "toxicity", "action": "pin", "confirm": "true"}
    r = page.request.post(stack.url + "/probes/change", form=form)
    assert r.status == 403 and "CSRF" in r.text()
    r = page.request.post(stack.url + "/probes/change", form={**form, "csrf": "forged"})
    assert r.status == 403
    r = page.request.post(
        stack.url + "/probes/change",
        form={**form, "csrf": csrf_of(page)},
        headers={"Origin": "https://evil.example"},
    )
    assert r.status == 403 and "cross-origin" in r.text()
    assert not stack.registry.stages().pinned
    r = page.request.post(stack.url + "/probes/change", form={**form, "csrf": csrf_of(page)})
    assert r.ok and stack.registry.stages().pinned  # the same request, with the token


def test_headers_and_cookie(stack: Stack, new_page: Callable[[], Any]) -> None:
    page = new_page()
    response = page.goto(stack.url + "/login")
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp and "unsafe" not in csp
    assert "frame-ancestors 'none'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    sign_in(page, stack.url, "rita")
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    # The policy is enforced: an inline script injected into the page does not run.
    page.evaluate(
        "() => { const s = document.createElement('script');"
        " s.textContent = 'window.__inline = 1'; document.body.appendChild(s); }"
    )
    assert page.evaluate("window.__inline") is None


def test_redis_down_is_a_clear_503_not_a_stack_trace(
    console_settings: Any, users: Any, tiny_extractor: Any, new_page: Callable[[], Any]
) -> None:
    import socket

    from worker.console.server import ConsoleServer

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = console_settings.model_copy(
        update={"redis_url": SecretStr(f"redis://127.0.0.1:{port}/0"), "redis_retries": 0}
    )
    server = ConsoleServer(
        s, extractor=tiny_extractor, users=users, secret_key=b"k" * 32, review=False
    ).start()
    try:
        page = new_page()
        page.goto(f"{server.url}/probes")
        page.fill('input[name="username"]', "otto")
        page.fill('input[name="password"]', "otto-operates-it")
        with page.expect_navigation() as nav:  # sessions live in Redis: sign-in needs it
            page.click('button[type="submit"]')
        assert nav.value is not None and nav.value.status == 503
        assert "Redis is unreachable" in page.inner_text("main")
        assert "Traceback" not in page.content() and str(port) not in page.content()
    finally:
        server.stop()
