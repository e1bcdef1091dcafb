"""What ``probeguard probe status`` and ``show`` report, gathered from Redis as
JSON-ready records; :mod:`worker.rollout.status_text` renders them (and ``history``) as
tables that fit 80 columns.

Stages of a version as shown: ``live``, ``canary``, ``rolled back`` (never promoted
automatically again), ``candidate`` (newer than live, never tried: the policy's next
canary is the newest one), ``retired`` (anything else: earlier lives, ended trials,
superseded candidates).

A multi-head version's evidence is also shown per head (flag rate, labels and F1 of each
head it judges): every head in ``--json``, live's and the canary's below the table.

While the registry has no live version, scorers configured like the command serve a
version 0 of their own (the packaged default probe of their LLM, or the bootstrap
checkpoint): :func:`before_live` says which, and the status shows it as live v0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas import CheckpointEvent, CheckpointManifest
from worker.errors import UnknownVersion
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry, Stages
from worker.store.evidence import EvidenceStore
from worker.store.evidence_counts import Counts, Evidence
from worker.store.lease import Lease

__all__ = [
    "BeforeLive",
    "StatusReport",
    "VersionDetail",
    "VersionRow",
    "before_live",
    "gather",
    "gather_version",
    "head_columns",
    "stage_of",
]


@dataclass(frozen=True)
class VersionRow:
    version: int
    stage: str
    evidence: Evidence
    auprc: float
    created_at: datetime | None
    labels_seen: int | None

    def as_dict(self, share: float) -> dict[str, Any]:
        e = self.evidence
        return {
            "version": self.version,
            "stage": self.stage,
            "share": share if self.stage == "canary" else None,
            "messages": e.messages,
            "shadow_messages": e.shadow_messages,
            "flag_rate": _num(e.flag_rate),
            "latency_ms": _num(e.latency_ms),
            "labels": e.labels.labeled,
            "labelers": e.labelers,
            "f1": _num(e.labels.f1),
            "auprc": _num(self.auprc),
            "agreement": _num(e.agreement),
            "shadow_flags": e.shadow_flags,
            "shadow_agree": e.shadow_agree,
            "baseline_messages": e.baseline_messages,
            "baseline_flags": e.baseline_flags,
            "baseline_confusion": vars(e.baseline_labels),
            "errors": e.errors,
            "last_error": e.last_error or None,
            "confusion": vars(e.labels),
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "labels_seen": self.labels_seen,
            "heads": {name: _head_dict(c) for name, c in judged(e).items()} or None,
        }


def judged(e: Evidence) -> dict[str, Counts]:
    """The heads a multi-head version judged messages with (a label credited to a head the
    version does not have leaves counters, but no messages)."""
    return {name: c for name, c in e.heads.items() if c.scored}


def _head_dict(c: Counts) -> dict[str, Any]:
    return {
        "messages": c.messages,
        "shadow_messages": c.shadow_messages,
        "flags": c.scored_flags,
        "flag_rate": _num(c.flag_rate),
        "labels": c.labels.labeled,
        "f1": _num(c.labels.f1),
        "confusion": vars(c.labels),
        "baseline_messages": c.baseline_messages,
        "baseline_flags": c.baseline_flags,
        "baseline_confusion": vars(c.baseline_labels),
    }


def head_columns(report: StatusReport) -> tuple[list[VersionRow], list[str]]:
    """What the per-head view compares: live and the canary (those of them that judged
    heads) and the union of their heads."""
    rows = [r for r in report.rows if r.stage in ("live", "canary") and judged(r.evidence)]
    names = sorted({name for r in rows for name in judged(r.evidence)})
    return rows, names


@dataclass(frozen=True)
class BeforeLive:
    """What scorers serve while the registry has no live version."""

    version: int | None  # 0 while they serve one of their own; None: they wait
    source: str  # what it is, in words
    heads: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source, "heads": list(self.heads)}


def before_live(settings: Settings, root: Path | None = None) -> BeforeLive:
    """What a scorer with ``settings`` serves until a version is live (see
    :meth:`worker.scoring.engine.ScoringEngine.wait_for_probes`): the bootstrap checkpoint,
    else the packaged default probe shipped for its LLM (``root``: the packaged defaults'
    folder), else nothing. Read from the packaged manifests and the settings alone: no
    LLM is loaded (a scorer still refuses a default whose fingerprint does not match)."""
    if settings.bootstrap_checkpoint is not None:
        return BeforeLive(0, f"the bootstrap checkpoint {settings.bootstrap_checkpoint}")
    if not settings.default_probe:
        return BeforeLive(
            None, "nothing until a version is published (PROBEGUARD_DEFAULT_PROBE=false)"
        )
    from worker.defaults import ROOT

    for folder in sorted((root or ROOT).glob("*/manifest.json")):
        manifest = CheckpointManifest.model_validate_json(folder.read_bytes())
        # A packaged LLM's model id is "<PROBEGUARD_MODEL>/<its GGUF file>".
        name, _, gguf = manifest.llm.model_id.partition("/")
        if name == settings.model and settings.model_gguf_file in (None, gguf):
            heads = tuple(h.name for h in manifest.spec.head_specs)
            return BeforeLive(0, f"the packaged default probe {folder.parent.name}", heads)
    return BeforeLive(
        None, f"nothing until a version is published (no packaged default for {settings.model})"
    )


@dataclass(frozen=True)
class StatusReport:
    probe: str
    stages: Stages
    rows: list[VersionRow]
    lease_holder: str | None
    policy: dict[str, str] = field(default_factory=dict)
    rolled_back: dict[int, str] = field(default_factory=dict)
    last_change: CheckpointEvent | None = None
    total_versions: int = 0
    before_live: BeforeLive | None = None  # while nothing is live (None: not asked)

    def as_dict(self) -> dict[str, Any]:
        st = self.stages
        return {
            "probe": self.probe,
            "live": st.live,
            "serving_before_live": self.before_live.as_dict() if self.before_live else None,
            "canary": st.canary,
            "canary_share": st.canary_share if st.canary is not None else None,
            "pinned": st.pinned,
            "updater": self.lease_holder,
            "policy": self.policy or None,
            "versions": [r.as_dict(st.canary_share) for r in self.rows],
            "rolled_back": {str(k): v for k, v in self.rolled_back.items()},
            "last_change": self.last_change.model_dump(mode="json") if self.last_change else None,
        }


def stage_of(version: int, st: Stages, rolled_back: set[int], tried: set[int]) -> str:
    if version == st.live:
        return "live"
    if version == st.canary:
        return "canary"
    if version in rolled_back:
        return "rolled back"
    if (st.live is None or version > st.live) and version not in tried:
        return "candidate"
    return "retired"


def gather(
    registry: CheckpointRegistry,
    evidence: EvidenceStore,
    *,
    limit: int = 8,
    auprc: bool = True,
    settings: Settings | None = None,
) -> StatusReport:
    """The newest ``limit`` versions, plus live and canary wherever they are; with
    ``settings`` and nothing live, what scorers serve meanwhile (:func:`before_live`)."""
    st = registry.stages()
    versions = registry.versions()
    shown = set(versions[-limit:]) | {v for v in (st.live, st.canary) if v is not None}
    shown &= set(versions)
    bad = registry.rolled_back()
    tried = registry.tried()
    ev = evidence.read_many(registry.probe, sorted(shown))
    rows = []
    for v in sorted(shown, reverse=True):
        try:
            manifest = registry.manifest(v)
            created, seen = manifest.created_at, manifest.counters.labels_seen
        except UnknownVersion:
            created, seen = None, None
        rows.append(
            VersionRow(
                version=v,
                stage=stage_of(v, st, set(bad), tried),
                evidence=ev[v],
                auprc=evidence.auprc(registry.probe, v) if auprc else math.nan,
                created_at=created,
                labels_seen=seen,
            )
        )
    holder = Lease(registry.client, registry.lease_key, "probeguard-cli").current()
    policy = {
        k.decode(): v.decode()
        for k, v in registry.client.hgetall(registry.keys.policy(registry.probe)).items()
    }
    changes = [e for _, e in registry.history(50) if e.kind != "published"]
    return StatusReport(
        probe=registry.probe,
        stages=st,
        rows=rows,
        lease_holder=holder[1] if holder else None,
        policy=policy,
        rolled_back=bad,
        last_change=changes[-1] if changes else None,
        total_versions=len(versions),
        before_live=before_live(settings) if settings is not None and st.live is None else None,
    )


@dataclass(frozen=True)
class VersionDetail:
    """One version in full (``probeguard probe show``): its manifest, stage and evidence."""

    manifest: CheckpointManifest
    row: VersionRow
    share: float
    rolled_back_reason: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.row.stage,
            "manifest": json.loads(self.manifest.encode()),
            "evidence": self.row.as_dict(self.share),
        }


def gather_version(
    registry: CheckpointRegistry, evidence: EvidenceStore, version: int
) -> VersionDetail:
    m = registry.manifest(version)  # UnknownVersion when it was never published
    st = registry.stages()
    bad = registry.rolled_back()
    row = VersionRow(
        version=version,
        stage=stage_of(version, st, set(bad), registry.tried()),
        evidence=evidence.read(registry.probe, version),
        auprc=evidence.auprc(registry.probe, version),
        created_at=m.created_at,
        labels_seen=m.counters.labels_seen,
    )
    return VersionDetail(m, row, st.canary_share, bad.get(version))


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)
