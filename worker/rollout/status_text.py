"""``probeguard probe status``, ``show`` and ``history`` as text: tables and ``key  value``
lines that fit 80 columns, rendered from what :mod:`worker.rollout.status` gathers.
"""

from __future__ import annotations

import math
import textwrap
import time

from schemas import CheckpointEvent
from worker.rollout.status import StatusReport, VersionDetail, head_columns, judged

__all__ = ["render_history", "render_status", "render_version"]

WIDTH = 80


def render_version(detail: VersionDetail) -> str:
    """``key  value`` lines, values wrapped to fit 80 columns."""
    m, ev, spec = detail.manifest, detail.row.evidence, detail.manifest.spec
    parent = f", parent {m.parent}" if m.parent else ""
    fields = [
        ("version", f"{m.version} ({detail.row.stage}){parent}"),
        ("created", m.created_at.isoformat(timespec="seconds")),
        ("probe", f"{spec.token_pool} pooling, {spec.layer_mix} over layers {spec.layers}"),
        ("task", f"{spec.task}: {', '.join(spec.labels)}; flags {spec.flag_labels or '-'}"),
        ("thresholds", ", ".join(f"{k}={v:g}" for k, v in spec.thresholds.items()) or "-"),
        (
            "LLM",
            f"{m.llm.model_id} ({m.llm.num_layers} layers, d={m.llm.hidden_size}), "
            f"fingerprint {m.llm.digest}",
        ),
        ("tensors", f"sha256 {m.tensors_sha256[:16]}…" + (", signed" if m.signature else "")),
        ("trained on", f"{m.counters.labels_seen} labels, {m.counters.steps} steps"),
    ]
    metrics = {k: v for k, v in m.metrics.items() if "/" not in k}
    if metrics:
        fields.append(("metrics", ", ".join(f"{k}={v:.3g}" for k, v in sorted(metrics.items()))))
    fields.append(
        (
            "evidence",
            f"{ev.scored} msgs, flag rate {_fmt(ev.flag_rate)}, {ev.labels.labeled} labels "
            f"from {ev.labelers} labeler(s), "
            f"F1 {_fmt(ev.labels.f1)}, AUPRC {_fmt(detail.row.auprc)}, {ev.errors} refusal(s)",
        )
    )
    for i, (name, c) in enumerate(judged(ev).items()):
        fields.append(
            (
                "" if i else "per head",
                f"{name}: {c.scored} msgs, flag rate {_fmt(c.flag_rate)}, "
                f"{c.labels.labeled} labels, F1 {_fmt(c.labels.f1)}",
            )
        )
    if ev.last_error:
        fields.append(("refused", ev.last_error))
    if detail.rolled_back_reason:
        fields.append(("rolled back", detail.rolled_back_reason))
    lines = []
    for key, value in fields:
        wrapped = textwrap.wrap(value, 66) or [""]
        lines.append(f"{key:<12}  {wrapped[0]}")
        lines += [f"{'':<12}  {more}" for more in wrapped[1:]]
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"  # NaN (no data yet) as "-"


_COLUMNS = (  # (title, width); right-aligned except the stage
    ("v", 5),
    ("stage", 11),
    ("share", 5),
    ("msgs", 7),
    ("flag%", 6),
    ("lat ms", 6),
    ("labels", 6),
    ("F1", 5),
    ("AUPRC", 5),
    ("agree", 5),
    ("err", 3),
)


def _pct(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "100%" if x >= 0.9995 else f"{100 * x:.1f}%"


def _f(x: float, fmt: str) -> str:
    return "-" if math.isnan(x) else format(x, fmt)


def _row(cells: list[str]) -> str:
    out = []
    for (_, width), cell in zip(_COLUMNS, cells, strict=True):
        out.append(cell.ljust(width) if width == 11 else cell.rjust(width))
    return " ".join(out).rstrip()


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ") or [""]


def render_status(report: StatusReport, *, now: float | None = None) -> str:
    st = report.stages
    lines = []
    head = f"probe {report.probe}: live " + (f"v{st.live}" if st.live is not None else "none")
    before = report.before_live
    if st.live is None and before is not None:
        if before.version is None:
            head += f"; scorers serve {before.source}"
        else:
            head = f"probe {report.probe}: live v{before.version}, {before.source}"
            head += f" ({len(before.heads)} heads)" if len(before.heads) > 1 else ""
            head += ", until a version is published"
    if st.canary is not None:
        head += f", canary v{st.canary} ({st.canary_share:.0%} of conversations)"
    head += ", PINNED (no automatic changes)" if st.pinned else ""
    lines += _wrap(head)
    updater = report.lease_holder or "none (no updater holds the lease)"
    policy = report.policy
    if policy:
        age = (now or time.time()) - float(policy.get("at", 0))
        note = f"policy {policy.get('mode', '?')} (updater {policy.get('holder', '?')}, "
        note += f"{age:.0f}s ago): {policy.get('note', '')}"
        lines += [f"updater: {updater}", *_wrap(note)]
    else:
        lines.append(f"updater: {updater}; the rollout policy has not run yet")
    change = report.last_change
    if change is not None:
        when = change.at.strftime("%m-%d %H:%M:%S")
        who = change.actor or "?"
        lines += _wrap(
            f"last change {when} {change.kind} v{change.version} by {who}: {change.reason}"
        )
    lines.append("")
    lines.append(_row([t for t, _ in _COLUMNS]))
    for r in report.rows:
        e = r.evidence
        lines.append(
            _row(
                [
                    str(r.version),
                    r.stage,
                    f"{st.canary_share:.0%}" if r.stage == "canary" else "",
                    str(e.scored),
                    _pct(e.flag_rate),
                    _f(e.latency_ms, ".1f"),
                    str(e.labels.labeled),
                    _f(e.labels.f1, ".2f"),
                    _f(r.auprc, ".2f"),
                    _pct(e.agreement).replace(".0%", "%"),
                    str(e.errors),
                ]
            )
        )
    hidden = report.total_versions - len(report.rows)
    if hidden > 0:
        lines.append(f"({hidden} older version(s) not shown; --versions N shows more)")
    lines += _render_heads(report)
    for r in report.rows:
        if r.stage == "rolled back" and r.version in report.rolled_back:
            lines += _wrap(f"v{r.version} rolled back: {report.rolled_back[r.version]}")
        if r.evidence.errors:
            lines += _wrap(f"v{r.version} refused: {r.evidence.last_error}")
    return "\n".join(lines)


_HEAD = 17  # the head name's column; each version then takes 21 (flag%, labels, F1)


def _render_heads(report: StatusReport) -> list[str]:
    """Live's and the canary's evidence per head, one line per head (80 columns)."""
    rows, names = head_columns(report)
    if not rows:
        return []
    titles = "".join(f"{f'v{r.version} {r.stage}':>21}" for r in rows)
    lines = ["", f"{'per head':<{_HEAD}}{titles}"]
    lines.append(f"{'':<{_HEAD}}" + f"{'flag%':>8} {'labels':>6} {'F1':>5}" * len(rows))
    for name in names:
        cells = ""
        for r in rows:
            c = r.evidence.heads.get(name)
            if c is None or not c.scored:
                cells += f"{'-':>8} {'':>6} {'':>5}"
                continue
            cells += f"{_pct(c.flag_rate):>8} {c.labels.labeled:>6} {_f(c.labels.f1, '.2f'):>5}"
        short = name if len(name) < _HEAD else name[: _HEAD - 2] + "…"
        lines.append(f"{short:<{_HEAD}}{cells}".rstrip())
    return lines


def render_history(events: list[CheckpointEvent], *, wide: bool = False) -> str:
    head = f"{'time (UTC)':<14} {'event':<14} {'v':>5} {'prev':>5} {'actor':<12} reason"
    lines = [head]
    for e in events:
        reason = e.reason
        if e.details and e.kind != "published":
            extra = ", ".join(f"{k}={v}" for k, v in e.details.items() if v is not None)
            reason = f"{reason} [{extra}]" if wide and extra else reason
        line = (
            f"{e.at.strftime('%m-%d %H:%M:%S'):<14} {e.kind:<14} "
            f"{'' if e.version is None else e.version:>5} "
            f"{'' if e.previous is None else e.previous:>5} {e.actor[:12]:<12} {reason}"
        )
        if not wide and len(line) > WIDTH:
            line = line[: WIDTH - 1] + "…"
        lines.append(line.rstrip())
    return "\n".join(lines)
