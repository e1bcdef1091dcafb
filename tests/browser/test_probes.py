"""The Probes page in a real browser: evidence and plots; operators' confirmed changes."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from probes.checkpoint import checkpoint_to_bytes
from probes.probe import build_probe
from schemas import Verdict
from tests.browser.conftest import Stack, sign_in
from tests.kafka_helpers import drain, produce_raw
from tests.process_helpers import wait_until
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.scorer import Scorer
from worker.store.redis import make_redis

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def publish_with_metrics(stack: Stack, fp: Any, f1: float, auprc: float, seed: int) -> int:
    probe = build_probe(toxicity_spec(fp.hidden_size), seed=seed)
    v = stack.registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(
        probe,
        llm=fp,
        version=v,
        metrics={"prequential_f1": f1, "prequential_auprc": auprc, "layer_entropy": 0.6},
    )
    stack.registry.publish(blob, manifest, set_live=True)
    return v


@pytest.fixture
def scorer(stack: Stack) -> Iterator[Scorer]:
    s = stack.settings.model_copy(update={"metrics_port": 0, "stage_check_interval_s": 0.5})
    extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=8)
    scorer = Scorer(s, extractor, make_redis(s), metrics_port=0)
    thread = threading.Thread(target=scorer.run, daemon=True)
    thread.start()
    yield scorer
    scorer.stop()
    thread.join(30)


def chat(mid: str) -> bytes:
    return json.dumps(
        {
            "message_id": mid,
            "conversation_id": "c",
            "text": "hello there",
            "created_at": "2026-11-30T12:00:00Z",
        }
    ).encode()


def test_operator_rollback_from_the_page_reaches_the_scorers(
    stack: Stack, new_page: Callable[[], Any], scorer: Scorer, tiny_extractor: Any
) -> None:
    s = stack.settings
    v1 = stack.registry.stages().live
    v2 = publish_probe(stack.registry, tiny_extractor.fingerprint, seed=2)
    wait_until(
        lambda: scorer.watcher.versions().get("toxicity", {}).get("live") == v2,
        "the scorer to serve v2",
    )
    page = new_page()
    sign_in(page, stack.url, "otto", "/probes")
    assert page.inner_text("#live") == f"v{v2}"
    with page.expect_navigation():
        page.click("#rollback")
    assert f"Roll back live v{v2}" in page.inner_text("main")  # asked first, nothing changed
    assert stack.registry.stages().live == v2
    page.fill("input[name=reason]", "F1 dropped after <b>v2</b>")
    with page.expect_navigation():
        page.click("#confirm")
    assert f"v{v1} is live again" in page.inner_text(".flash")
    assert stack.registry.stages().live == v1 and stack.registry.stages().pinned

    wait_until(
        lambda: scorer.watcher.versions()["toxicity"]["live"] == v1,
        "the scorer to serve the restored version",
        timeout_s=15,
    )
    produce_raw(s, s.topic_chat, [(b"after-rollback", chat("after-rollback"))])
    mine = b"after-rollback"
    records = drain(s, s.topic_verdicts, lambda rs: any(r.key == mine for r in rs))
    verdict = next(Verdict.decode(r.value) for r in records if r.key == mine)
    assert verdict.results[0].version == v1

    history = page.inner_text("table.history")
    assert "rolled_back" in history and "otto (console)" in history
    assert "F1 dropped after <b>v2</b>" in history  # the reason, as text


def test_changes_are_compare_and_set_and_refusals_are_shown(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: Any
) -> None:
    fp = tiny_extractor.fingerprint
    v2 = publish_probe(stack.registry, fp, seed=2, set_live=False)
    v3 = publish_probe(stack.registry, fp, seed=4, set_live=False)
    other = fp.model_copy(update={"tokenizer_sha256": "f" * 64})
    v_other = publish_probe(stack.registry, other, seed=3, set_live=False)
    page = new_page()
    sign_in(page, stack.url, "otto", "/probes")

    def change(action: str, version: int) -> None:
        row = page.locator("table.versions tr", has=page.locator(f"td:text-is('{version}')"))
        with page.expect_navigation():
            row.get_by_role("button", name=f"{action}…").click()
        with page.expect_navigation():
            page.click("#confirm")

    change("Canary", v_other)
    assert "incompatible with live" in page.inner_text(".flash.error")
    assert stack.registry.stages().canary is None

    # The page shows the stages as they were; someone changes them before the click.
    row = page.locator("table.versions tr", has=page.locator(f"td:text-is('{v2}')"))
    with page.expect_navigation():
        row.get_by_role("button", name="Promote…").click()
    stack.registry.promote(
        v3, reason="meanwhile", actor="updater-x", expect=stack.registry.stages()
    )
    with page.expect_navigation():
        page.click("#confirm")
    assert "stages changed" in page.inner_text(".flash.error")
    assert stack.registry.stages().live == v3

    page.goto(stack.url + "/probes")
    change("Promote", v2)  # now from what the page shows: allowed
    assert f"v{v2} is live" in page.inner_text(".flash")
    events = [e for _, e in stack.registry.history(50) if e.kind == "promoted"]
    assert events[-1].actor == "otto (console)" and events[-1].version == v2


def test_plots_and_evidence_render(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: Any
) -> None:
    fp = tiny_extractor.fingerprint
    for i, (f1, auprc) in enumerate([(0.5, 0.55), (0.62, 0.6), (0.7, 0.74)]):
        publish_with_metrics(stack, fp, f1, auprc, seed=10 + i)
    page = new_page()
    sign_in(page, stack.url, "rita", "/probes")
    charts = page.locator("figure.chart")
    assert charts.count() == 5  # metrics, weights, entropy, flag rate, drift
    metrics = charts.nth(0)
    assert metrics.locator("polyline").count() == 2  # F1 and AUPRC
    assert metrics.locator("circle").count() == 2 * 3  # the first version had no metrics
    weights = charts.nth(1)
    assert weights.locator("rect.bar").count() == 2  # the tiny probe reads two layers
    assert "entropy" in weights.inner_text()


def test_the_live_versions_drift_per_layer_is_plotted_from_every_scorers_window(
    stack: Stack, new_page: Callable[[], Any], tiny_extractor: Any, tmp_path: Any
) -> None:
    """Two scorers' windows add up (a stale one and a hostile record are left out); layer 2
    is 2 training SDs off, so it is highlighted and the page warns."""
    from datetime import timedelta

    from schemas import DRIFT_BINS, DriftReference, DriftSnapshot, utcnow

    fp = tiny_extractor.fingerprint
    ref = DriftReference(
        examples=400,
        layer_mean=[1.0, 1.0],
        layer_std=[0.1, 0.1],
        score_bins=[0.5, 0.5] + [0.0] * (DRIFT_BINS - 2),
    )
    probe = build_probe(toxicity_spec(fp.hidden_size), seed=3)
    v = stack.registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(probe, llm=fp, version=v, drift=ref)
    stack.registry.publish(blob, manifest, set_live=True)
    key = stack.registry.keys.drift("toxicity", v)
    now = utcnow()

    def snap(at: Any, n: int, layer_sums: list[float], counts: list[int]) -> bytes:
        return DriftSnapshot(at=at, messages=n, layer_sum=layer_sums, score_counts=counts).encode()

    # Means over both fresh windows: layer 1 (105 + 98) / 200 = 1.015 -> 0.15 SD;
    # layer 2 (120 + 120) / 200 = 1.2 -> 2 SD. Scores: 100 + 100 in bins 0 and 1, as trained.
    stack.registry.client.hset(
        key,
        mapping={
            "scorer-a": snap(now, 100, [105.0, 120.0], [50, 50] + [0] * 8),
            "scorer-b": snap(now, 100, [98.0, 120.0], [50, 50] + [0] * 8),
            "scorer-old": snap(now - timedelta(hours=1), 100, [900.0, 900.0], [0] * 9 + [100]),
            "scorer-evil": b'{"<script>alert(1)</script>": 1}',
        },
    )
    page = new_page()
    sign_in(page, stack.url, "otto", "/probes")
    figure = page.locator("figure", has_text=f"Input drift of v{v} per layer")
    text = figure.inner_text()
    assert "200 recent messages from 2 scorer(s)" in text
    assert "score PSI 0.000" in text
    bars = figure.locator("rect")
    assert bars.count() == 2
    assert figure.locator("rect.hi").count() == 1  # layer 2 only
    assert figure.locator("rect.hi title").text_content() == "2: 2.00"
    assert "drifted from this version's training data" in page.inner_text("main")
    assert "<script>" not in page.content().split("</head>")[1]
    page.set_viewport_size({"width": 1280, "height": 900})
    figure.scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "console-drift.png"), full_page=True)


def test_before_any_version_the_page_shows_the_packaged_default_as_v0(
    console_settings: Any,
    redis_ns: Any,
    users: Any,
    tiny_extractor: HiddenStateExtractor,
    new_page: Callable[[], Any],
) -> None:
    """Before: ``live none`` while every scorer served the packaged default as v0."""
    from worker.console.server import ConsoleServer
    from worker.rollout.status import before_live

    settings = console_settings.model_copy(update={"probes": "moderation"})
    server = ConsoleServer(
        settings, extractor=tiny_extractor, users=users, secret_key=b"k" * 32
    ).start()
    try:
        page = new_page()
        sign_in(page, server.url, "otto", "/probes")
        before = before_live(settings)
        assert before.version == 0
        assert page.locator("#live").inner_text() == "v0"
        shown = page.locator("#before-live").inner_text()
        assert shown == (
            f"({before.source}, {len(before.heads)} heads, until a version is published)"
        ), shown
        assert page.locator("h1").inner_text() == "moderation"
    finally:
        server.stop()
