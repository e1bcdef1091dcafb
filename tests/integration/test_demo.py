"""A short demo end to end: real broker and Redis, tiny model, report written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import RedisNamespace
from tests.report_checks import check_report_agrees
from worker.demo.run import DemoOptions, default_data, run_demo
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.offline.labeled import read_labeled
from worker.settings import Settings

pytestmark = pytest.mark.integration


def test_packaged_demo_set_is_valid() -> None:
    rows = read_labeled(default_data())
    assert len(rows) >= 100
    assert {r.label for r in rows} == {"toxic", "non-toxic"}


def test_short_demo_writes_a_report(
    settings: Settings, redis_ns: RedisNamespace, tmp_path: Path
) -> None:
    data = tmp_path / "stream.jsonl"
    lines = []
    for i in range(48):
        text, label = (
            (f"XXXX ZZZZ QQQQ {i}!!!", "toxic")
            if i % 3 == 0
            else (f"what a lovely day number {i}", "non-toxic")
        )
        lines.append(json.dumps({"id": f"r{i}", "text": text, "label": label}))
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report"
    opts = DemoOptions(
        data=data, repeat=1, rate=0, label_share=0.75, label_delay_s=0.2, out=out, timeout_s=240
    )
    extractor = HiddenStateExtractor(make_tiny_llm(), max_tokens=64, batch_size=16)
    figures, page = run_demo(settings, opts, extractor, tty=False)

    assert page == out / "index.html" and page.exists()
    for name in (
        "learning.png",
        "latency.png",
        "throughput.png",
        "confusion.png",
        "layer_weights.png",
        "class_layers.png",
        "figures.json",
        "probe-spec.json",
    ):
        assert (out / name).stat().st_size > 0, name
    assert figures["messages"] == 48 and figures["verdicts"] == 48
    assert figures["labels"] == 36 and figures["dead_letters"] == 0
    assert figures["versions"], "the updater published no version"
    assert figures["versions"][-1]["labels_seen"] >= 36 - 1
    saved = check_report_agrees(out)  # the headline's served F1 is what the plots draw
    assert saved["verdicts"] == 48 and saved["served_f1"] == figures["served_f1"]
    assert saved["judged"] == len(figures["served"]) == 36
    assert saved["origin"] == {"version": 1, "source": "trained from zero", "labels_seen": 0}
    # The learning plot's x-axis counts this run's labels (no default before it here).
    assert [p["labels"] for p in saved["versions"]] == [p["labels_seen"] for p in saved["versions"]]
    assert "learning.png" in page.read_text()
    use = saved["class_layers"]  # per-class layer use over the replay buffer
    assert use["labels"] == ["non-toxic", "toxic"] and sum(use["rows"]) > 0
    assert all(len(row) == len(use["layers"]) for row in use["shares"])
