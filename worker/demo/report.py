"""The demo report: a folder with ``index.html``, PNG plots and ``figures.json``.

Every number on the page comes from the figures (:func:`worker.demo.figures.final_figures`),
and the served F1 in its headline is the one the learning plot and the confusion matrices
are drawn from (:mod:`worker.demo.quality`), so the page cannot contradict itself.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from probes.files import atomic_write, private_dir
from worker.demo.quality import Cells
from worker.plots import figure, plot_class_layers, plot_layer_weights

__all__ = ["DEFINITION", "headline_rows", "write_report"]

# The definition of served F1, as the page and the README state it.
DEFINITION = (
    "Served F1 judges the verdicts the scorer sent by the human labels that arrived after "
    "them. <b>Per head</b>: over the messages labeled for that head, a positive is a "
    "verdict in which the head predicted one of its flag labels. <b>Flag policy</b>: over "
    "every labeled message, a positive is a verdict that flagged (a head of the "
    "deployment's flag policy flagged it). Either way a true positive is a message whose "
    "label is a flag label, and F1 = 2·TP / (2·TP + FP + FN)."
)

_POLICY = "#4472c4"
_HEAD_COLORS = ["#c0392b", "#2e8b57", "#8e44ad", "#d35400", "#7f8c8d"]


def _f1(cells: dict[str, int]) -> float | None:
    return Cells.of(cells).f1


def _windows(fig_data: dict[str, Any], key: str | None) -> list[tuple[float, float, float]]:
    """``(first, last, f1)`` per window of the flag policy (``key`` None) or of a head."""
    out = []
    for w in fig_data["quality"]["windows"]:
        cells = w["policy"] if key is None else w["heads"][key]
        f1 = _f1(cells)
        if f1 is not None:
            out.append((w["first"], w["last"], f1))
    return out


def _half_line(ax: Any, fig_data: dict[str, Any], color: str) -> None:
    """The flag policy's F1 over each half, dashed across the windows of that half."""
    q = fig_data["quality"]
    said = []
    for half, key in ((1, "first_half"), (2, "second_half")):
        spans = [w for w in q["windows"] if w["half"] == half]
        f1 = _f1(q["policy"][key])
        if not spans or f1 is None:
            continue
        x0, x1 = spans[0]["first"] - 0.5, spans[-1]["last"] + 0.5
        ax.plot([x0, x1], [f1, f1], "--", color=color, linewidth=1)
        said.append(f"{f1:.3f}")
    if said:
        ax.plot(
            [], [], "--", color=color, linewidth=1, label=f"flag policy per half: {', '.join(said)}"
        )


def _version_ticks(ax: Any, fig_data: dict[str, Any]) -> None:
    """Where each newer version first decided a labeled message, on the top axis."""
    ticks, last = [], -1
    for i, row in enumerate(fig_data["served"], start=1):
        if row["version"] > last:
            ticks.append((i, f"v{row['version']}"))
            last = row["version"]
    span = max(1, len(fig_data["served"]))
    names, last_x = [], -span
    for x, name in ticks:  # a name only where it does not run into the previous one
        names.append(name if x - last_x >= span / 25 else "")
        last_x = x if names[-1] else last_x
    top = ax.secondary_xaxis("top")
    top.set_xticks([x for x, _ in ticks], names, fontsize=7)
    top.tick_params(length=3, pad=1)
    for x, _ in ticks[1:]:
        ax.axvline(x, color="#ccc", linewidth=0.6, zorder=0)


def plot_learning(fig_data: dict[str, Any], path: Path) -> str:
    """Served F1 per window of labeled messages (flag policy and each labeled head), the
    flag policy's F1 per half, and the updater's test-then-train F1 at each version; the
    x-axis counts this run's labels only."""
    q = fig_data["quality"]
    with figure(path, (8.0, 3.8)) as (_, ax):
        for key, name, color, marker in [
            (None, "flag policy", _POLICY, "o"),
            *[
                (h["name"], f"head {h['name']}", _HEAD_COLORS[i % 5], "s")
                for i, h in enumerate(q["heads"])
            ],
        ]:
            spans = _windows(fig_data, key)
            if not spans:
                continue
            for first, last, f1 in spans:  # a window: a step over the messages it holds
                ax.plot([first - 0.5, last + 0.5], [f1, f1], color=color, linewidth=2, alpha=0.5)
            ax.plot(
                [(a + b) / 2 for a, b, _ in spans],
                [f for _, _, f in spans],
                marker,
                color=color,
                markersize=4,
                label=f"served F1, {name} (per window)",
            )
        _half_line(ax, fig_data, _POLICY)
        _version_ticks(ax, fig_data)
        pts = [p for p in fig_data["versions"] if p["f1"] is not None]
        if pts:
            ax.plot(
                [p["labels"] for p in pts],
                [p["f1"] for p in pts],
                "x:",
                color="#ed7d31",
                markersize=5,
                label="updater: test-then-train F1 at each version",
            )
        origin = fig_data["origin"]
        ax.text(
            0.01,
            0.03,
            f"v{origin['version']}: {origin['source']}",
            transform=ax.transAxes,
            fontsize=7,
            color="#555",
        )
        ax.set_ylim(0, 1.12)
        ax.set_xlim(left=0)
        ax.set_xlabel("labeled messages in this run")
        ax.set_ylabel("F1")
        ax.legend(loc="lower right", fontsize=7, frameon=False)
        ax.set_title("Served quality as labels arrive (top: the version serving)", fontsize=10)
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


def _matrices(fig_data: dict[str, Any]) -> list[tuple[str, list[str], list[str], list[list[int]]]]:
    """``(title, rows, columns, counts)``: the flag policy's 2x2, then each labeled head's."""
    q = fig_data["quality"]
    c = q["policy"]["all"]
    out = [
        (
            "flag policy",
            ["no flag", "flag"],
            ["allowed", "flagged"],
            [[c["tn"], c["fp"]], [c["fn"], c["tp"]]],
        )
    ]
    for h in q["heads"]:
        m = h["confusion"]
        out.append((f"head {h['name']}", m["rows"], m["cols"], m["counts"]))
    return out


def plot_confusion(fig_data: dict[str, Any], path: Path) -> str:
    """One matrix per panel: the flag policy, then each head the labels judged."""
    import matplotlib.pyplot as plt

    panels = _matrices(fig_data)
    size = max(max(len(r), len(c)) for _, r, c, _ in panels)
    side = 1.0 * size + 1.8
    with figure(path, (side * len(panels), side)) as (fig, ax):
        ax.remove()
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for a, (title, rows, cols, m) in zip(axes, panels, strict=True):
            a.imshow(m, cmap="Blues", vmin=0)
            top = max((v for row in m for v in row), default=0)
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    color = "white" if v > top / 2 else "black"  # readable on dark cells
                    a.text(j, i, str(v), ha="center", va="center", fontsize=13, color=color)
            a.set_xticks(range(len(cols)), cols, fontsize=9)
            a.set_yticks(range(len(rows)), rows, fontsize=9)
            a.set_xlabel("served decision", fontsize=9)
            a.set_ylabel("human label", fontsize=9)
            a.set_title(title, fontsize=10)
        plt.setp(axes, frame_on=True)
    return path.name


def headline_rows(fig_data: dict[str, Any]) -> list[tuple[str, int, Any, Any, Any]]:
    """``(what, labeled messages, F1 all, first half, second half)``: the flag policy, then
    each head the labels judged (F1 ``None`` where undefined)."""
    q = fig_data["quality"]
    p = q["policy"]
    heads = ", ".join(p["heads"]) or "none"
    out = [
        (
            f"flag policy (heads: {heads})",
            Cells.of(p["all"]).n,
            fig_data["served_f1"],
            fig_data["served_f1_first_half"],
            fig_data["served_f1_second_half"],
        )
    ]
    for h in q["heads"]:
        out.append(
            (
                f"head {h['name']}",
                Cells.of(h["all"]).n,
                _f1(h["all"]),
                _f1(h["first_half"]),
                _f1(h["second_half"]),
            )
        )
    return out


_TABLE_KEYS = [
    ("messages", "messages replayed"),
    ("verdicts", "verdicts"),
    ("dead_letters", "dead letters"),
    ("reviews", "review requests"),
    ("labels", "human labels sent"),
    ("elapsed_s", "wall time (s)"),
    ("p50_ms", "latency p50 (ms)"),
    ("p99_ms", "latency p99 (ms)"),
]


def _esc(v: Any) -> str:
    return html.escape(_fmt(v))


def _origin(fig_data: dict[str, Any]) -> str:
    o = fig_data["origin"]
    before = o.get("labels_seen", 0)
    if o.get("version") == 0:
        return (
            f"The first messages were served by v0, {html.escape(o['source'])}, which learned "
            f"from {before:,} labels before this run (its data card: docs/default-probe.md); "
            "those are not counted here. Every later version is v0 fine-tuned by the updater "
            "on this run's labels."
        )
    return (
        f"v1 was {html.escape(o['source'])} on this run's first labels; nothing served before it."
    )


def _head_flags(fig_data: dict[str, Any]) -> str:
    flags = fig_data.get("head_flags") or {}
    if not flags:
        return ""
    judged = {h["name"] for h in fig_data["quality"]["heads"]}
    policy = set(fig_data["quality"]["policy"]["heads"])
    rows = "\n".join(
        f"<tr><td>{html.escape(name)}</td><td>{n}</td>"
        f"<td>{'yes' if name in policy else 'no'}</td>"
        f"<td>{'yes' if name in judged else 'no'}</td></tr>"
        for name, n in flags.items()
    )
    return (
        f"<h2>What each head flagged</h2><p>Of all {fig_data['verdicts']} verdicts, labeled or "
        "not. A head without labels in this stream is not judged; its flags count in the "
        "flag policy's F1 all the same when the policy includes it.</p>"
        "<table><tr><th>head</th><th>verdicts it flagged</th><th>in the flag policy</th>"
        f"<th>labels in this stream</th></tr>{rows}</table>"
    )


def write_report(fig_data: dict[str, Any], out: Path, *, title: str = "probeguard demo") -> Path:
    """Write the plots, ``figures.json`` and ``index.html`` into ``out``; returns the page."""
    private_dir(out)
    imgs = _figures_html(_plots(fig_data, out))
    headline = "\n".join(
        f'<tr><td>{html.escape(what)}</td><td>{n}</td><td class="f1">{_esc(a)}</td>'
        f'<td class="f1">{_esc(b)}</td><td class="f1">{_esc(c)}</td></tr>'
        for what, n, a, b, c in headline_rows(fig_data)
    )
    table = _run_table(fig_data)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:62em;margin:2em auto;padding:0 1em;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}th{{text-align:left}}
td,th{{border-bottom:1px solid #ddd;padding:.25em 1em}}td.f1{{text-align:right}}
figure{{display:block;margin:.5em 0;max-width:100%}}
.grid{{display:grid;grid-template-columns:1fr 1fr;gap:.5em;align-items:start}}
.grid figure{{margin:0}}
img{{max-width:100%;border:1px solid #eee}}p{{max-width:50em;line-height:1.4}}</style>
</head><body><h1>{html.escape(title)}</h1>
<p>Run {html.escape(str(fig_data["run_id"]))}: a scorer and an updater on one machine,
learning online from delayed human labels. {_origin(fig_data)}</p>
<h2>Served quality</h2>
<table id="served"><tr><th></th><th>labeled messages</th><th>served F1</th>
<th>first half</th><th>second half</th></tr>
{headline}</table>
<p>{DEFINITION} The halves split the labeled messages in the order they were scored.</p>
<h2>Plots</h2>{imgs}
{_head_flags(fig_data)}
<h2>Run</h2><table>{table}</table>
<p>The updater's test-then-train F1 scores each label with the version the updater holds
just before it learns from it, over a sliding window, for the heads the labels judge: it
runs ahead of the served versions, which are published every few labels.</p>
</body></html>
"""
    atomic_write(out / "index.html", page)
    slim = {k: v for k, v in fig_data.items() if k not in ("latency_ms", "arrivals_s")}
    atomic_write(out / "figures.json", json.dumps(slim, indent=1, default=str))
    return out / "index.html"


def _plots(fig_data: dict[str, Any], out: Path) -> list[str]:
    """Draw the report's plots into ``out``; their file names (the layer plots only when
    the run has their data)."""
    images = [
        plot_learning(fig_data, out / "learning.png"),
        plot_confusion(fig_data, out / "confusion.png"),
        plot_latency(fig_data, out / "latency.png"),
        plot_throughput(fig_data, out / "throughput.png"),
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
    keep = [i for i, n in enumerate(use.get("rows", [])) if n > 0]  # labels with data only
    if keep:
        images.append(
            plot_class_layers(
                [use["labels"][i] for i in keep],
                use["layers"],
                [use["shares"][i] for i in keep],
                out / "class_layers.png",
                title="per-label layer use: each layer's share of the label's logit gap "
                f"(replay buffer, {sum(use['rows'])} labeled messages)",
            ).name
        )
    return images


def _run_table(fig_data: dict[str, Any]) -> str:
    """The run's figures and the versions it published, as table rows."""
    rows: list[tuple[str, Any]] = [
        (label, f"{fig_data[key]:.1f}" if key.endswith(("_s", "_ms")) else fig_data[key])
        for key, label in _TABLE_KEYS
    ]
    versions = fig_data["versions"]
    if versions:
        last = versions[-1]
        rows += [
            ("versions published", len(versions)),
            ("final version", f"v{last['version']}"),
            ("updater test-then-train F1 (last version)", last["f1"]),
            ("updater test-then-train AUPRC (last version)", last["auprc"]),
        ]
    return "\n".join(f"<tr><td>{html.escape(str(k))}</td><td>{_esc(v)}</td></tr>" for k, v in rows)


def _figures_html(images: list[str]) -> str:
    """The plots as figures: latency and throughput side by side, the others full width."""
    # Latency and throughput two a row; the rest whole (a layer plot over every layer of
    # the default's 31 is too wide for half a row: its labels shrank below reading size).
    small = [name for name in images if name in {"latency.png", "throughput.png"}]
    wide = [name for name in images if name not in small]
    imgs = "\n".join(f'<figure><img src="{name}" alt="{name}"></figure>' for name in wide)
    imgs += '<div class="grid">' + "".join(
        f'<figure><img src="{name}" alt="{name}"></figure>' for name in small
    )
    return imgs + "</div>"


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)
