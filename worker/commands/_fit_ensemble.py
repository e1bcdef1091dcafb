"""``probeguard fit`` with several ``--cache``: one probe per LLM, averaged into an ensemble.

Apart from :mod:`worker.commands.fit` because an ensemble is its own path: it refuses the
selections that pick one probe over one LLM, writes ``ensemble.json`` with a checkpoint
folder per member, and reports per member before the mean.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from worker.commands._common import print_json

if TYPE_CHECKING:
    from probes.offline.cache import HiddenStateCache
    from probes.offline.ensemble import EnsembleFit
    from probes.offline.fit import FitConfig
    from schemas import OperatingPoint
    from worker.offline.fit_eval import ProbeOptions

__all__ = ["run_ensemble"]


def run_ensemble(
    args: argparse.Namespace,
    caches: list[HiddenStateCache],
    opts: ProbeOptions,
    config: FitConfig,
    folds: int,
    point: OperatingPoint,
    signing_key: bytes | None,
) -> int:
    """``fit`` with several ``--cache``: one probe per LLM, averaged (``--out`` an ensemble)."""
    from probes.files import atomic_write
    from worker.offline.fit_ensemble import fit_probe_ensemble, save_ensemble_fit

    _refuse_single_probe_flags(args, folds)
    fitted, specs = fit_probe_ensemble(
        caches, opts, config, folds=folds, calibrate=args.calibrate == "auto"
    )
    folders = save_ensemble_fit(
        fitted, args.out, caches, signing_key=signing_key, weights=args.weights
    )
    members = _member_rows(args, fitted, caches, folders)
    summary = _summary(args, fitted, specs[0].name, members, folds=folds, point=point)
    atomic_write(args.out / "fit-report.json", json.dumps({"summary": summary}, indent=1))
    if args.exit == "auto":
        print(
            "probeguard fit: no exit head for an ensemble's members (the cascade decides on "
            "one LLM's early layer; an ensemble averages every member's full depth)",
            file=sys.stderr,
        )
    if args.json:
        print_json(summary)
    else:
        _print_ensemble(args, fitted, summary, folds=folds, point=point)
    return 0


def _refuse_single_probe_flags(args: argparse.Namespace, folds: int) -> None:
    """Refuse the selections that pick one probe over one LLM, and a single probe's --out."""
    from probes.checkpoint import MANIFEST_FILE

    refused = [
        ("--val-cache", args.val_cache is not None),
        ("--folds 0", folds < 2),
        ("--depth auto", args.depth == "auto"),
        ("--exit LAYER", args.exit not in ("auto", "off")),
    ]
    for flag, given in refused:
        if given:
            raise SystemExit(
                f"probeguard fit: {flag} selects one probe over one LLM; an ensemble (several "
                "--cache) is selected by cross-validation on the same folds (--folds >= 2)"
            )
    if (args.out / MANIFEST_FILE).exists():
        raise SystemExit(
            f"probeguard fit: {args.out} holds a single probe's checkpoint; write the ensemble "
            "to another --out"
        )


def _member_rows(
    args: argparse.Namespace,
    fitted: EnsembleFit,
    caches: list[HiddenStateCache],
    folders: list[str],
) -> list[dict[str, Any]]:
    """One summary row per member: its LLM, checkpoint folder, epochs and fold figures."""
    from worker.offline.fit_eval import val_figures

    members = []
    for (result, cv), cache, folder in zip(fitted.members, caches, folders, strict=True):
        c = cv.summary()
        members.append(
            {
                "llm": cache.manifest.llm.model_id,
                "checkpoint": str(args.out / folder),
                "layers": list(result.probe.layers),
                "epochs": cv.epochs,
                "train_seconds": round(result.seconds, 2),
                **val_figures(result.val_report),
                **{f"cv_{k}": v for k, v in c.items()},
            }
        )
    return members


def _summary(
    args: argparse.Namespace,
    fitted: EnsembleFit,
    name: str,
    members: list[dict[str, Any]],
    *,
    folds: int,
    point: OperatingPoint,
) -> dict[str, Any]:
    """The ensemble's summary: its members and the mean's out-of-fold figures."""
    from worker.offline.fit_eval import val_figures

    report = fitted.oof_report
    return {
        "checkpoint": str(args.out),
        "probe": name,
        "ensemble": len(members),
        "combine": "mean",
        "members": members,
        "thresholds": fitted.thresholds,
        **val_figures(report),
        "headline": report["headline"],
        "train_seconds": round(fitted.seconds, 2),
        "selection": f"{folds}-fold CV",
        "operating_point": str(point),
    }


def _print_ensemble(
    args: argparse.Namespace,
    fitted: EnsembleFit,
    summary: dict[str, Any],
    *,
    folds: int,
    point: OperatingPoint,
) -> None:
    """A line per member, then the ensemble's line."""
    members = summary["members"]
    report = fitted.oof_report
    for i, m in enumerate(members, start=1):
        print(
            f"member {i} ({m['llm']}): {folds}-fold CV AUPRC {m['cv_auprc_mean']:.3f} ± "
            f"{m['cv_auprc_std']:.3f}, out of fold F1 {m['val_f1']:.3f} AUPRC "
            f"{m['val_auprc']:.3f}, {m['epochs']} epochs, {m['train_seconds']:.0f} s -> "
            f"{m['checkpoint']}"
        )
    print(
        f"{summary['probe']}: ensemble of {len(members)} LLMs' probes (mean of their calibrated "
        f"probabilities), out of fold F1 {report['f1']:.3f}, AUPRC {report['auprc']:.3f}, "
        f"recall at 1 % FPR {report['recall_at_1pct_fpr']:.3f}, ECE {report['ece']:.3f} "
        f"({report['headline']}, thresholds at {point}: {fitted.thresholds}); "
        f"{summary['train_seconds']:.0f} s -> {args.out}"
    )
