"""One served probe's pass over a batch's hidden states: probabilities, decisions and
what the results are built from (a :class:`ProbeRun`).

The batch scorer (:mod:`worker.scoring.batch`) runs one per live and canary version and
turns the runs into results, routing each message to one of them; this module is the
part that reads tensors: the layer selection, the length-grouped probe calls, the pooled
states' RMS for drift, and the decisions per row and head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from probes.decision import Decision, decide, flagging_heads
from probes.drift import drift_score, pooled_rms
from probes.probe import Probe
from schemas import DEFAULT_LIMITS, HeadResult, Limits, ProbeSpec
from worker.llm.plan import CUDA_BATCH_TOKENS, length_batches
from worker.scoring.served import ServedProbe
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.llm.extract import Extraction

__all__ = [
    "PROBE_BATCH_TOKENS",
    "ProbeRun",
    "flag_score",
    "flagged_heads",
    "probe_batch_tokens",
    "run_probe",
    "run_probs",
]


# Padded tokens per probe call (see _probabilities): on the CPU, where every padded token
# costs compute, the extractor's default budget (`BATCH_TOKENS`, one home); elsewhere a
# call's rows in one probe call, where each group would cost its own kernel launches.
PROBE_BATCH_TOKENS: int = Settings.model_fields["batch_tokens"].default


def probe_batch_tokens(device: torch.device) -> int:
    """Padded tokens per probe call for states on ``device``."""
    return PROBE_BATCH_TOKENS if device.type == "cpu" else CUDA_BATCH_TOKENS


@dataclass
class ProbeRun:
    served: ServedProbe
    scores: list[dict[str, float]]
    predicted: list[list[str]]
    flagged: list[bool]
    flag_score: list[float] | None  # highest probability among the flag labels, per row
    non_finite: list[int]  # rows whose probabilities are NaN or inf
    heads: list[dict[str, HeadResult]] | None = None  # per row, of a multi-head probe
    # A multi-head probe's heads with a flag label (by its own spec, whatever the
    # deployment's flag policy), and per row those that flagged: per-head evidence.
    judged: tuple[str, ...] = ()
    head_flags: list[list[str]] | None = None
    rms: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0))  # [L, B] (drift)
    drift_score: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [B]
    forward_s: float = 0.0  # seconds in the probe's own forward pass


def flagged_heads(run: ProbeRun | None, row: int) -> list[str] | None:
    return None if run is None or run.head_flags is None else run.head_flags[row]


def flag_score(run: ProbeRun, row: int) -> float | None:
    if run.flag_score is None:
        return None
    return min(1.0, max(0.0, round(run.flag_score[row], 4)))


def _select_layers(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden[rows]`` for ``[L, B, T, D]``; a view (no copy) when the rows are contiguous."""
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return hidden[first : first + len(rows)]  # [L_probe, B, T, D], a view
    return hidden.index_select(0, torch.tensor(rows, device=hidden.device))


def _probabilities(
    probe: Probe, hidden: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``probe``'s probabilities ``[B, C]`` for ``hidden`` ``[L, B, T, D]``, and the RMS of
    its pooled states ``[L, B]`` (for drift monitoring, from the same pass), run on
    length-sorted groups of rows trimmed to their own width: a poll's padding (its longest
    message's width, for every row) would otherwise cost the probe as much as real tokens,
    and the MHA probe's attention its square. Rows do not interact, so the result is the
    same as one call's."""
    B, T = mask.shape
    budget = probe_batch_tokens(hidden.device)
    if budget >= B * T:
        probs, pooled = probe.predict_proba_pooled(hidden, mask)
        return probs, pooled_rms(pooled)
    out: torch.Tensor | None = None
    rms: torch.Tensor | None = None
    for rows in length_batches(mask.sum(1).tolist(), budget):
        index = torch.tensor(rows, device=mask.device)
        part = mask.index_select(0, index)  # [b, T]
        real = part.any(0).nonzero().flatten()  # columns any of these rows uses
        lo, hi = (int(real[0]), int(real[-1]) + 1) if len(real) else (0, 1)
        probs, pooled = probe.predict_proba_pooled(
            hidden[:, :, lo:hi].index_select(1, index), part[:, lo:hi]
        )
        if out is None or rms is None:
            out = probs.new_empty(B, probs.shape[1])
            rms = torch.empty(pooled.shape[0], B, device=pooled.device)
        out[index] = probs
        rms[:, index] = pooled_rms(pooled)
    assert out is not None and rms is not None
    return out, rms


def _head_results(
    spec: ProbeSpec, decision: Decision, limits: Limits
) -> list[dict[str, HeadResult]]:
    names, flags = decision.label_names(spec), decision.head_flags(spec)
    # Rows share outcomes (most flag nothing): one frozen HeadResult per distinct outcome
    # of a head, not one validated model per row and head.
    built: dict[tuple[str, tuple[str, ...], bool], HeadResult] = {}

    def result(head: str, predicted: tuple[str, ...], flagged: bool) -> HeadResult:
        key = (head, predicted, flagged)
        if key not in built:
            built[key] = HeadResult.build(limits, predicted=list(predicted), flagged=flagged)
        return built[key]

    columns = {h.name: flags[h.name].tolist() for h in spec.heads}
    return [
        {
            h.name: result(
                h.name,
                tuple(x for x in names[row] if x in h.labels),
                bool(columns[h.name][row]),
            )
            for h in spec.heads
        }
        for row in range(len(names))
    ]


def _judged_heads(spec: ProbeSpec, decision: Decision) -> tuple[tuple[str, ...], list[list[str]]]:
    """The heads of ``spec`` (the version's own, unfiltered) that have a flag label, and per
    row those of them that predicted one."""
    judged = tuple(h.name for h in spec.heads if any(x in spec.flag_labels for x in h.labels))
    flags = {h: f.tolist() for h, f in decision.head_flags(spec).items()}  # per head, [B]
    rows = len(decision.flagged)
    return judged, [[h for h in judged if flags[h][row]] for row in range(rows)]


def run_probe(
    served: ServedProbe,
    ex: Extraction,
    layers: tuple[int, ...],
    flag_heads: frozenset[str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> ProbeRun:
    probe = served.probe
    started = time.perf_counter()
    hidden = _select_layers(ex.hidden, [layers.index(layer) for layer in probe.layers])
    probs, rms = _probabilities(probe, hidden, ex.mask)
    forward_s = time.perf_counter() - started
    run = run_probs(served, probs, flag_heads, limits, rms)
    run.forward_s = forward_s
    return run


def run_probs(
    served: ServedProbe,
    probs: torch.Tensor,
    flag_heads: frozenset[str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    rms: torch.Tensor | None = None,
) -> ProbeRun:
    """The results of probabilities ``[B, C]`` by ``served``'s spec; ``rms``: the pooled
    states' RMS ``[L, B]`` for drift monitoring (None: rows decided by an exit head)."""
    probe = served.probe
    spec = flagging_heads(probe.spec, flag_heads)
    probs = probs.float().cpu()  # [B, C]
    non_finite = (~torch.isfinite(probs).all(dim=1)).nonzero().flatten().tolist()
    probs = torch.nan_to_num(probs, nan=0.0, posinf=1.0, neginf=0.0)  # those rows go unused
    decision = decide(spec, probs)
    flag_idx = [spec.labels.index(label) for label in spec.flag_labels]
    values = probs.tolist()
    judged, head_flags = _judged_heads(probe.spec, decision) if spec.heads else ((), None)
    return ProbeRun(
        served=served,
        scores=[dict(zip(spec.labels, row, strict=True)) for row in values],
        predicted=decision.label_names(spec),
        flagged=[bool(f) for f in decision.flagged.tolist()],
        flag_score=probs[:, flag_idx].max(dim=1).values.tolist() if flag_idx else None,
        non_finite=non_finite,
        heads=_head_results(spec, decision, limits) if spec.heads else None,
        judged=judged,
        head_flags=head_flags,
        rms=rms.float().cpu() if rms is not None else torch.empty(0, 0),
        drift_score=drift_score(probe.spec, probs),
    )
