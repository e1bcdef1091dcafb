"""A Redis that hangs while a reviewer has the review page open, in a real browser."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from pydantic import SecretStr

from tests.browser.conftest import Stack, sign_in
from tests.registry_helpers import publish_probe
from worker.console.auth import User
from worker.console.server import ConsoleServer
from worker.embedded import EmbeddedRedis
from worker.llm.extract import HiddenStateExtractor
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import Keys

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def test_the_review_page_warns_while_redis_hangs_and_a_key_press_fails_fast(
    console_settings: Settings,
    users: dict[str, User],
    tiny_extractor: HiddenStateExtractor,
    new_page: Callable[[], Any],
) -> None:
    """F4 / F6: an open review page showed nothing while Redis hung (failed claim renewals
    were ignored) and a key press waited 40 s for a 503. Now a banner says so within a
    renewal or two and goes once renewals succeed again; a key press meanwhile gets the
    503 page within seconds, and that page comes back to the item by itself."""
    with EmbeddedRedis() as server:
        s = console_settings.model_copy(
            update={
                "redis_url": SecretStr(server.url),
                "redis_prefix": "outage",
                "console_claim_ttl_s": 6,  # renewals every 2 s
                "console_explain": False,
            }
        )
        client = redis.Redis.from_url(server.url, protocol=2)
        registry = CheckpointRegistry(client, Keys("outage"), "toxicity")
        publish_probe(registry, tiny_extractor.fingerprint, seed=1)
        console = ConsoleServer(s, users=users, secret_key=b"k" * 32).start()
        try:
            queue = console.console.queue
            assert queue is not None and queue.ready.wait(30)
            Stack(s, console, registry, console.url).review(1)
            page = new_page()
            sign_in(page, console.url, "rita")
            page.wait_for_selector("#item", timeout=30_000)
            banner = page.locator("#offline")
            assert banner.is_hidden()

            server.signal(signal.SIGSTOP)
            try:
                banner.wait_for(state="visible", timeout=10_000)
                assert "cannot reach Redis" in banner.inner_text()
            finally:
                server.signal(signal.SIGCONT)
            banner.wait_for(state="hidden", timeout=10_000)  # renewed again: the note goes
            assert page.locator("#item").count() == 1

            server.signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with page.expect_navigation() as nav:
                    page.keyboard.press("1")
                took = time.monotonic() - t0
                assert nav.value is not None and nav.value.status == 503
                assert "Redis is unreachable" in page.inner_text("main")
                assert took < 5.0, f"the 503 came after {took:.1f} s"
            finally:
                server.signal(signal.SIGCONT)
            page.wait_for_selector("#item", timeout=15_000)  # the 503 page tried again
            assert page.url.endswith("/review")
        finally:
            console.stop()
            client.close()
