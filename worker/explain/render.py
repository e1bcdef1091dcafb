"""Showing an explanation (:func:`worker.explain.breakdown.explain`'s report): 80-column
plain text, a rich rendering for terminals, and an HTML page with PNG plots."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from probes.files import atomic_write, private_dir

__all__ = ["print_rich", "rank_class", "render_plain", "write_html"]

WIDTH = 80


# --- shared pieces -----------------------------------------------------------------------


def tok(s: str, limit: int = 14) -> str:
    """A token as a quoted literal, so spaces and newlines show: ``' the'``, ``'\\n'``."""
    text = repr(s)
    return text if len(text) <= limit else text[: limit - 2] + "…" + text[-1]


def clip(line: str, width: int = WIDTH) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def join_fitting(prefix: str, items: list[str], width: int = WIDTH, sep: str = "  ") -> str:
    """``prefix`` then as many whole ``items`` as fit in ``width`` columns."""
    line = prefix
    for i, item in enumerate(items):
        piece = ("" if i == 0 else sep) + item
        if len(line) + len(piece) > width:
            break
        line += piece
    return line


def _p(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


Column = tuple[str, Callable[[dict[str, Any]], float | None]]


def score_columns(r: dict[str, Any]) -> list[Column]:
    """Probability columns: the flag label (or flag score), else the top classes."""
    flags = r["flag_labels"]
    if len(flags) == 1:
        return [(f"P({flags[0]})"[:12], lambda e: e["flag_score"])]
    if flags:
        return [("flag score", lambda e: e["flag_score"])]
    probs = r["verdict"]["probs"]
    top = sorted(probs, key=lambda label: -probs[label])[:3]
    return [(label[:12], _prob_of(label)) for label in top]


def _prob_of(label: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda e: e["probs"][label]


def decision_text(e: dict[str, Any]) -> str:
    names = ",".join(e["predicted"]) or "-"
    return f"FLAG {names}" if e["flagged"] else names


def depth_text(r: dict[str, Any]) -> str | None:
    """Which depth decides the message in a cascade (None: the probe has no exit head)."""
    e = r.get("exit")
    if not e:
        return None
    risk = f"flag risk {e['flag_risk']:.3f}"
    at = f"decided at layer {e['layer']} by the exit head"
    if e["decided"] == "allow":
        return f"{at}: allow ({risk} < {e['allow_below']:g})"
    if e["decided"] == "flag":
        return f"{at}: FLAG ({risk} >= {e['flag_above']:g})"
    return (
        f"full depth (layer {e['deepest']}): the exit head at layer {e['layer']} is not "
        f"confident ({risk}; it decides below {e['allow_below']:g})"
    )


def header_lines(r: dict[str, Any]) -> list[str]:
    v = r["verdict"]
    n = len(r["layers"])
    ver = f" v{r['version']}" if r["version"] else ""
    text = r["text"].replace("\n", " ")
    score = "" if v["flag_score"] is None else f"  flag score {v['flag_score']:.3f}"
    thresholds = ", ".join(f"{k} {t:.2f}" for k, t in r["thresholds"].items())
    depth = depth_text(r)
    return [
        clip(f"probe   {r['probe']}{ver} from {r['source']}"),
        clip(f"        {r['token_pool']} tokens, {r['layer_mix']} over {n} layer(s), {r['task']}"),
        clip(f"model   {r['model']}"),
        clip(f"text    {text!r} ({r['n_tokens']} tokens)"),
        clip(
            f"verdict {'FLAGGED' if v['flagged'] else 'not flagged'}: "
            f"{', '.join(v['predicted']) or '-'}{score}"
            + (f" (thresholds {thresholds})" if thresholds else "")
        ),
        *([clip(f"depth   {depth}")] if depth else []),
    ]


def token_lines(r: dict[str, Any]) -> list[str]:
    t = r["tokens"]
    lines = [clip(f"Top tokens: {t['description']}")]
    if t["kind"] == "uniform":
        return lines
    for entry in t["top"]:
        items = [f"{tok(x['token'])} {x['weight']:.2f}" for x in entry["tokens"]]
        prefix = f"  layer {entry['layer']:>3} (mix {entry['mix_weight']:.2f}) "
        lines.append(join_fitting(prefix, items))
    return lines


def lens_lines(r: dict[str, Any]) -> list[str]:
    lens = r["lens"]
    if not lens["available"]:
        return [clip(f"Logit lens: unavailable: {lens['reason']}")]
    lines = [
        clip(
            f"Logit lens (final norm + LM head on each layer): top {lens['top_k']} next "
            f"tokens after {tok(lens['token'])} (position {lens['position']})"
        )
    ]
    for row in lens["layers"]:
        items = [f"{tok(t)} {p:.2f}" for t, p in zip(row["tokens"], row["probs"], strict=True)]
        lines.append(join_fitting(f"  {row['layer']:>5}  ", items))
    return lines


def short(s: str, width: int) -> str:
    """A token in at most ``width`` columns, spaces as ``·`` and newlines as ``⏎``."""
    text = s.replace(" ", "·").replace("\n", "⏎").replace("\t", "⇥") or "∅"
    return text if len(text) <= width else text[: width - 1] + "…"


def rank_cell(rank: int | None) -> str:
    """A rank in at most 4 columns: ``7``, ``812``, ``4k``, ``49k``; ``-`` for none."""
    if rank is None:
        return "-"
    return str(rank) if rank < 10_000 else f"{rank // 1000}k"


def rank_title(rank: dict[str, Any]) -> str:
    if rank["mode"] == "next":
        return "Rank of each actual next token at every layer (logit lens; 1 = top guess)"
    return f"Rank of {tok(rank['targets'][0], 20)} at every layer (logit lens; 1 = top guess)"


def rank_lines(r: dict[str, Any], width: int = WIDTH) -> list[str]:
    """The layers x positions grid of ranks, in blocks of positions that fit ``width``."""
    rank = r.get("rank")
    if rank is None:
        return []
    if not rank["available"]:
        return [clip(f"Token ranks: unavailable: {rank['reason']}")]
    lines = [clip(rank_title(rank))]
    cell, n = 6, len(rank["tokens"])
    words = [short(t, cell - 1) for t in rank["tokens"]]
    nxt = ["-" if t is None else short(t, cell - 1) for t in rank["targets"]]
    per_block = max(1, (width - 8) // cell)
    for start in range(0, n, per_block):
        cols = range(start, min(n, start + per_block))
        lines += ["", "    pos " + "".join(f"{p:>{cell}}" for p in cols)]
        lines.append("  token " + "".join(f"{words[p]:>{cell}}" for p in cols))
        if rank["mode"] == "next":
            lines.append("   next " + "".join(f"{nxt[p]:>{cell}}" for p in cols))
        for row in rank["layers"]:
            cells = "".join(f"{rank_cell(row['ranks'][p]):>{cell}}" for p in cols)
            lines.append(f"  {row['layer']:>5} {cells}")
    return lines


def compare_lines(r: dict[str, Any]) -> list[str]:
    """Two candidate tokens per layer: logit difference, probabilities, ranks."""
    c = r.get("compare")
    if c is None:
        return []
    if not c["available"]:
        return [clip(f"Compare: unavailable: {c['reason']}")]
    a, b = tok(c["a"]["token"], 12), tok(c["b"]["token"], 12)
    head = f"  layer  {'logit A-B':>9}  {'P(A)':>8}  {'P(B)':>8}  {'rank A':>7}  {'rank B':>7}"
    lines = [
        clip(f"Compare A = {a} vs B = {b} after {tok(c['token'])} (position {c['position']})"),
        head,
    ]
    for row in c["layers"]:
        pa, pb = row["probs"]
        ra, rb = row["ranks"]
        lines.append(
            f"  {row['layer']:>5}  {row['difference']:>+9.3f}  {pa:>8.2e}  {pb:>8.2e}"
            f"  {rank_cell(ra):>7}  {rank_cell(rb):>7}"
        )
    return lines


def ecco_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for part in (rank_lines(r), compare_lines(r)):
        if part:
            lines += ["", *part]
    return lines


# --- plain text ----------------------------------------------------------------------------


def render_plain(r: dict[str, Any]) -> str:
    """The report in at most 80 columns, no colour (for pipes, logs and tests)."""
    cols = score_columns(r)
    head = "  layer  weight " + "".join(f" {h:>12}" for h, _ in cols) + "  decision"
    lines = [*header_lines(r), ""]
    lines.append("Score by layer: the probe's head on each layer's summary alone")
    lines.append(clip(head))
    for e in r["layers"]:
        cells = "".join(f" {_p(fn(e)):>12}" for _, fn in cols)
        lines.append(clip(f"  {e['layer']:>5}  {e['weight']:6.3f} {cells}  {decision_text(e)}"))
    cells = "".join(f" {_p(fn(r['verdict'])):>12}" for _, fn in cols)
    lines.append(clip(f"  {'mixed':>5}  {1.0:6.3f} {cells}  {decision_text(r['verdict'])}"))
    lines.append(f"  (layer-weight entropy {r['layer_entropy']:.3f} nats)")
    lines += ["", *token_lines(r), "", *lens_lines(r), *ecco_lines(r)]
    return "\n".join(lines)


# --- rich ------------------------------------------------------------------------------------


def print_rich(r: dict[str, Any], console: Any = None) -> None:
    """The report as rich tables, 80 columns wide (for terminals)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=WIDTH)
    for line in header_lines(r):
        style = "bold red" if line.startswith("verdict FLAGGED") else None
        console.print(Text(line, style=style or ""))
    cols = score_columns(r)
    console.print()
    console.print(Text("Score by layer: the probe's head on each layer's summary alone"))
    table = Table()
    table.add_column("layer", justify="right")
    table.add_column("mix weight", justify="right")
    for h, _ in cols:
        table.add_column(h, justify="right")
    table.add_column("decision", overflow="ellipsis", no_wrap=True)
    for e in [*r["layers"], {**r["verdict"], "layer": "mixed", "weight": 1.0}]:
        style = "red" if e["flagged"] else ""
        table.add_row(
            str(e["layer"]),
            f"{e['weight']:.3f}",
            *(_p(fn(e)) for _, fn in cols),
            Text(decision_text(e), style=style),
            end_section=e["layer"] == r["layers"][-1]["layer"],
        )
    console.print(table)
    console.print(f"  layer-weight entropy {r['layer_entropy']:.3f} nats\n")
    for line in token_lines(r):
        console.print(Text(line))
    console.print()
    lens = r["lens"]
    console.print(Text(lens_lines(r)[0]))
    if lens["available"]:
        _rich_lens(r, console)
    for line in ecco_lines(r):  # wide grids come in blocks of positions that fit
        console.print(Text(line), overflow="ellipsis", no_wrap=True)


def _rich_lens(r: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    lens = r["lens"]
    lt = Table(show_header=False)
    lt.add_column("layer", justify="right")
    lt.add_column("next tokens", overflow="ellipsis", no_wrap=True)
    for row in lens["layers"]:
        items = [f"{tok(t)} {p:.2f}" for t, p in zip(row["tokens"], row["probs"], strict=True)]
        lt.add_row(str(row["layer"]), "  ".join(items))
    console.print(lt)


# --- HTML ------------------------------------------------------------------------------------


def write_html(r: dict[str, Any], out: Path) -> Path:
    """``index.html``, ``layers.png``, ``tokens.png`` and ``explain.json`` in ``out``."""
    from worker.plots import plot_layer_scores, plot_token_weights

    private_dir(out)
    cols = score_columns(r)
    label, pick = cols[0]
    plot_layer_scores(
        [e["layer"] for e in r["layers"]],
        [e["weight"] for e in r["layers"]],
        [_value(pick(e)) for e in r["layers"]],
        _value(pick(r["verdict"])),
        out / "layers.png",
        score_label=label,
        title=f"{r['probe']}: score of each layer alone, and its mix weight",
    )
    images = ["layers.png"]
    t = r["tokens"]
    if t["kind"] != "uniform":
        plot_token_weights(
            t["layers"], t["tokens"], t["weights"], out / "tokens.png", title=t["description"]
        )
        images.append("tokens.png")
    atomic_write(out / "explain.json", json.dumps(r, indent=1))
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(str(e['layer']))}</td><td>{e['weight']:.3f}</td>"
        + "".join(f"<td>{_p(fn(e))}</td>" for _, fn in cols)
        + f"<td>{esc(decision_text(e))}</td></tr>"
        for e in [*r["layers"], {**r["verdict"], "layer": "mixed", "weight": 1.0}]
    )
    heads = "".join(f"<th>{esc(h)}</th>" for h, _ in cols)
    lens = r["lens"]
    if lens["available"]:
        lens_rows = "".join(
            f"<tr><td>{row['layer']}</td>"
            + "".join(
                f"<td><code>{esc(repr(x))}</code> {p:.2f}</td>"
                for x, p in zip(row["tokens"], row["probs"], strict=True)
            )
            + "</tr>"
            for row in lens["layers"]
        )
        lens_html = f"<p>{esc(lens_lines(r)[0])}</p><table>{lens_rows}</table>"
    else:
        lens_html = f"<p>Unavailable: {esc(str(lens['reason']))}</p>"
    ecco_html = _rank_html(r) + _compare_html(r)
    top = "".join(
        f"<li>layer {e['layer']} (mix {e['mix_weight']:.2f}): "
        + ", ".join(f"<code>{esc(repr(x['token']))}</code> {x['weight']:.2f}" for x in e["tokens"])
        + "</li>"
        for e in t["top"]
    )
    imgs = "".join(f'<figure><img src="{name}" alt="{name}"></figure>' for name in images)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>probeguard explain: {esc(r["probe"])}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}td,th{{border-bottom:1px solid #ddd;padding:.2em .8em}}
figure{{display:block;margin:.5em 0}}img{{max-width:100%;border:1px solid #eee}}
pre{{white-space:pre-wrap;background:#f6f6f6;padding:.5em}}
.scroll{{overflow-x:auto}}table.ranks td,table.ranks th{{padding:.1em .3em;text-align:right}}
td.r1{{background:#08306b;color:#fff}}td.r2{{background:#2171b5;color:#fff}}
td.r3{{background:#6baed6}}td.r4{{background:#c6dbef}}td.r5{{background:#f7fbff}}</style>
</head><body><h1>probeguard explain</h1>
<pre>{esc(chr(10).join(header_lines(r)))}</pre>
<h2>Score by layer</h2>
<p>The probe's head applied to each layer's summary alone (as if the layer mix put all of
its weight on it), beside the weight the mix gives the layer. The mixed logits are the
weighted sum of the per-layer logits.</p>
<table><tr><th>layer</th><th>mix weight</th>{heads}<th>decision</th></tr>{rows}</table>
<h2>Tokens</h2><p>{esc(t["description"])}</p><ul>{top}</ul>
{imgs}
<h2>Logit lens</h2>{lens_html}
{ecco_html}
</body></html>
"""
    atomic_write(out / "index.html", page)
    return out / "index.html"


def rank_class(rank: int | None) -> str:
    """Heat-map bucket of a rank: ``r1`` (the top guess) to ``r5`` (1000 or worse)."""
    if rank is None:
        return ""
    return "r1" if rank == 1 else f"r{min(5, 2 + len(str(rank)) - 1)}"


def _rank_html(r: dict[str, Any]) -> str:
    esc = html.escape
    rank = r.get("rank")
    if rank is None:
        return ""
    if not rank["available"]:
        return f"<h2>Token ranks</h2><p>Unavailable: {esc(str(rank['reason']))}</p>"
    head = "".join(f"<th><code>{esc(repr(t))}</code></th>" for t in rank["tokens"])
    nxt = ""
    if rank["mode"] == "next":
        cells = "".join(
            f"<th>{'-' if t is None else '<code>' + esc(repr(t)) + '</code>'}</th>"
            for t in rank["targets"]
        )
        nxt = f"<tr><th>next</th>{cells}</tr>"
    body = "".join(
        f"<tr><th>{row['layer']}</th>"
        + "".join(f'<td class="{rank_class(x)}">{rank_cell(x)}</td>' for x in row["ranks"])
        + "</tr>"
        for row in reversed(rank["layers"])
    )
    return (
        f"<h2>Token ranks</h2><p>{esc(rank_title(rank))}: rows are layers (top layer first), "
        "columns the message's tokens.</p>"
        f'<div class="scroll"><table class="ranks"><tr><th>layer</th>{head}</tr>{nxt}{body}'
        "</table></div>"
    )


def _compare_html(r: dict[str, Any]) -> str:
    esc = html.escape
    c = r.get("compare")
    if c is None:
        return ""
    if not c["available"]:
        return f"<h2>Compare two tokens</h2><p>Unavailable: {esc(str(c['reason']))}</p>"
    a, b = (f"<code>{esc(repr(c[k]['token']))}</code>" for k in ("a", "b"))
    rows = "".join(
        f"<tr><td>{row['layer']}</td><td>{row['difference']:+.3f}</td>"
        f"<td>{row['probs'][0]:.2e}</td><td>{row['probs'][1]:.2e}</td>"
        f"<td>{rank_cell(row['ranks'][0])}</td><td>{rank_cell(row['ranks'][1])}</td></tr>"
        for row in reversed(c["layers"])
    )
    return (
        f"<h2>Compare two tokens</h2><p>A = {a} vs B = {b} after "
        f"<code>{esc(repr(c['token']))}</code> (position {c['position']}): the logit "
        "difference A−B is the log of the odds of A over B at that layer.</p>"
        "<table><tr><th>layer</th><th>logit A−B</th><th>P(A)</th><th>P(B)</th>"
        f"<th>rank A</th><th>rank B</th></tr>{rows}</table>"
    )


def _value(v: float | None) -> float:
    return float("nan") if v is None else float(v)
