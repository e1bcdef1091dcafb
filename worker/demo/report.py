"""The demo report: a folder with ``index.html``, PNG plots and ``figures.json``."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from probes.files import atomic_write, private_dir
from worker.plots import figure, plot_class_layers, plot_layer_weights

__all__ = ["write_report"]


def plot_prequential(fig_data: dict[str, Any], path: Path) -> str:
    with figure(path, (7.5, 3.4)) as (_, ax):
        curve = fig_data["curve"]
        if curve:
            ax.plot(
                [c["n"] for c in curve],
                [c["f1"] for c in curve],
                color="#4472c4",
                label="served F1 (last 40 labeled messages)",
            )
            last = 0
            for c in curve:
                if c["version"] > last:  # mark each newer version where it first decided
                    ax.axvline(c["n"], color="grey", linestyle=":", linewidth=0.8)
                    ax.text(
                        c["n"],
                        1.02,
                        f"v{c['version']}",
                        fontsize=6,
                        rotation=90,
                        va="bottom",
                        ha="center",
                    )
                    last = c["version"]
        pts = [p for p in fig_data["versions"] if p["f1"] is not None]
        if pts:
            ax2 = ax
            ax2.plot(
                [p["labels_seen"] for p in pts],
                [p["f1"] for p in pts],
                "o-",
                color="#ed7d31",
                markersize=3,
                label="updater prequential F1 (window) at each version",
            )
            ax2.plot(
                [p["labels_seen"] for p in pts],
                [p["auprc"] or 0 for p in pts],
                "s--",
                color="#70ad47",
                markersize=3,
                label="updater prequential AUPRC",
            )
        ax.set_ylim(0, 1.1)
        ax.set_xlabel("labeled messages so far")
        ax.set_ylabel("score")
        ax.legend(loc="lower right", fontsize=7, frameon=False)
        ax.set_title("Learning over the stream (dotted lines: version changes)", fontsize=9)
    return path.name


def plot_latency(fig_data: dict[str, Any], path: Path) -> str:
    with figure(path, (5, 3)) as (_, ax):
        lat = fig_data["latency_ms"]
        # Seconds once a backlog makes milliseconds unreadable on the axis.
        unit, div = ("s", 1000.0) if lat and max(lat) > 10_000 else ("ms", 1.0)
        if lat:
            values = sorted(v / div for v in lat)
            ax.hist(values, bins=40, color="#4472c4")
            for q, style in ((0.5, "--"), (0.99, ":")):
                v = values[min(len(values) - 1, int(q * len(values)))]
                label = f"p{int(q * 100)} {v:.0f} {unit}"
                ax.axvline(v, color="black", linestyle=style, linewidth=1, label=label)
            ax.legend(fontsize=7, framealpha=0.9)
        ax.set_xlabel(f"produce → verdict ({unit})")
        ax.set_ylabel("messages")
        ax.set_title("Latency", fontsize=9)
    return path.name


def plot_throughput(fig_data: dict[str, Any], path: Path) -> str:
    with figure(path, (5, 3)) as (_, ax):
        arrivals = fig_data["arrivals_s"]
        if arrivals:
            width = max(1.0, (arrivals[-1] - arrivals[0]) / 40)
            bins = int(arrivals[-1] // width) + 1
            counts = [0] * bins
            for t in arrivals:
                counts[int(t // width)] += 1
            ax.bar(
                [i * width for i in range(bins)],
                [c / width for c in counts],
                width=width,
                align="edge",
                color="#4472c4",
            )
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("verdicts / s")
        ax.set_title("Throughput", fontsize=9)
    return path.name


def plot_confusion(fig_data: dict[str, Any], path: Path) -> str:
    labels, m = fig_data["labels_order"], fig_data["confusion"]
    with figure(path, (1.2 * len(labels) + 2.2, 1.1 * len(labels) + 1.6)) as (_, ax):
        ax.imshow(m, cmap="Blues")
        top = max((v for row in m for v in row), default=0)
        for i, row in enumerate(m):
            for j, v in enumerate(row):
                color = "white" if v > top / 2 else "black"  # readable on dark cells
                ax.text(j, i, str(v), ha="center", va="center", fontsize=9, color=color)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_xlabel("served decision")
        ax.set_ylabel("human label")
        ax.set_title("Confusion on labeled messages", fontsize=9)
    return path.name


_TABLE_KEYS = [
    ("messages", "messages replayed"),
    ("verdicts", "verdicts"),
    ("dead_letters", "dead letters"),
    ("reviews", "review requests"),
    ("labels", "human labels"),
    ("elapsed_s", "wall time (s)"),
    ("p50_ms", "latency p50 (ms)"),
    ("p99_ms", "latency p99 (ms)"),
    ("served_f1_all", "served F1, all labeled"),
    ("served_f1_second_half", "served F1, second half"),
]


def write_report(fig_data: dict[str, Any], out: Path, *, title: str = "probeguard demo") -> Path:
    """Write the plots, ``figures.json`` and ``index.html`` into ``out``; returns the page."""
    private_dir(out)
    images = [
        plot_prequential(fig_data, out / "prequential.png"),
        plot_latency(fig_data, out / "latency.png"),
        plot_throughput(fig_data, out / "throughput.png"),
        plot_confusion(fig_data, out / "confusion.png"),
    ]
    lw = fig_data.get("layer_weights") or {}
    if lw:
        images.append(
            plot_layer_weights(
                lw["layers"],
                lw["weights"],
                out / "layer_weights.png",
                title="learned layer weights",
            ).name
        )
    use = fig_data.get("class_layers") or {}
    if use:
        images.append(
            plot_class_layers(
                use["labels"],
                use["layers"],
                use["shares"],
                out / "class_layers.png",
                title="per-class layer use: each layer's share of each class's logit gap "
                f"(replay buffer, {sum(use['rows'])} labeled messages)",
            ).name
        )
    versions = fig_data["versions"]
    rows = [(label, fig_data[key]) for key, label in _TABLE_KEYS]
    if versions:
        last = versions[-1]
        rows += [
            ("versions published", len(versions)),
            ("final version", f"v{last['version']}"),
            ("updater prequential F1", last["f1"]),
            ("updater prequential AUPRC", last["auprc"]),
        ]
    table = "\n".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows
    )
    imgs = "\n".join(f'<figure><img src="{name}" alt="{name}"></figure>' for name in images)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}td{{border-bottom:1px solid #ddd;padding:.25em 1em}}
figure{{display:inline-block;margin:.5em}}img{{max-width:100%;border:1px solid #eee}}</style>
</head><body><h1>{html.escape(title)}</h1>
<p>Run {html.escape(str(fig_data["run_id"]))}: a scorer and an updater on one machine,
learning online from delayed human labels.</p>
<h2>Final numbers</h2><table>{table}</table>
<h2>Plots</h2>{imgs}
</body></html>
"""
    atomic_write(out / "index.html", page)
    slim = {k: v for k, v in fig_data.items() if k not in ("latency_ms", "arrivals_s", "served")}
    atomic_write(out / "figures.json", json.dumps(slim, indent=1, default=str))
    return out / "index.html"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)
