"""``probeguard demo --console``: the console serves the demo's queue and probe."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from tests.browser.conftest import PASSWORDS, sign_in
from tests.process_helpers import wait_until
from worker.console.auth import hash_password
from worker.demo.run import DemoOptions, run_demo
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.settings import Settings

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def test_demo_serves_the_console_until_interrupted(
    settings: Settings,
    tmp_path: Path,
    new_page: Callable[[], Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "stream.jsonl"
    rows = [
        {
            "id": f"r{i}",
            "text": f"message {i} " + ("XXXX ZZZZ" if i % 3 == 0 else "hello"),
            "label": "toxic" if i % 3 == 0 else "non-toxic",
        }
        for i in range(30)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    entry = f"otto:operator:{hash_password(PASSWORDS['otto'], n=2**10)}"
    configured = settings.model_copy(
        update={"console_port": 0, "console_undo_s": 0.0, "console_users": SecretStr(entry)}
    )
    opts = DemoOptions(
        data=data,
        repeat=1,
        rate=0,
        label_share=0.5,
        label_delay_s=0.2,
        out=tmp_path / "report",
        timeout_s=240,
        console=True,
    )
    extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=16)
    interrupted = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        result["figures"], result["page"] = run_demo(
            configured, opts, extractor, interrupted=interrupted, tty=False
        )

    demo = threading.Thread(target=run, daemon=True)
    demo.start()
    printed: list[str] = []

    def url() -> str | None:
        printed.append(capsys.readouterr().out)
        m = re.search(r"console: (http://\S+)", "".join(printed))
        return m.group(1) if m else None

    try:
        wait_until(lambda: url() is not None, "the demo to print the console's address", 120)
        base = url()
        assert base is not None
        page = new_page()
        sign_in(page, base, "otto")
        page.wait_for_selector("#item", timeout=60_000)  # the scorer queues items to review
        with page.expect_navigation():
            page.keyboard.press("1")
        assert "(u undoes" not in page.inner_text(".flash")  # undo window 0: sent at once
        page.goto(base + "/probes")
        assert page.locator("h1").inner_text() == "demo"

        def versions_shown() -> bool:
            page.reload()
            return page.locator("table.versions tbody tr").count() > 0

        wait_until(versions_shown, "the demo's probe versions on the page", 60)
        assert demo.is_alive(), "with --console the demo waits for Ctrl-C"
    finally:
        interrupted.set()
        demo.join(120)
    assert not demo.is_alive()
    assert result["figures"]["messages"] == 30 and result["page"].exists()
