"""Report plots (matplotlib, headless)."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from probes.files import atomic_write

__all__ = [
    "figure",
    "plot_class_layers",
    "plot_layer_curve",
    "plot_layer_scores",
    "plot_layer_weights",
    "plot_token_weights",
]


@contextmanager
def figure(path: Path, figsize: tuple[float, float]) -> Iterator[tuple[Any, Any]]:
    """``(fig, ax)`` on the headless backend; saved to ``path`` as PNG when the block
    completes, closed in any case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, dpi=120)
    try:
        yield fig, ax
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
        atomic_write(path, png.getvalue())  # owner-only, like every file probeguard writes
    finally:
        plt.close(fig)


def plot_layer_weights(
    layers: list[int], weights: list[float], path: Path, *, title: str = ""
) -> Path:
    """Bar chart of the probe's layer weights (hidden-state index on x), saved as PNG."""
    entropy = -sum(w * math.log(w) for w in weights if w > 0)
    uniform = math.log(len(weights)) if len(weights) > 1 else 0.0
    with figure(path, (max(4.0, 0.25 * len(layers) + 2), 3.2)) as (_, ax):
        ax.bar(range(len(layers)), weights, color="#4472c4")
        ax.set_xticks(range(len(layers)), [str(i) for i in layers])
        if len(weights) > 1:  # the dotted line marks uniform weights
            ax.axhline(1 / len(weights), color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("hidden-state index (0 = embeddings)")
        ax.set_ylabel("layer weight")
        ax.set_title(
            f"{title}\nentropy {entropy:.2f} of {uniform:.2f} nats (dotted line: uniform)".strip(),
            fontsize=8,
        )
        ax.tick_params(axis="x", labelsize=7)
    return path


def plot_layer_scores(
    layers: list[int],
    weights: list[float],
    scores: list[float],
    final: float,
    path: Path,
    *,
    score_label: str,
    title: str = "",
) -> Path:
    """Per-layer score (line, left axis) over the layer-mix weights (bars, right axis)."""
    with figure(path, (max(5.0, 0.3 * len(layers) + 2.5), 3.4)) as (_, ax):
        xs = range(len(layers))
        bars = ax.twinx()
        bars.bar(xs, weights, color="#c9d6ee", label="mix weight")
        bars.set_ylabel("layer-mix weight", color="#4472c4")
        ax.set_zorder(bars.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot(xs, scores, marker="o", color="#c0392b", label=f"{score_label}, layer alone")
        ax.axhline(final, color="#c0392b", linestyle=":", linewidth=1, label="mixed (verdict)")
        ax.set_ylim(-0.03, 1.05)  # points at 0 or 1 stay visible
        ax.set_xticks(list(xs), [str(i) for i in layers])
        ax.set_xlabel("hidden-state index (0 = embeddings)")
        ax.set_ylabel(score_label)
        ax.legend(loc="upper left", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(title, fontsize=9)
    return path


def plot_token_weights(
    layers: list[int], tokens: list[str], weights: list[list[float]], path: Path, *, title: str = ""
) -> Path:
    """Heat map of token weights: one row per probe layer, one column per token."""
    n = len(tokens)
    size = (min(16.0, max(5.0, 0.22 * n + 2)), max(2.2, 0.3 * len(layers) + 1.4))
    with figure(path, size) as (fig, ax):
        image = ax.imshow(weights, aspect="auto", cmap="Blues", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(i) for i in layers])
        ax.set_ylabel("layer")
        if n <= 120:  # beyond that the labels would overlap into a smear
            labels = [repr(t)[1:-1].replace(" ", "␣") for t in tokens]
            ax.set_xticks(range(n), labels, rotation=90, fontsize=6)
        else:
            ax.set_xlabel("token position")
        fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01)
        ax.set_title(title, fontsize=9)
    return path


def plot_layer_curve(
    rows: list[dict[str, Any]],
    path: Path,
    *,
    mix_layers: list[int] | None = None,
    mix_weights: list[float] | None = None,
    title: str = "",
) -> Path:
    """Per-layer probing curve: F1 and AUPRC of a probe on each layer alone (solid), on the
    control task (dashed, when the rows have it), beside the learned mix weights (bars)."""
    import textwrap

    layers = [int(r["layer"]) for r in rows]
    with figure(path, (max(8.0, 0.22 * len(layers) + 3), 3.8)) as (_, ax):
        if mix_layers and mix_weights:
            bars = ax.twinx()
            bars.bar(mix_layers, mix_weights, color="#d9d9d9", width=0.8, label="mix weight")
            bars.set_ylabel("learned layer-mix weight", color="#7f7f7f")
            ax.set_zorder(bars.get_zorder() + 1)
            ax.patch.set_visible(False)
        for key, color in (("f1", "#c0392b"), ("auprc", "#4472c4")):
            ax.plot(layers, [r[key] for r in rows], "o-", color=color, ms=3, label=key.upper())
            if "control_" + key in rows[0]:
                ax.plot(
                    layers,
                    [r["control_" + key] for r in rows],
                    "x--",
                    color=color,
                    ms=3,
                    alpha=0.7,
                    label=f"{key.upper()}, control task",
                )
        ax.set_ylim(-0.03, 1.05)
        ax.set_xlabel("hidden-state index (0 = embeddings); one probe per layer")
        ax.set_ylabel("held-out score")
        ax.legend(loc="lower right", fontsize=7)
        ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    return path


def plot_class_layers(
    labels: list[str],
    layers: list[int],
    shares: list[list[float]],
    path: Path,
    *,
    title: str = "",
) -> Path:
    """Heat map, one row per class, one column per layer: each layer's share of how much
    the class's logit rises on that class's rows (rows sum to 1 in absolute value). The
    title is wrapped to the figure's width, so it is never cut at the edges."""
    import textwrap

    width = max(5.0, 0.25 * len(layers) + 3)
    lines = textwrap.wrap(title, max(30, int(width * 11)))  # ~11 characters an inch at 9 pt
    size = (width, max(2.4, 0.32 * len(labels) + 1.6) + 0.18 * max(0, len(lines) - 1))
    with figure(path, size) as (fig, ax):
        flat = [abs(v) for row in shares for v in row if v == v]
        top = max(flat) if flat else 1.0
        image = ax.imshow(
            shares, aspect="auto", cmap="RdBu_r", vmin=-top, vmax=top, interpolation="nearest"
        )
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
        ax.set_xlabel("hidden-state index (0 = embeddings)")
        fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01, label="share of the logit gap")
        ax.set_title("\n".join(lines), fontsize=9)
    return path
