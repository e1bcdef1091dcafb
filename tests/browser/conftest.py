"""Browser tests: a real Chromium (Debian's ``chromium``, driven by Playwright) against the
console served by uvicorn, on the real broker and Redis fixtures.

Playwright never downloads a browser here: it launches ``/usr/bin/chromium``
(``PROBEGUARD_TEST_CHROMIUM`` overrides). Without it the tests skip, except under CI
(``CI=true``), where a missing browser fails: ``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from schemas import ReviewRequest, utcnow
from tests.conftest import RedisNamespace
from tests.kafka_helpers import produce_raw
from tests.registry_helpers import publish_probe
from worker.console.auth import User, hash_password
from worker.console.server import ConsoleServer
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORDS = {"rita": "rita-reviews-a-lot", "rob": "rob-reviews-too", "otto": "otto-operates-it"}
ROLES = {"rita": "reviewer", "rob": "reviewer", "otto": "operator"}


def chromium_path() -> str | None:
    path = os.environ.get("PROBEGUARD_TEST_CHROMIUM") or shutil.which("chromium")
    return path if path and os.access(path, os.X_OK) else None


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it: apt-get install chromium)")
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chrome = pw.chromium.launch(executable_path=path, args=FLAGS)
        try:
            yield chrome
        finally:
            chrome.close()


@pytest.fixture(scope="session")
def tiny_extractor() -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=1)


@pytest.fixture
def users() -> dict[str, User]:
    # scrypt's smallest accepted cost: the tests sign in often.
    return {
        name: User(name, ROLES[name], hash_password(pw, n=2**10))  # type: ignore[arg-type]
        for name, pw in PASSWORDS.items()
    }


@dataclass
class Stack:
    settings: Settings
    server: ConsoleServer
    registry: CheckpointRegistry
    url: str

    def review(
        self,
        n: int,
        *,
        texts: Callable[[int], str] | None = None,
        tag: str = "m",
        reply_to: str | None = None,
    ) -> list[str]:
        """Put ``n`` review requests on the review topic (``reply_to``: model replies to that
        message); returns their message ids."""
        ids = [f"{tag}-{uuid.uuid4().hex[:6]}-{i}" for i in range(n)]
        records = []
        for i, mid in enumerate(ids):
            req = ReviewRequest(
                message_id=mid,
                conversation_id=f"c-{i}",
                text=texts(i) if texts else f"message number {i}: is this ok?",
                probe=self.registry.probe,
                version=self.registry.stages().live or 0,
                scores={"ok": 0.5, "toxic": 0.5},
                reason="uncertain" if i % 3 else "audit",
                created_at=utcnow(),
                reply_to=reply_to,
            )
            records.append((mid.encode(), req.encode()))
        produce_raw(self.settings, self.settings.topic_review, records)
        return ids


@pytest.fixture
def console_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "group_console": f"console-{uuid.uuid4().hex[:8]}",
            "console_port": 0,
            "console_undo_s": 0.5,
            "console_claim_ttl_s": 30,
            "probes": "toxicity",
            "topic_partitions": 2,
        }
    )


@pytest.fixture
def stack(
    console_settings: Settings,
    redis_ns: RedisNamespace,
    users: dict[str, User],
    tiny_extractor: HiddenStateExtractor,
) -> Iterator[Stack]:
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "toxicity")
    publish_probe(registry, tiny_extractor.fingerprint, seed=1)
    server = ConsoleServer(
        console_settings, extractor=tiny_extractor, users=users, secret_key=b"k" * 32
    ).start()
    queue = server.console.queue
    assert queue is not None and queue.ready.wait(30), "the console's consumer never joined"
    try:
        yield Stack(console_settings, server, registry, server.url)
    finally:
        server.stop()


@pytest.fixture
def new_page(browser: Any) -> Iterator[Callable[[], Any]]:
    """Pages in fresh browser contexts (separate cookies: separate people)."""
    contexts: list[Any] = []

    def make() -> Any:
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(ctx)
        return ctx.new_page()

    yield make
    for ctx in contexts:
        ctx.close()


def sign_in(page: Any, url: str, user: str, next_path: str = "/review") -> None:
    page.goto(f"{url}{next_path}")
    page.fill('input[name="username"]', user)
    page.fill('input[name="password"]', PASSWORDS[user])
    page.click('button[type="submit"]')
    page.wait_for_url(f"{url}{next_path}*")
