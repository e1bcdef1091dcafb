"""The configuration page is what ``python -m worker.settings_doc`` generates."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_is_generated() -> None:
    from worker.settings_doc import PAGE, render

    assert PAGE == ROOT / "docs" / "configuration.md"
    assert PAGE.read_text() == render(), (
        "docs/configuration.md differs from worker/settings.py: regenerate it with "
        "`python -m worker.settings_doc` (and commit it)"
    )
