"""Publish-time calibration: a learner's thresholds (and calibration) refitted on its
prequential window, the online counterpart of ``fit`` choosing them out of fold.

Apart from :mod:`worker.learning.online_learner` because it reads only the probe and the
window, never the optimizer or replay.
"""

from __future__ import annotations

import logging

import torch

from probes.calibration import fit_heads
from probes.metrics import choose_thresholds
from probes.probe import Probe
from schemas import OperatingPoint
from worker.learning.replay import Prequential

__all__ = ["recalibrate"]

log = logging.getLogger(__name__)


def recalibrate(
    probe: Probe,
    prequential: Prequential,
    *,
    min_positives: int,
    labels_seen: int,
    point: OperatingPoint,
) -> None:
    """Flag thresholds at ``point`` (default: the F1 maximum) on the prequential window.
    Each label's threshold moves only once the window holds ``min_positives`` of its
    positives (``calibrate_min_positives``; 0: never).

    A probe that carries a calibration (``fit``'s, :mod:`probes.calibration`) has it
    refitted first on the window's uncalibrated logits, head by head: a head whose window
    rows hold ``min_positives`` positives of each of its labels gets a new temperature and
    bias (so all its labels get new thresholds too, chosen on the probabilities under it).
    One without that evidence keeps both its calibration and its thresholds, a pair that
    still makes the same decisions on the same logits; how many labels the probe learned
    since its calibration was fitted (``labels_seen`` now) is ``calibration_age/<head>`` in
    :meth:`~worker.learning.online_learner.OnlineLearner.metrics` (the manifest). Refitting
    rather than dropping it: dropping would throw the served scores back to the
    class-balanced loss's scale (about half flagged) after a handful of labels, when the
    calibration is still nearly right, and a threshold on a softmax over more than two
    labels has no exact counterpart without it. A probe without a calibration gets none
    here."""
    need = min_positives
    window = prequential.logit_window()
    if not need or window is None:
        return
    logits, targets = window
    spec = probe.spec
    probs = torch.stack(list(prequential.probs))  # [N, C] as they were served
    if spec.calibration:
        refit = fit_heads(spec, logits, targets, min_positives=need, labels_seen=labels_seen)
        if refit:
            probe.set_calibration({**spec.calibration, **refit})
            spec = probe.spec
        kept = sorted(set(spec.calibration) - set(refit))
        if kept:
            log.info(
                "calibration of heads %s kept: the window holds fewer than %d positives "
                "of one of their labels",
                kept,
                need,
            )
        probs = probe.probabilities(logits)  # the window under the calibration now
    chosen = choose_thresholds(spec, probs, targets, min_positives=need, point=point)
    if chosen:
        probe.set_thresholds({**spec.thresholds, **chosen})
