"""What ``probeguard fit`` reports of a fit: the summary it prints (or its ``--json``) and
``fit-report.json`` beside the checkpoint (history, validation report, folds, depth table).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from probes.files import atomic_write
from probes.offline.cv import CVResult
from probes.offline.depth import DepthSearch
from probes.offline.fit import FitResult
from schemas import OperatingPoint
from worker.offline.fit_eval import ProbeOptions, val_figures

__all__ = ["fit_summary", "write_fit_report"]


def fit_summary(
    result: FitResult,
    out: Path,
    opts: ProbeOptions,
    *,
    selection: str,
    point: OperatingPoint,
    cv: CVResult | None = None,
    depth: DepthSearch | None = None,
) -> dict[str, Any]:
    """What ``fit`` reports of a fit saved to ``out``: the probe, the validation figures
    (cross-validated ones with ``cv``; recall at 1 % FPR and ECE beside F1 and AUPRC), how
    it was selected, the depth search's choice, the calibration per head ({}: none)."""
    report = result.val_report
    summary = {
        "checkpoint": str(out),
        "probe": result.probe.spec.name,
        "token_pool": opts.token_pool,
        "layer_mix": opts.layer_mix,
        "layers": list(result.probe.layers),
        "parameters": result.probe.num_parameters(),
        "epochs": result.epochs,
        "best_epoch": result.best_epoch,
        "final": f"soup of {result.soup_of} folds" if result.soup_of else "trained",
        "train_seconds": round(result.seconds, 2),
        "thresholds": result.probe.spec.thresholds,
        **val_figures(report),
        "val_accuracy": report["accuracy"],
        "val_macro_f1": report["macro_f1"],
        "headline": report["headline"],
        "layer_entropy": result.probe.layer_entropy(),
        "selection": selection,
        "operating_point": str(point),
    }
    if depth is not None:
        summary.update(
            depth_chosen=depth.chosen, depth_best=depth.best, depth_epsilon=depth.epsilon
        )
    if cv is not None:
        summary.update({f"cv_{k}": v for k, v in cv.summary().items()})
        summary.update({f"cv_{k}": v for k, v in cv.calibration_report.items()})
    summary["calibration"] = {
        name: {"temperature": round(c.temperature, 4), "bias": c.bias}
        for name, c in result.probe.spec.calibration.items()
    }
    return summary


def write_fit_report(
    out: Path,
    summary: dict[str, Any],
    result: FitResult,
    *,
    cv: CVResult | None = None,
    depth: DepthSearch | None = None,
) -> None:
    """``out/fit-report.json``: the summary, the training history, the validation report,
    each fold and the depth table."""
    atomic_write(
        out / "fit-report.json",
        json.dumps(
            {
                "summary": summary,
                "history": result.history,
                "val_report": result.val_report,
                "folds": [vars(f) for f in cv.folds] if cv is not None else [],
                "depth": depth.table() if depth is not None else None,
            },
            default=str,
            indent=1,
        ),
    )
