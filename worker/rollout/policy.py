"""Canary rollout's automatic policy: a pure function of the numbers, no I/O.

    candidate --(newest, none on trial)--> canary --(enough labels, F1 holds)--> live
                                              \\--(errors | flag rate | F1 worse)--> rolled back
                                              \\--(enough labels, neither)-------> cleared

:func:`next_action` looks only at numbers (:class:`Situation`) and returns a
:class:`RolloutDecision`; :class:`worker.rollout.changes.Rollout` reads the registry and
the evidence, applies decisions as compare-and-set stage changes (an operator's
concurrent change wins and the policy looks again next time), and offers the same
operations to the operator CLI. The active updater evaluates the policy between
batches, so there is one automatic writer per probe.

The rules, in order (all thresholds are settings, see :class:`Policy`):

1. pinned, or mode ``manual``: no automatic change at all.
2. no canary on trial: in mode ``canary`` the newest published version that is newer
   than live, never tried and never rolled back becomes the canary at
   ``canary_share`` (older candidates are superseded); when nothing is live yet it
   goes live at once (there is nothing to compare it with).
3. a canary on trial (in modes ``canary`` and ``auto_live``, where an operator may
   start one) is **rolled back** when scorers refused to load it and none loaded it
   (after ``refusal_grace_s``, so every scorer had a stage check to try; a version
   another scorer serves is fine, and the refusing scorer is misconfigured); when its flag
   rate departs from live's by more than a factor ``k`` (both over at least
   ``rollback_min_messages`` messages; rates smoothed as ``(flags+1)/(n+2)`` so zero
   rates compare sanely); when its F1 on at least ``rollback_min_labels`` labels is
   worse than live's by more than ``δ``. It is **promoted** once it has
   ``promote_min_labels`` labels from at least ``promote_min_labelers`` distinct
   labelers (one labeler alone, who may label the canary's messages first, cannot promote
   it) and its F1 is at least live's − ``ε``; with that many
   labels and F1 between the two, the trial ends without a verdict (**cleared**) so
   the next candidate gets its turn. A version that was rolled back is never
   promoted automatically, even if an operator trials it again.
4. a multi-head canary is also judged **per head** (each head it and live both judge,
   on that head's own evidence): **rolled back**, naming the head, when the head's flag
   rate departs from live's by more than ``k`` (the same message minimums, and at least
   ``rollback_head_min_flags`` flags on one side: a rare head's two or three flags
   differ by a factor by chance), or when its F1 is worse than live's by more than ``δ``
   (``rollback_min_labels`` labels of that head each); the worst head is named. A head
   with ``promote_min_labels`` labels whose F1 is not within ``ε`` of live's ends the
   trial without a verdict: promotion needs every head to pass.

Live's numbers for the comparison come from the same period: the live decisions
made while this canary was on trial (``bl_*`` evidence); when those are too few
(e.g. a canary share of 1.0), from live's whole life.
"""

from __future__ import annotations

import math
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Literal

from worker.settings import DEFAULTS, Settings
from worker.store.checkpoints import Stages
from worker.store.evidence_counts import Confusion, Counts, Evidence

__all__ = ["Action", "Mode", "Policy", "RolloutDecision", "Situation", "next_action"]

Mode = Literal["auto_live", "canary", "manual"]
Action = Literal["none", "start_canary", "promote", "rollback", "clear"]
Number = float | int | str | bool | None


@dataclass(frozen=True)
class Policy:
    """The thresholds of the automatic rollout (``PROBEGUARD_*`` settings of the same name).

    Every default is the setting's (``DEFAULTS``), so ``Policy()`` and
    ``from_settings(Settings())`` agree."""

    mode: Mode = DEFAULTS.rollout
    canary_share: float = DEFAULTS.canary_share
    promote_min_labels: int = DEFAULTS.promote_min_labels
    promote_min_labelers: int = DEFAULTS.promote_min_labelers
    promote_epsilon: float = DEFAULTS.promote_epsilon  # ε: promote when canary F1 >= live F1 - ε
    rollback_delta: float = DEFAULTS.rollback_delta  # δ: roll back when canary F1 < live F1 - δ
    rollback_min_labels: int = DEFAULTS.rollback_min_labels
    rollback_flag_rate_factor: float = DEFAULTS.rollback_flag_rate_factor  # k
    rollback_min_messages: int = DEFAULTS.rollback_min_messages
    rollback_head_min_flags: int = DEFAULTS.rollback_head_min_flags  # per head, see rule 4
    # How long a refusal waits for other scorers' loads: every scorer re-reads the stages
    # at least every stage_check_interval_s.
    refusal_grace_s: float = 2 * DEFAULTS.stage_check_interval_s

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(
            mode=settings.rollout,
            canary_share=settings.canary_share,
            promote_min_labels=settings.promote_min_labels,
            promote_min_labelers=settings.promote_min_labelers,
            promote_epsilon=settings.promote_epsilon,
            rollback_delta=settings.rollback_delta,
            rollback_min_labels=settings.rollback_min_labels,
            rollback_flag_rate_factor=settings.rollback_flag_rate_factor,
            rollback_min_messages=settings.rollback_min_messages,
            rollback_head_min_flags=settings.rollback_head_min_flags,
            refusal_grace_s=2 * settings.stage_check_interval_s,
        )


@dataclass(frozen=True)
class Situation:
    """Everything the policy looks at."""

    stages: Stages
    versions: tuple[int, ...] = ()
    rolled_back: Set[int] = frozenset()
    tried: Set[int] = frozenset()
    live: Evidence | None = None
    canary: Evidence | None = None
    now: float | None = None  # epoch seconds (None: every refusal counts as old)


@dataclass(frozen=True)
class RolloutDecision:
    action: Action
    version: int | None = None  # the version the action is about
    reason: str = ""
    numbers: dict[str, Number] = field(default_factory=dict)  # recorded in the event


def next_action(policy: Policy, situation: Situation) -> RolloutDecision:
    """What the automatic rollout does next (see the module docstring for the rules)."""
    st = situation.stages
    if st.pinned:
        return RolloutDecision("none", reason="pinned: automatic changes are frozen")
    if policy.mode == "manual":
        return RolloutDecision("none", reason="rollout mode is manual")
    if st.canary is None:
        return _next_candidate(policy, situation)
    if st.live is None:
        return RolloutDecision("none", st.canary, "a canary without a live version: waiting")
    return _judge_canary(policy, situation, st.canary)


def _next_candidate(policy: Policy, sit: Situation) -> RolloutDecision:
    if policy.mode != "canary":
        return RolloutDecision("none", reason="no canary on trial")
    live = sit.stages.live
    fresh = [
        v
        for v in sit.versions
        if v not in sit.rolled_back and v not in sit.tried and (live is None or v > live)
    ]
    if not fresh:
        return RolloutDecision("none", reason="no canary on trial and no new candidate")
    newest = max(fresh)
    numbers: dict[str, Number] = {"superseded": len(fresh) - 1}
    if live is None:
        return RolloutDecision(
            "promote", newest, "nothing is live yet: the first version goes live untried", numbers
        )
    numbers["share"] = policy.canary_share
    return RolloutDecision(
        "start_canary",
        newest,
        f"newest candidate v{newest} on trial for {policy.canary_share:.0%} of conversations",
        numbers,
    )


def _judge_canary(policy: Policy, sit: Situation, version: int) -> RolloutDecision:
    c = sit.canary or Evidence(version)
    refusal = _judge_refusals(policy, sit, c)
    if refusal is not None:
        return refusal
    numbers: dict[str, Number] = {
        "canary_messages": c.scored,
        "canary_flag_rate": _round(c.flag_rate),
        "canary_labels": c.labels.labeled,
        "canary_labelers": c.labelers,
        "canary_f1": _round(c.labels.f1),
    }
    return (
        _judge_flag_rate(policy, sit.live, c, numbers)
        or _judge_head_rates(policy, sit.live, c, numbers)
        or _judge_labels(policy, sit, c, numbers)
    )


def _judge_flag_rate(
    policy: Policy, live: Evidence | None, c: Evidence, numbers: dict[str, Number]
) -> RolloutDecision | None:
    departure = _departure(policy, live, c)
    if departure is None:
        return None
    canary_rate, live_rate, factor, live_n = departure
    numbers |= {"live_messages": live_n, "live_flag_rate": _round(live_rate)}
    numbers |= {"flag_rate_factor": _round(factor), "k": policy.rollback_flag_rate_factor}
    if factor <= policy.rollback_flag_rate_factor:
        return None
    return RolloutDecision(
        "rollback",
        c.version,
        f"flag rate {canary_rate:.3f} vs live {live_rate:.3f}: departs by a factor "
        f"{factor:.2f} > k={policy.rollback_flag_rate_factor:g} "
        f"({c.scored} vs {live_n} messages)",
        numbers,
    )


def _judge_head_rates(
    policy: Policy, live: Evidence | None, c: Evidence, numbers: dict[str, Number]
) -> RolloutDecision | None:
    """Rule 4's flag-rate part: the head whose rate departs most, rolled back above k."""
    worst: tuple[float, str, float, float, int] | None = None
    for name, head in sorted(c.heads.items()):
        departure = _departure(policy, _head(live, name), head)
        if departure is None:
            continue
        canary_rate, live_rate, factor, live_n = departure
        if max(head.scored_flags, live_rate * head.scored) < policy.rollback_head_min_flags:
            continue  # too few flags either way to tell a factor from chance
        if worst is None or factor > worst[0]:
            worst = (factor, name, canary_rate, live_rate, live_n)
    if worst is None:
        return None
    factor, name, canary_rate, live_rate, live_n = worst
    numbers |= {"worst_head": name, "head_flag_rate_factor": _round(factor)}
    if factor <= policy.rollback_flag_rate_factor:
        return None
    numbers |= {"head_flag_rate": _round(canary_rate), "head_live_flag_rate": _round(live_rate)}
    numbers["k"] = policy.rollback_flag_rate_factor
    return RolloutDecision(
        "rollback",
        c.version,
        f"head {name}: flag rate {canary_rate:.3f} vs live {live_rate:.3f}: departs by a "
        f"factor {factor:.2f} > k={policy.rollback_flag_rate_factor:g} "
        f"({c.heads[name].scored} vs {live_n} messages)",
        numbers,
    )


def _judge_labels(
    policy: Policy, sit: Situation, c: Evidence, numbers: dict[str, Number]
) -> RolloutDecision:
    """Rules 3 and 4 on labels: F1 against live's, whole and per head."""
    version, labels = c.version, c.labels.labeled
    basis = _baseline_labels(sit.live, c, policy.rollback_min_labels)
    gap, on = math.nan, ""
    if basis is not None:
        live_f1, canary_f1 = basis.f1, c.labels.f1
        gap = live_f1 - canary_f1 if labels else math.nan
        numbers |= {"live_labels": basis.labeled, "live_f1": _round(live_f1)}
        numbers["f1_gap"] = _round(gap)
        on = f"F1 {canary_f1:.3f} vs live {live_f1:.3f} on {labels} vs {basis.labeled} labels"
        if labels >= policy.rollback_min_labels and gap > policy.rollback_delta:
            numbers["delta"] = policy.rollback_delta
            why = f"{on}: worse by {gap:.3f} > δ={policy.rollback_delta:g}"
            return RolloutDecision("rollback", version, why, numbers)
    heads = _head_gaps(policy, sit.live, c)
    bad = _worst_head(heads, policy.rollback_min_labels, policy.rollback_delta)
    if bad is not None:
        numbers["delta"] = policy.rollback_delta
        why = f"worse by {bad[0]:.3f} > δ={policy.rollback_delta:g}"
        return _head_verdict("rollback", bad, why, version, numbers)
    if basis is None:
        return RolloutDecision(
            "none", version, f"collecting evidence: live has too few labels yet ({labels})", numbers
        )
    if labels < policy.promote_min_labels:
        why = f"collecting evidence: {labels}/{policy.promote_min_labels} labels"
        return RolloutDecision("none", version, why, numbers)
    numbers["epsilon"] = policy.promote_epsilon
    if gap > policy.promote_epsilon:
        return RolloutDecision(
            "clear",
            version,
            f"{on}: not within ε={policy.promote_epsilon:g} of live, not worse than "
            f"δ={policy.rollback_delta:g}; trial ends without promotion",
            numbers,
        )
    lagging = _worst_head(heads, policy.promote_min_labels, policy.promote_epsilon)
    if lagging is not None:
        why = f"not within ε={policy.promote_epsilon:g} of live; trial ends without promotion"
        return _head_verdict("clear", lagging, why, version, numbers)
    if version in sit.rolled_back:
        return RolloutDecision(
            "none",
            version,
            f"{on}: would be promoted, but v{version} was rolled back before; "
            "only an operator can promote it",
            numbers,
        )
    if c.labelers < policy.promote_min_labelers:
        numbers["min_labelers"] = policy.promote_min_labelers
        return RolloutDecision(
            "none",
            version,
            f"{on}: would be promoted, but its labels come from {c.labelers} labeler(s); "
            f"{policy.promote_min_labelers} distinct needed",
            numbers,
        )
    every = f" (and each of its {len(heads)} labeled head(s))" if heads else ""
    return RolloutDecision(
        "promote", version, f"{on}: within ε={policy.promote_epsilon:g} of live{every}", numbers
    )


# A head's F1 against live's: (live F1 - canary F1, head, canary's confusion, live's)
HeadGap = tuple[float, str, Confusion, Confusion]


def _head_gaps(policy: Policy, live: Evidence | None, c: Evidence) -> list[HeadGap]:
    """The heads both versions judge, with enough of live's labels to compare F1."""
    gaps = []
    for name, head in sorted(c.heads.items()):
        if not head.scored or not head.labels.labeled:
            continue  # the canary lacks the head (labels credit it as silent) or has no labels
        basis = _head_baseline_labels(_head(live, name), head, policy.rollback_min_labels)
        if basis is not None:
            gaps.append((basis.f1 - head.labels.f1, name, head.labels, basis))
    return gaps


def _worst_head(gaps: list[HeadGap], min_labels: int, limit: float) -> HeadGap | None:
    """The head with the widest F1 gap above ``limit`` on at least ``min_labels`` labels."""
    over = [g for g in gaps if g[2].labeled >= min_labels and g[0] > limit]
    return max(over, key=lambda g: g[0]) if over else None


def _head_verdict(
    action: Action, gap: HeadGap, why: str, version: int, numbers: dict[str, Number]
) -> RolloutDecision:
    delta, name, mine, live = gap
    numbers |= {"head": name, "head_f1": _round(mine.f1), "head_live_f1": _round(live.f1)}
    numbers |= {"head_labels": mine.labeled, "head_live_labels": live.labeled}
    numbers["head_f1_gap"] = _round(delta)
    on = f"head {name}: F1 {mine.f1:.3f} vs live {live.f1:.3f}"
    on += f" on {mine.labeled} vs {live.labeled} labels"
    return RolloutDecision(action, version, f"{on}: {why}", numbers)


def _judge_refusals(policy: Policy, sit: Situation, c: Evidence) -> RolloutDecision | None:
    """Refusals roll a canary back only when no scorer could load it. With a load
    elsewhere the version is fine (the refusing scorers' key or model differ) and its
    trial goes on: None, unless that is all there is to say."""
    if not c.errors:
        return None
    refused = f"refused by {c.errors} scorer(s)"
    if c.loads:
        if c.scored:
            return None  # served elsewhere: judge it on its numbers
        return RolloutDecision(
            "none",
            c.version,
            f"{refused} but loaded by {c.loads}: check the refusing scorers' key and model "
            f"({c.last_error})"[:1000],
            {"errors": c.errors, "loads": c.loads},
        )
    waited = math.inf if sit.now is None or c.error_since is None else sit.now - c.error_since
    if waited < policy.refusal_grace_s:
        return RolloutDecision(
            "none",
            c.version,
            f"{refused}, loaded by none yet: waiting {policy.refusal_grace_s:g}s for the "
            "other scorers",
            {"errors": c.errors},
        )
    return RolloutDecision(
        "rollback", c.version, f"{refused}: {c.last_error}"[:1000], {"errors": c.errors}
    )


def _smoothed(flags: int, n: int) -> float:
    return (flags + 1) / (n + 2)


def _baseline_rate(live: Counts | None, c: Counts, minimum: int) -> tuple[float, int] | None:
    """Live's smoothed flag rate during the trial, else over its life; None if too few."""
    if c.baseline_messages >= minimum:
        return _smoothed(c.baseline_flags, c.baseline_messages), c.baseline_messages
    if live is not None and live.messages >= minimum:
        return _smoothed(live.flags, live.messages), live.messages
    return None


def _departure(
    policy: Policy, live: Counts | None, c: Counts
) -> tuple[float, float, float, int] | None:
    """``(canary rate, live rate, factor, live's messages)`` once both have enough
    messages: smoothed flag rates and how far apart they are (a factor ≥ 1)."""
    rate = _baseline_rate(live, c, policy.rollback_min_messages)
    if rate is None or c.scored < policy.rollback_min_messages:
        return None
    live_rate, live_n = rate
    canary_rate = _smoothed(c.scored_flags, c.scored)
    return canary_rate, live_rate, max(canary_rate / live_rate, live_rate / canary_rate), live_n


def _head(live: Evidence | None, name: str) -> Counts | None:
    return live.heads.get(name) if live is not None else None


def _head_baseline_labels(live: Counts | None, c: Counts, minimum: int) -> Confusion | None:
    """As :func:`_baseline_labels`, from a side that judged the head (a label for a head a
    version does not have is credited to it as a silent head, which is no comparison)."""
    if c.baseline_messages and c.baseline_labels.labeled >= minimum:
        return c.baseline_labels
    if live is not None and live.messages and live.labels.labeled >= minimum:
        return live.labels
    return None


def _baseline_labels(live: Counts | None, c: Counts, minimum: int) -> Confusion | None:
    if c.baseline_labels.labeled >= minimum:
        return c.baseline_labels
    if live is not None and live.labels.labeled >= minimum:
        return live.labels
    return None


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)
