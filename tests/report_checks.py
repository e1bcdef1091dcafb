"""Checks that a written demo report agrees with itself: the served F1 its headline table
shows (read back from ``index.html``) is what its plots are drawn from (``figures.json``
through the report's own plot inputs), recomputed from the counts, never a fixed value."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from worker.demo import report
from worker.demo.quality import Cells


class _Table(HTMLParser):
    """The cells of ``<table id="served">``, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._inside = self._cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and ("id", "served") in attrs:
            self._inside = True
        elif self._inside and tag == "tr":
            self.rows.append([])
        elif self._inside and tag in ("td", "th"):
            self._cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._inside = False
        elif tag in ("td", "th"):
            self._cell = False

    def handle_data(self, data: str) -> None:
        if self._inside and self._cell:
            self.rows[-1][-1] += data


def headline(page: Path) -> list[list[str]]:
    """The served-quality table as shown: a header, then one row per line."""
    parser = _Table()
    parser.feed(page.read_text())
    return parser.rows


def _shown(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _sum(cells: list[dict[str, int]]) -> Cells:
    total = Cells()
    for c in cells:
        total += Cells.of(c)
    return total


def check_report_agrees(out: Path) -> dict[str, Any]:
    """Assert that ``out/index.html``'s served F1 (all, first half, second half; the flag
    policy and each head) is the F1 of the confusion matrices the report plots and of the
    windows the learning plot draws, half by half. Returns the figures."""
    figures = json.loads((out / "figures.json").read_text())
    q = figures["quality"]
    rows = headline(out / "index.html")
    assert rows[0][2:] == ["served F1", "first half", "second half"], rows[0]
    body = rows[1:]
    assert len(body) == 1 + len(q["heads"]), body
    # The confusion plot draws these matrices; the learning plot these windows.
    matrices = report._matrices(figures)
    windows = q["windows"]
    assert [w["half"] for w in windows] == sorted(w["half"] for w in windows)
    for i, row in enumerate(body):
        title, labels, cols, counts = matrices[i]
        if i == 0:  # the flag policy: [[tn, fp], [fn, tp]]
            (tn, fp), (fn, tp) = counts
            key = None
        else:
            head = q["heads"][i - 1]
            assert title == f"head {head['name']}"
            flags = head["flag_labels"]
            tp = sum(
                v
                for a, r in zip(labels, counts, strict=True)
                for b, v in zip(cols, r, strict=True)
                if a in flags and b in flags
            )
            fp = sum(
                v
                for a, r in zip(labels, counts, strict=True)
                for b, v in zip(cols, r, strict=True)
                if a not in flags and b in flags
            )
            fn = sum(
                v
                for a, r in zip(labels, counts, strict=True)
                for b, v in zip(cols, r, strict=True)
                if a in flags and b not in flags
            )
            tn = sum(map(sum, counts)) - tp - fp - fn
            key = head["name"]
        from_matrix = Cells(tp=tp, fp=fp, fn=fn, tn=tn)
        plotted = [w["policy"] if key is None else w["heads"][key] for w in windows]
        halves = [
            _sum([c for w, c in zip(windows, plotted, strict=True) if w["half"] == h])
            for h in (1, 2)
        ]
        assert _sum(plotted) == from_matrix, (row, from_matrix)  # the windows add up
        assert int(row[1]) == from_matrix.n, row
        assert row[2:] == [_shown(from_matrix.f1), _shown(halves[0].f1), _shown(halves[1].f1)], row
    return figures
