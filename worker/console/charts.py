"""Plots as SVG geometry: numbers computed here, drawn by ``templates/_charts.html``.

No plotting library in the request path and nothing from the registry inside markup:
the template receives coordinates (floats) and labels (escaped by Jinja like any text),
and the page's strict Content-Security-Policy allows it as it is (no inline style or
script; colours come from the stylesheet by class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["BarChart", "LineChart", "bar_chart", "line_chart"]

W, H = 560, 200  # viewBox; the SVG scales to the page width
PAD_L, PAD_R, PAD_T, PAD_B = 52, 12, 12, 28


@dataclass
class Series:
    name: str
    css: str  # class: s0, s1, ...
    path: str  # "x,y x,y ..." for <polyline points>
    dots: list[tuple[float, float, str]]  # x, y, tooltip


@dataclass
class LineChart:
    series: list[Series]
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]
    x_label: str
    empty: bool
    width: int = W
    height: int = H
    left: int = PAD_L  # where the plot area starts (y tick labels end just before it)


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    label: str
    value: str
    css: str = "bar"


@dataclass
class BarChart:
    bars: list[Bar]
    y_ticks: list[tuple[float, str]]
    empty: bool
    width: int = W
    height: int = H
    labels: list[tuple[float, str]] = field(default_factory=list)
    left: int = PAD_L


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _y(v: float, lo: float, hi: float) -> float:
    span = hi - lo or 1.0
    return round(H - PAD_B - (v - lo) / span * (H - PAD_T - PAD_B), 1)


def _nice(hi: float) -> tuple[float, float]:
    """A round top for the axis and its tick step (1, 2, 2.5 or 5 times a power of ten)."""
    if not hi > 0:
        return 1.0, 0.25
    raw = hi / 4
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw * (1 - 1e-9))
    return step * math.ceil(hi / step - 1e-9), step


def _ticks(lo: float, hi: float, step: float, fmt: str) -> list[tuple[float, str]]:
    n = max(1, round((hi - lo) / step))
    return [(_y(lo + k * step, lo, hi), format(lo + k * step, fmt)) for k in range(n + 1)]


def line_chart(
    xs: list[int],
    series: dict[str, list[float | None]],
    *,
    x_label: str = "version",
    y_range: tuple[float, float] | None = None,
    fmt: str = ".2f",
) -> LineChart:
    """One line per series over shared integer ``xs`` (missing values leave gaps)."""
    values = [v for vs in series.values() for v in vs if v is not None and _finite(v)]
    if not xs or not values:
        return LineChart([], [], [], x_label, True)
    if y_range is not None:
        lo, hi = y_range
        y_step = (hi - lo) / 4
    else:
        lo = min(0.0, min(values))
        top, y_step = _nice(max(values) - lo)
        hi = lo + top
    x0, x1 = min(xs), max(xs)
    span = (x1 - x0) or 1

    def x_of(x: int) -> float:
        return round(PAD_L + (x - x0) / span * (W - PAD_L - PAD_R), 1)

    out = []
    for i, (name, vs) in enumerate(series.items()):
        pts = [
            (x_of(x), _y(v, lo, hi), f"v{x}: {v:{fmt}}")
            for x, v in zip(xs, vs, strict=True)
            if v is not None and _finite(v)
        ]
        out.append(Series(name, f"s{i}", " ".join(f"{x},{y}" for x, y, _ in pts), pts))
    step = max(1, len(xs) // 8)
    x_ticks = [(x_of(x), str(x)) for x in xs[::step]]
    return LineChart(out, x_ticks, _ticks(lo, hi, y_step, fmt), x_label, False)


def bar_chart(
    items: list[tuple[str, float | None]],
    *,
    y_max: float | None = None,
    fmt: str = ".2f",
    highlight: set[str] | None = None,
) -> BarChart:
    """Vertical bars, one per ``(label, value)``; missing values draw nothing."""
    values = [v for _, v in items if v is not None and _finite(v)]
    if not items or not values:
        return BarChart([], [], True)
    hi, y_step = _nice(y_max or max(values))
    slot = (W - PAD_L - PAD_R) / len(items)
    bars, labels = [], []
    every = max(1, len(items) // 12)
    for i, (label, v) in enumerate(items):
        x = PAD_L + i * slot
        if i % every == 0:
            labels.append((round(x + slot / 2, 1), label))
        if v is None or not _finite(v):
            continue
        top = _y(v, 0.0, hi)
        css = "bar hi" if highlight and label in highlight else "bar"
        bars.append(
            Bar(
                round(x + slot * 0.15, 1),
                top,
                round(slot * 0.7, 1),
                round(H - PAD_B - top, 1),
                label,
                format(v, fmt),
                css,
            )
        )
    return BarChart(bars, _ticks(0.0, hi, y_step, fmt), False, labels=labels)
