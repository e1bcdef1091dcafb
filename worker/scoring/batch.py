"""Scoring a batch of chat messages with every configured probe in one LLM pass.

    texts -> extractor (union of the layers every served probe reads, early exit)
          -> per probe: live (and canary) probabilities -> decide() -> ProbeResult

The cascade: when one probe is served and its versions carry exit heads at one layer (see
:mod:`probes.exit`), the extractor asks that exit head about every message once that
layer is computed; a message whose calibrated score is confidently outside the review
band (:class:`ExitPolicy`) takes the exit head's probabilities as its result
(``ProbeResult.depth`` names the layer) and leaves the forward pass; only the others run
on to the full probe. A canary judges the messages routed to it with its own exit head;
in shadow mode, or with several probes, every message runs to full depth. Messages
decided early count as evidence for their version like any other; drift monitoring reads
only the messages that reached the full probe (the pooled states it compares are the
full probe's).

Which version decides a message is sticky: a hash of the conversation id (else
the message id) below the canary share sends it to the canary, so a conversation
sees one version throughout and the canary gets about ``canary_share`` of the
conversations. The hash is salted with the probe name (not the version), so successive
canaries see the same conversations, and with a secret derived from the checkpoint key
when there is one, so a client that picks its own ids cannot pick which version judges
it. In shadow mode the live version
always decides and the canary's scores ride along in ``ProbeResult.shadow``.

Each result also yields a :class:`~schemas.ProbeDecision` (which version decided,
its flag and flag score, the canary it stood in for or was shadowed by, and for a
multi-head probe the heads that flagged): the scorer stores it for label joins and
counts it as evidence, per head over the heads each version judges (``BatchScores.heads``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from probes.decision import Decision, decide, flagging_heads
from probes.drift import drift_score, pooled_rms
from probes.exit import exit_probabilities, exits
from probes.probe import Probe
from schemas import (
    DEFAULT_LIMITS,
    ChatMessage,
    CheckpointManifest,
    HeadResult,
    Limits,
    ProbeDecision,
    ProbeResult,
    ProbeSpec,
    ShadowResult,
)
from worker.llm.extract import ExitStage
from worker.llm.plan import CUDA_BATCH_TOKENS, length_batches
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.llm.extract import Extraction, HiddenStateExtractor
    from worker.settings import Settings

__all__ = [
    "BatchScorer",
    "BatchScores",
    "ExitPolicy",
    "ProbeSlot",
    "ServedProbe",
    "sticky_fraction",
]


def sticky_fraction(key: str, salt: str = "") -> float:
    """A stable number in [0, 1) for ``key``: the same key always lands on the same side."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class ServedProbe:
    """A verified probe and the manifest it came with."""

    probe: Probe
    manifest: CheckpointManifest

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass
class ProbeSlot:
    """What one probe name serves right now."""

    name: str
    live: ServedProbe | None = None
    canary: ServedProbe | None = None
    canary_share: float = 0.0

    def layers(self) -> set[int]:
        return {layer for p in (self.live, self.canary) if p for layer in p.probe.layers}


@dataclass(frozen=True)
class ExitPolicy:
    """When the cascade's exit heads may decide (``PROBEGUARD_EXIT*``): ``allow_below`` and
    ``flag_above`` override a checkpoint's own thresholds (None: keep them)."""

    enabled: bool = True
    allow_below: float | None = None
    flag_above: float | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> ExitPolicy:
        return cls(
            enabled=settings.exit == "on",
            allow_below=settings.exit_allow_below,
            flag_above=settings.exit_flag_above,
        )

    def thresholds(self, spec: ProbeSpec) -> tuple[float, float | None]:
        """``(allow_below, flag_above)`` for a probe with an exit head."""
        if spec.exit is None:
            return 0.0, None
        low = spec.exit.allow_below if self.allow_below is None else self.allow_below
        high = spec.exit.flag_above if self.flag_above is None else self.flag_above
        return low, high


NO_EXITS = ExitPolicy(enabled=False)


@dataclass
class BatchScores:
    results: dict[int, list[ProbeResult]]  # input position -> one result per probe
    errors: dict[int, str]  # input position -> why it could not be scored
    extract_s: float = 0.0
    # CPU seconds of the whole process (every thread: the LLM's intra-op threads too)
    # while the LLM ran: what sizing subtracts to see the cost around the model.
    extract_cpu_s: float = 0.0
    probe_s: float = 0.0  # everything after the extraction: the probes and the results
    build_s: float = 0.0  # of probe_s, building the results from the probabilities
    flag_scores: dict[tuple[int, str], float] = field(default_factory=dict)
    # (input position, probe) -> how it was decided, for evidence and label joins
    decisions: dict[tuple[int, str], ProbeDecision] = field(default_factory=dict)
    # (probe, version) -> the heads a multi-head version judged (those with a flag label):
    # every message it decided or shadowed counts for each of them in its per-head evidence
    heads: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)
    # (probe, version) -> what drift monitoring reads of every scored row: the pooled-state
    # RMS per layer [L, n] and the drift score [n] (see probes.drift), live and canary alike
    drift: dict[tuple[str, int], tuple[ServedProbe, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )


class BatchScorer:
    """Scores messages with every slot that has a live probe."""

    def __init__(
        self,
        extractor: HiddenStateExtractor,
        slots: Mapping[str, ProbeSlot] | Callable[[], Mapping[str, ProbeSlot]],
        *,
        shadow: bool = False,
        flag_heads: frozenset[str] | None = None,
        limits: Limits = DEFAULT_LIMITS,
        route_salt: str = "",
        exit_policy: ExitPolicy = NO_EXITS,
    ) -> None:
        """``slots``: the slots, or a function returning what is served now (a watcher's
        snapshot, see :mod:`worker.scoring.probe_watch`), read once per batch.
        ``flag_heads``: the heads of multi-head probes that may flag (``None``: every head
        with a flag label; see :func:`probes.decision.flagging_heads`). ``limits``: the
        deployment's wire limits, which the results are built against (a probe with more
        labels than the default allows must still produce results). ``route_salt``: the
        deployment's secret salt of the canary split (``Settings.routing_salt``).
        ``exit_policy``: whether and where exit heads decide (default: never)."""
        self.extractor = extractor
        self.exit_policy = exit_policy
        self.route_salt = route_salt
        self._slots = slots
        self.shadow = shadow
        self.flag_heads = flag_heads
        self.limits = limits

    @property
    def slots(self) -> Mapping[str, ProbeSlot]:
        return self._slots() if callable(self._slots) else self._slots

    def ready(self) -> bool:
        slots = self.slots
        return bool(slots) and all(s.live is not None for s in slots.values())

    def layers(self, slots: Mapping[str, ProbeSlot] | None = None) -> tuple[int, ...]:
        slots = self.slots if slots is None else slots
        return tuple(sorted(set().union(*(s.layers() for s in slots.values()))))

    def sends_to_canary(self, msg: ChatMessage, slot: ProbeSlot) -> bool:
        """Whether ``msg``'s conversation falls in the canary's share (sticky)."""
        key = msg.conversation_id or msg.message_id
        return sticky_fraction(key, slot.name + self.route_salt) < slot.canary_share

    def score(self, messages: Sequence[ChatMessage]) -> BatchScores:
        """Every probe's result per message; a message some probe cannot score (its
        probabilities are not finite, e.g. a half-precision overflow) is named in
        ``errors`` instead, and costs no other message its result."""
        slots = self.slots  # one snapshot for the whole batch: no batch mixes versions
        layers = self.layers(slots)
        t0, cpu0 = time.perf_counter(), time.process_time()
        texts = [m.text for m in messages]
        stage = self._exit_stage(slots, layers, messages)
        if stage is None:
            ex = self.extractor.extract(texts, layers)
        else:
            ex = self.extractor.extract_staged(texts, layers, stage)
        t1, extract_cpu_s = time.perf_counter(), time.process_time() - cpu0
        out = BatchScores(results={}, errors=dict(ex.errors))
        runs: dict[str, tuple[_Run, _Run | None]] = {}
        bad: dict[int, str] = {}  # row -> why
        if ex.index:
            for slot in slots.values():
                if slot.live is None:
                    continue
                live = _run(slot.live, ex, layers, self.flag_heads, self.limits)
                canary = None
                if slot.canary is not None and slot.canary.version != slot.live.version:
                    canary = _run(slot.canary, ex, layers, self.flag_heads, self.limits)
                runs[slot.name] = (live, canary)
                for r in (live, canary):
                    if r is None:
                        continue
                    for row in r.non_finite:
                        bad.setdefault(row, f"{slot.name} v{r.served.version} scored NaN or inf")
        for row, pos in enumerate(ex.index):
            if row in bad:
                out.errors[pos] = bad[row]
            else:
                out.results[pos] = []
        good = [row for row in range(len(ex.index)) if row not in bad]
        for name, (live, canary) in runs.items():
            self._score_slot(slots[name], live, canary, ex.index, messages, out)
            for r in (live, canary):
                if r is not None and good:
                    key = (name, r.served.version)
                    out.drift[key] = (r.served, r.rms[:, good], r.drift_score[good])
        if ex.exited and ex.exit_layer is not None:
            self._score_exited(slots, ex.exited, ex.exit_layer, messages, out)
        out.extract_s, out.probe_s = t1 - t0, time.perf_counter() - t1
        out.extract_cpu_s = extract_cpu_s
        forward_s = sum(r.forward_s for pair in runs.values() for r in pair if r is not None)
        out.build_s = max(0.0, out.probe_s - forward_s)
        return out

    def _exit_stage(
        self,
        slots: Mapping[str, ProbeSlot],
        layers: tuple[int, ...],
        messages: Sequence[ChatMessage],
    ) -> ExitStage | None:
        """The exit stage for this batch, or None when the cascade cannot run (see the
        module docstring)."""
        served = [s for s in slots.values() if s.live is not None]
        if not self.exit_policy.enabled or len(served) != 1 or not layers:
            return None
        slot = served[0]
        live = slot.live
        assert live is not None
        canary = slot.canary if slot.canary and slot.canary.version != live.version else None
        exit_spec = live.probe.spec.exit
        if exit_spec is None or exit_spec.layer >= max(layers):
            return None
        if canary is not None and (
            self.shadow
            or canary.probe.spec.exit is None
            or canary.probe.spec.exit.layer != exit_spec.layer
        ):
            return None
        policy = self.exit_policy

        def leaves(served: ServedProbe, probs: torch.Tensor) -> torch.Tensor:
            low, high = policy.thresholds(served.probe.spec)
            return exits(served.probe.spec, probs, low, high, use_flag_above=True)

        def decide(
            states: torch.Tensor, mask: torch.Tensor, positions: list[int]
        ) -> tuple[torch.Tensor, torch.Tensor]:
            probs = exit_probabilities(live.probe, states, mask).float().cpu()  # [b, C]
            leave = leaves(live, probs)
            if canary is None:
                return leave, probs
            canary_probs = exit_probabilities(canary.probe, states, mask).float().cpu()
            routed = torch.tensor([self.sends_to_canary(messages[p], slot) for p in positions])
            leave = torch.where(routed, leaves(canary, canary_probs), leave)
            return leave, torch.cat([probs, canary_probs], dim=1)  # [b, 2C]

        return ExitStage(exit_spec.layer, decide)

    def _score_exited(
        self,
        slots: Mapping[str, ProbeSlot],
        exited: dict[int, torch.Tensor],
        depth: int,
        messages: Sequence[ChatMessage],
        out: BatchScores,
    ) -> None:
        """Results of the messages the exit heads decided (their payload: the live exit
        head's probabilities, then the canary's when there is one)."""
        slot = next(s for s in slots.values() if s.live is not None)
        assert slot.live is not None
        positions = sorted(exited)
        payload = torch.stack([exited[p] for p in positions])  # [n, C] or [n, 2C]
        C = len(slot.live.probe.spec.labels)
        live = _run_probs(slot.live, payload[:, :C], self.flag_heads, self.limits)
        canary = None
        if payload.shape[1] > C and slot.canary is not None:
            canary = _run_probs(slot.canary, payload[:, C:], self.flag_heads, self.limits)
        for pos in positions:
            out.results[pos] = []
        self._score_slot(slot, live, canary, positions, messages, out, depth=depth)

    def _score_slot(
        self,
        slot: ProbeSlot,
        live: _Run,
        canary: _Run | None,
        positions: list[int],
        messages: Sequence[ChatMessage],
        out: BatchScores,
        *,
        depth: int | None = None,
    ) -> None:
        """Results of the messages at ``positions`` (row ``i`` of the runs is
        ``positions[i]``); ``depth``: the exit layer that decided them, None: full depth."""
        shadowed = canary if self.shadow else None  # scored for comparison, never acting
        for r in (live, canary):
            if r is not None and r.judged:
                out.heads[(slot.name, r.served.version)] = r.judged
        for row, pos in enumerate(positions):
            if pos not in out.results:
                continue  # some probe could not score it
            msg = messages[pos]
            use_canary = canary is not None and not self.shadow and self.sends_to_canary(msg, slot)
            decided = canary if use_canary and canary is not None else live
            shadow = None
            if shadowed is not None:
                shadow = ShadowResult.build(
                    self.limits,
                    version=shadowed.served.version,
                    scores=shadowed.scores[row],
                    predicted=shadowed.predicted[row],
                )
            out.decisions[(pos, slot.name)] = ProbeDecision(
                v=decided.served.version,
                f=decided.flagged[row],
                s=_score(decided, row),
                c=canary.served.version if canary is not None and not use_canary else None,
                sv=shadowed.served.version if shadowed is not None else None,
                sf=shadowed.flagged[row] if shadowed is not None else None,
                ss=_score(shadowed, row) if shadowed is not None else None,
                h=_flagged_heads(decided, row),
                sh=_flagged_heads(shadowed, row),
            )
            result = ProbeResult.build(
                self.limits,
                probe=slot.name,
                version=decided.served.version,
                scores=decided.scores[row],
                predicted=decided.predicted[row],
                flagged=decided.flagged[row],
                canary=use_canary,
                shadow=shadow,
                heads=decided.heads[row] if decided.heads is not None else None,
                depth=depth,
            )
            out.results[pos].append(result)
            if decided.flag_score is not None:
                out.flag_scores[(pos, slot.name)] = decided.flag_score[row]


# Padded tokens per probe call (see _probabilities): on the CPU, where every padded token
# costs compute, the extractor's default budget (`BATCH_TOKENS`, one home); elsewhere a
# call's rows in one probe call, where each group would cost its own kernel launches.
PROBE_BATCH_TOKENS: int = Settings.model_fields["batch_tokens"].default


def probe_batch_tokens(device: torch.device) -> int:
    """Padded tokens per probe call for states on ``device``."""
    return PROBE_BATCH_TOKENS if device.type == "cpu" else CUDA_BATCH_TOKENS


@dataclass
class _Run:
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


def _flagged_heads(run: _Run | None, row: int) -> list[str] | None:
    return None if run is None or run.head_flags is None else run.head_flags[row]


def _score(run: _Run, row: int) -> float | None:
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


def _run(
    served: ServedProbe,
    ex: Extraction,
    layers: tuple[int, ...],
    flag_heads: frozenset[str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> _Run:
    probe = served.probe
    started = time.perf_counter()
    hidden = _select_layers(ex.hidden, [layers.index(layer) for layer in probe.layers])
    probs, rms = _probabilities(probe, hidden, ex.mask)
    forward_s = time.perf_counter() - started
    run = _run_probs(served, probs, flag_heads, limits, rms)
    run.forward_s = forward_s
    return run


def _run_probs(
    served: ServedProbe,
    probs: torch.Tensor,
    flag_heads: frozenset[str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    rms: torch.Tensor | None = None,
) -> _Run:
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
    return _Run(
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
