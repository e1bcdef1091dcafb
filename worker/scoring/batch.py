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

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from probes.exit import exit_probabilities, exits
from schemas import (
    DEFAULT_LIMITS,
    ChatMessage,
    Limits,
    ProbeDecision,
    ProbeResult,
    ProbeSpec,
    ShadowResult,
)
from worker.llm.extract import ExitStage
from worker.scoring.probe_run import ProbeRun, flag_score, flagged_heads, run_probe, run_probs
from worker.scoring.served import ProbeSlot, ServedProbe, sticky_fraction
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.llm.extract import Extraction, HiddenStateExtractor

__all__ = ["BatchScorer", "BatchScores", "ExitPolicy"]


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
    # (probe, version) -> the spec of each version served when the batch was scored (what
    # a result's labels mean, however the watcher swaps since)
    specs: dict[tuple[str, int], ProbeSpec] = field(default_factory=dict)


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

    def score(
        self, messages: Sequence[ChatMessage], states: Extraction | None = None
    ) -> BatchScores:
        """Every probe's result per message; a message some probe cannot score (its
        probabilities are not finite, e.g. a half-precision overflow) is named in
        ``errors`` instead, and costs no other message its result.

        ``states``: the messages' states, already computed (the inline guard's, from the
        serving model's own passes); used when they hold every layer the served probes
        read, else (a probe swapped in that reads others) the extractor runs as without."""
        slots = self.slots  # one snapshot for the whole batch: no batch mixes versions
        layers = self.layers(slots)
        t0, cpu0 = time.perf_counter(), time.process_time()
        ex = states.select(layers) if states is not None else None
        if ex is None:
            ex = self._extract(slots, layers, messages)
        t1, extract_cpu_s = time.perf_counter(), time.process_time() - cpu0
        out = BatchScores(results={}, errors=dict(ex.errors))
        out.specs = {
            (name, p.version): p.probe.spec
            for name, slot in slots.items()
            for p in (slot.live, slot.canary)
            if p is not None
        }
        runs: dict[str, tuple[ProbeRun, ProbeRun | None]] = {}
        bad: dict[int, str] = {}  # row -> why
        if ex.index:
            for slot in slots.values():
                if slot.live is None:
                    continue
                live = run_probe(slot.live, ex, layers, self.flag_heads, self.limits)
                canary = None
                if slot.canary is not None and slot.canary.version != slot.live.version:
                    canary = run_probe(slot.canary, ex, layers, self.flag_heads, self.limits)
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

    def _extract(
        self,
        slots: Mapping[str, ProbeSlot],
        layers: tuple[int, ...],
        messages: Sequence[ChatMessage],
    ) -> Extraction:
        texts = [m.text for m in messages]
        stage = self._exit_stage(slots, layers, messages)
        if stage is None:
            return self.extractor.extract(texts, layers)
        return self.extractor.extract_staged(texts, layers, stage)

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
        live = run_probs(slot.live, payload[:, :C], self.flag_heads, self.limits)
        canary = None
        if payload.shape[1] > C and slot.canary is not None:
            canary = run_probs(slot.canary, payload[:, C:], self.flag_heads, self.limits)
        for pos in positions:
            out.results[pos] = []
        self._score_slot(slot, live, canary, positions, messages, out, depth=depth)

    def _score_slot(
        self,
        slot: ProbeSlot,
        live: ProbeRun,
        canary: ProbeRun | None,
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
                s=flag_score(decided, row),
                c=canary.served.version if canary is not None and not use_canary else None,
                sv=shadowed.served.version if shadowed is not None else None,
                sf=shadowed.flagged[row] if shadowed is not None else None,
                ss=flag_score(shadowed, row) if shadowed is not None else None,
                h=flagged_heads(decided, row),
                sh=flagged_heads(shadowed, row),
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
