"""Report plots (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["plot_layer_weights"]


def plot_layer_weights(
    layers: list[int], weights: list[float], path: Path, *, title: str = ""
) -> Path:
    """Bar chart of the probe's layer weights (hidden-state index on x), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entropy = -sum(w * math.log(w) for w in weights if w > 0)
    uniform = math.log(len(weights)) if len(weights) > 1 else 0.0
    fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * len(layers) + 2), 3.2), dpi=120)
    try:
        ax.bar(range(len(layers)), weights, color="#4472c4")
        ax.set_xticks(range(len(layers)), [str(i) for i in layers])
        if len(weights) > 1:  # the dotted line marks uniform weights
            ax.axhline(1 / len(weights), color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("hidden-state index (0 = embeddings)")
        ax.set_ylabel("layer weight")
        ax.set_title(
            f"{title}  entropy {entropy:.2f} / {uniform:.2f} nats (dotted: uniform)".strip(),
            fontsize=9,
        )
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
