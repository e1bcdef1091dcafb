"""The arguments ``probeguard fit`` accepts, in the order ``--help`` lists them.

Kept apart from :mod:`worker.commands.fit`, which runs the fit: the argument groups and
their help are most of the command's text and read on their own.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from worker.commands._common import layer_list

if TYPE_CHECKING:
    from probes.offline.fit import FitConfig
    from worker.offline.fit_eval import ProbeOptions

__all__ = ["add_fit_arguments"]


def add_fit_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``fit`` argument: caches, selection, probe, depth, training, weights, exit."""
    from probes.offline.fit import FitConfig
    from worker.offline.fit_eval import ProbeOptions

    d, o = FitConfig(), ProbeOptions()
    p.add_argument(
        "--cache",
        type=Path,
        action="append",
        required=True,
        help="training cache (cache build). Give it once per LLM, each a cache of the same "
        "labeled file, to fit an ensemble: one probe per LLM on the same folds, their "
        "calibrated probabilities averaged, the thresholds chosen on that mean (--out then "
        "holds ensemble.json and a checkpoint folder per member)",
    )
    _selection_args(p)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    _probe_args(p, o)
    _depth_args(p)
    _training_args(p, d)
    p.add_argument(
        "--weights",
        choices=["fp32", "int8"],
        default="fp32",
        help="how the checkpoint stores the probe weights: int8 with per-row scales is about a "
        "quarter of the bytes and is dequantized to fp32 on load (default: fp32)",
    )
    _exit_args(p)
    p.add_argument(
        "--calibrate",
        choices=["auto", "off"],
        default="auto",
        help="'auto' (with cross-validation): fit each head's temperature and per-label bias "
        "on the out-of-fold logits, so its scores read as probabilities (ECE), and choose "
        "the thresholds on the calibrated scores; the checkpoint carries both. 'off': raw "
        "scores, as before (default: auto)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")


def _selection_args(p: argparse.ArgumentParser) -> None:
    """How the epochs and thresholds are chosen: folds, a validation cache or a split."""
    p.add_argument(
        "--val-cache", type=Path, help="select on this validation cache instead of by folds"
    )
    p.add_argument(
        "--folds",
        type=int,
        default=None,
        help="cross-validation folds (default: 3; 0 = one --val-fraction split); k folds are "
        "k fits, each on (k-1)/k of the rows (MHA on ToxicChat's 2.5k rows: ~5 min on 2 CPU "
        "cores with 3)",
    )
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out with --folds 0")
    p.add_argument(
        "--final",
        choices=["soup", "refit"],
        default="soup",
        help="with cross-validation, the probe written: 'soup' = the average of the fold "
        "models' weights at the chosen epoch (no further training; its thresholds were chosen "
        "on those models' out-of-fold scores), 'refit' = one more fit on every row (default: "
        "soup; it falls back to refit when the average scores worse than the folds did)",
    )
    p.add_argument(
        "--operating-point",
        default="f1",
        help="where flag thresholds go: 'f1' (its maximum), 'precision>=0.9' (the most recall "
        "at that precision), 'recall>=0.8' (default: f1)",
    )


def _probe_args(p: argparse.ArgumentParser, o: ProbeOptions) -> None:
    """The probe's kind, layers, labels and MHA shape."""
    from probes import LAYER_MIXES, TOKEN_POOLS

    p.add_argument(
        "--pool",
        choices=sorted(TOKEN_POOLS),
        help=f"token pooling kind (default: {o.token_pool}, the best on held-out data)",
    )
    p.add_argument("--probe", dest="pool_deprecated", help=argparse.SUPPRESS)
    p.add_argument(
        "--layer-mix", choices=sorted(LAYER_MIXES), default="scalar_mix", help="default: scalar_mix"
    )
    p.add_argument(
        "--layers",
        type=layer_list,
        default=None,
        help="hidden-state indices, e.g. 12 or 4,8,12 or 2-20 (default: every cached layer "
        "the probe kind can use; 'single' needs exactly one)",
    )
    p.add_argument(
        "--target",
        choices=["label", "labels"],
        default="label",
        help="'label' = multiclass over the label field; 'labels' = multilabel (default: label)",
    )
    p.add_argument(
        "--flag-labels",
        default=None,
        help="comma-separated labels that flag a message (default: the minority class of a "
        "binary task, every label of a multilabel task, none otherwise)",
    )
    p.add_argument("--name", default=None, help="probe name (default: <pool>-<layer-mix>)")
    p.add_argument("--d-inner", type=int, default=o.d_inner, help="MHA inner size (%(default)s)")
    p.add_argument("--num-heads", type=int, default=o.num_heads, help="MHA heads (%(default)s)")
    p.add_argument("--heads", type=int, dest="heads_deprecated", help=argparse.SUPPRESS)
    p.add_argument("--no-layer-norm", action="store_true", help="MHA without input LayerNorm")
    p.add_argument("--dropout", type=float, default=o.dropout)


def _depth_args(p: argparse.ArgumentParser) -> None:
    """``--depth auto``: the search for the shallowest probe that is good enough."""
    p.add_argument(
        "--depth",
        choices=["full", "auto"],
        default="full",
        help="'auto': search the depth/quality trade-off. Each candidate deepest layer is "
        "cross-validated with the layers up to it; the probe keeps the shallowest whose mean "
        "fold AUPRC is within --depth-epsilon of the best, so the scorer's forward pass stops "
        "there. Prints the table per depth and records the choice in the checkpoint. Costs "
        "--folds fits per candidate (fewer layers are cheaper): MHA on ToxicChat's 2.5k rows, "
        "8 candidates x 3 folds is most of an hour on 2 CPU cores; --depth-candidates "
        "11,15,30 cuts it to under half. (default: full, every layer of --layers)",
    )
    p.add_argument(
        "--depth-epsilon",
        type=float,
        default=0.01,
        help="with --depth auto: AUPRC a shallower probe may give up (%(default)s = 1 point)",
    )
    p.add_argument(
        "--depth-candidates",
        type=layer_list,
        default=None,
        help="with --depth auto: the deepest layers to try, e.g. 11,15,30 (default: every "
        "layer the probe would read)",
    )


def _training_args(p: argparse.ArgumentParser, d: FitConfig) -> None:
    """Lion, the loss and the mini-batches."""
    p.add_argument("--epochs", type=int, default=d.max_epochs, help="maximum epochs (%(default)s)")
    p.add_argument(
        "--patience", type=int, default=d.patience, help="early-stopping patience in epochs"
    )
    p.add_argument("--lr", type=float, default=d.lr, help="Lion learning rate (%(default)s)")
    p.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help="decoupled (%(default)s)"
    )
    p.add_argument(
        "--layer-lr-scale",
        type=float,
        default=d.layer_lr_scale,
        help="learning-rate multiplier of the layer-mix scalars (%(default)s)",
    )
    p.add_argument(
        "--mix-entropy",
        type=float,
        default=d.mix_entropy,
        help="weight of the layer-mix entropy penalty against collapse (%(default)s)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="mini-batch size, <= 256")
    p.add_argument("--balance", choices=["weights", "sampler", "none"], default=d.balance)
    p.add_argument("--monitor", choices=["auprc", "f1", "loss"], default=d.monitor)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-standardize", action="store_true", help="skip input standardization")
    p.add_argument(
        "--token-dtype",
        choices=["float32", "bfloat16"],
        default=d.token_dtype,
        help="dtype the MHA kind's padded token states are kept and projected in while "
        "training (%(default)s); bfloat16 halves their memory and, on a CPU with bf16 dot "
        "products (AVX512-BF16, AMX), runs an epoch 1.4x faster (a whole fit about 1.2x) at "
        "bf16's rounding (on ToxicChat held out: the same AUPRC); elsewhere bf16 is emulated "
        "and slower",
    )
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="recompute MHA attention in the backward pass (less memory, more compute)",
    )


def _exit_args(p: argparse.ArgumentParser) -> None:
    """``--exit``: the search for the cascade's early exit head."""
    p.add_argument(
        "--exit",
        default="auto",
        help="the cascade's exit head: 'auto' (with cross-validation: search the probe's "
        "layers below its deepest for an exit head and threshold whose cascade keeps the "
        "out-of-fold AUPRC within --exit-epsilon, attach the cheapest that saves >= 15%% of "
        "the forward pass), a layer number (search that layer only), or 'off'",
    )
    p.add_argument(
        "--exit-epsilon",
        type=float,
        default=0.005,
        help="with --exit: AUPRC the cascade may give up (%(default)s = 0.5 point)",
    )
    p.add_argument(
        "--exit-max-missed",
        type=float,
        default=0.05,
        help="with --exit: the largest share of the flagged training rows a threshold may "
        "allow early, out of fold (%(default)s); the AUPRC alone is measured against the "
        "fold models, weaker than the probe served, and understates what misses cost",
    )
    p.add_argument(
        "--exit-pool",
        choices=["auto", "mean", "mha"],
        default="auto",
        help="with --exit: the exit head's token aggregation: 'mha' (the multi-head "
        "attention kind over the exit layer's tokens, for the full probe's epochs: about 20 s "
        "per layer for 3 folds on ToxicChat; ranks the hard cases a mean hides), 'mean' (a "
        "linear head on the exit layer's masked means: seconds), 'auto' (mha when the "
        "probe reads tokens, else mean) (default: %(default)s)",
    )
