"""Canary rollout: the automatic policy (a pure function) and the stage changes it makes.

    candidate --(newest, none on trial)--> canary --(enough labels, F1 holds)--> live
                                              \\--(errors | flag rate | F1 worse)--> rolled back
                                              \\--(enough labels, neither)-------> cleared

:func:`decide` looks only at numbers (:class:`Situation`) and returns a
:class:`Decision`; :class:`Rollout` reads the registry and the evidence, applies
decisions as compare-and-set stage changes (an operator's concurrent change wins
and the policy looks again next time), and offers the same operations to the
operator CLI. The active updater evaluates the policy between batches, so there
is one automatic writer per probe.

The rules, in order (all thresholds are settings, see :class:`Policy`):

1. pinned, or mode ``manual``: no automatic change at all.
2. no canary on trial: in mode ``canary`` the newest published version that is newer
   than live, never tried and never rolled back becomes the canary at
   ``canary_share`` (older candidates are superseded); when nothing is live yet it
   goes live at once (there is nothing to compare it with).
3. a canary on trial (in modes ``canary`` and ``auto_live``, where an operator may
   start one) is **rolled back** when a scorer refused to load it; when its flag
   rate departs from live's by more than a factor ``k`` (both over at least
   ``rollback_min_messages`` messages; rates smoothed as ``(flags+1)/(n+2)`` so zero
   rates compare sanely); when its F1 on at least ``rollback_min_labels`` labels is
   worse than live's by more than ``δ``. It is **promoted** once it has
   ``promote_min_labels`` labels and its F1 is at least live's − ``ε``; with that many
   labels and F1 between the two, the trial ends without a verdict (**cleared**) so
   the next candidate gets its turn. A version that was rolled back is never
   promoted automatically, even if an operator trials it again.

Live's numbers for the comparison come from the same period: the live decisions
made while this canary was on trial (``bl_*`` evidence); when those are too few
(e.g. a canary share of 1.0), from live's whole life.
"""

from __future__ import annotations

import math
import time
from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from worker.store.checkpoints import Registry, RegistryError, Stages
from worker.store.evidence import Confusion, Evidence, EvidenceStore

if TYPE_CHECKING:
    from worker.settings import Settings

__all__ = ["Decision", "Mode", "Policy", "Rollout", "Situation", "decide"]

Mode = Literal["auto_live", "canary", "manual"]
Action = Literal["none", "start_canary", "promote", "rollback", "clear"]
Number = float | int | str | bool | None


@dataclass(frozen=True)
class Policy:
    """The thresholds of the automatic rollout (``PROBEGUARD_*`` settings of the same name)."""

    mode: Mode = "canary"
    canary_share: float = 0.1
    promote_min_labels: int = 200
    promote_epsilon: float = 0.02  # ε: promote when canary F1 >= live F1 - ε
    rollback_delta: float = 0.05  # δ: roll back when canary F1 < live F1 - δ
    rollback_min_labels: int = 50
    rollback_flag_rate_factor: float = 2.0  # k
    rollback_min_messages: int = 200

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(
            mode=settings.rollout_mode,
            canary_share=settings.canary_share,
            promote_min_labels=settings.promote_min_labels,
            promote_epsilon=settings.promote_epsilon,
            rollback_delta=settings.rollback_delta,
            rollback_min_labels=settings.rollback_min_labels,
            rollback_flag_rate_factor=settings.rollback_flag_rate_factor,
            rollback_min_messages=settings.rollback_min_messages,
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


@dataclass(frozen=True)
class Decision:
    action: Action
    version: int | None = None  # the version the action is about
    reason: str = ""
    numbers: dict[str, Number] = field(default_factory=dict)  # recorded in the event


def decide(policy: Policy, situation: Situation) -> Decision:
    """What the automatic rollout does next (see the module docstring for the rules)."""
    st = situation.stages
    if st.pinned:
        return Decision("none", reason="pinned: automatic changes are frozen")
    if policy.mode == "manual":
        return Decision("none", reason="rollout mode is manual")
    if st.canary is None:
        return _next_candidate(policy, situation)
    if st.live is None:
        return Decision("none", st.canary, "a canary without a live version: waiting")
    return _judge_canary(policy, situation, st.canary)


def _next_candidate(policy: Policy, sit: Situation) -> Decision:
    if policy.mode != "canary":
        return Decision("none", reason="no canary on trial")
    live = sit.stages.live
    fresh = [
        v
        for v in sit.versions
        if v not in sit.rolled_back and v not in sit.tried and (live is None or v > live)
    ]
    if not fresh:
        return Decision("none", reason="no canary on trial and no new candidate")
    newest = max(fresh)
    numbers: dict[str, Number] = {"superseded": len(fresh) - 1}
    if live is None:
        return Decision(
            "promote", newest, "nothing is live yet: the first version goes live untried", numbers
        )
    numbers["share"] = policy.canary_share
    return Decision(
        "start_canary",
        newest,
        f"newest candidate v{newest} on trial for {policy.canary_share:.0%} of conversations",
        numbers,
    )


def _judge_canary(policy: Policy, sit: Situation, version: int) -> Decision:
    c = sit.canary or Evidence(version)
    live = sit.live
    if c.errors:
        return Decision(
            "rollback",
            version,
            f"refused by {c.errors} scorer(s): {c.last_error}"[:1000],
            {"errors": c.errors},
        )
    numbers: dict[str, Number] = {
        "canary_messages": c.scored,
        "canary_flag_rate": _round(c.flag_rate),
        "canary_labels": c.labels.labeled,
        "canary_f1": _round(c.labels.f1),
    }
    rate = _baseline_rate(live, c, policy.rollback_min_messages)
    if rate is not None and c.scored >= policy.rollback_min_messages:
        live_rate, live_n = rate
        canary_rate = _smoothed(c.scored_flags, c.scored)
        factor = max(canary_rate / live_rate, live_rate / canary_rate)
        numbers |= {"live_messages": live_n, "live_flag_rate": _round(live_rate)}
        numbers |= {"flag_rate_factor": _round(factor), "k": policy.rollback_flag_rate_factor}
        if factor > policy.rollback_flag_rate_factor:
            return Decision(
                "rollback",
                version,
                f"flag rate {canary_rate:.3f} vs live {live_rate:.3f}: departs by a factor "
                f"{factor:.2f} > k={policy.rollback_flag_rate_factor:g} "
                f"({c.scored} vs {live_n} messages)",
                numbers,
            )
    basis = _baseline_labels(live, c, policy.rollback_min_labels)
    labels = c.labels.labeled
    if basis is None:
        return Decision(
            "none", version, f"collecting evidence: live has too few labels yet ({labels})", numbers
        )
    live_f1, canary_f1 = basis.f1, c.labels.f1
    gap = live_f1 - canary_f1 if labels else math.nan
    numbers |= {"live_labels": basis.labeled, "live_f1": _round(live_f1), "f1_gap": _round(gap)}
    on = f"F1 {canary_f1:.3f} vs live {live_f1:.3f} on {labels} vs {basis.labeled} labels"
    if labels >= policy.rollback_min_labels and gap > policy.rollback_delta:
        numbers["delta"] = policy.rollback_delta
        return Decision(
            "rollback",
            version,
            f"{on}: worse by {gap:.3f} > δ={policy.rollback_delta:g}",
            numbers,
        )
    if labels < policy.promote_min_labels:
        return Decision(
            "none", version, f"collecting evidence: {labels}/{policy.promote_min_labels} labels"
        )
    numbers["epsilon"] = policy.promote_epsilon
    if gap > policy.promote_epsilon:
        return Decision(
            "clear",
            version,
            f"{on}: not within ε={policy.promote_epsilon:g} of live, not worse than "
            f"δ={policy.rollback_delta:g}; trial ends without promotion",
            numbers,
        )
    if version in sit.rolled_back:
        return Decision(
            "none",
            version,
            f"{on}: would be promoted, but v{version} was rolled back before; "
            "only an operator can promote it",
            numbers,
        )
    return Decision(
        "promote", version, f"{on}: within ε={policy.promote_epsilon:g} of live", numbers
    )


def _smoothed(flags: int, n: int) -> float:
    return (flags + 1) / (n + 2)


def _baseline_rate(live: Evidence | None, c: Evidence, minimum: int) -> tuple[float, int] | None:
    """Live's smoothed flag rate during the trial, else over its life; None if too few."""
    if c.baseline_messages >= minimum:
        return _smoothed(c.baseline_flags, c.baseline_messages), c.baseline_messages
    if live is not None and live.messages >= minimum:
        return _smoothed(live.flags, live.messages), live.messages
    return None


def _baseline_labels(live: Evidence | None, c: Evidence, minimum: int) -> Confusion | None:
    if c.baseline_labels.labeled >= minimum:
        return c.baseline_labels
    if live is not None and live.labels.labeled >= minimum:
        return live.labels
    return None


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


# --- applying decisions, and the operator's stage changes ---------------------------


class Rollout:
    """Stage changes of one probe, each an event with its reason and numbers.

    Every change is a compare-and-set against the stages read before deciding
    (``expect``); :class:`~worker.store.checkpoints.StagesChanged` means someone else changed
    them first.
    """

    def __init__(self, registry: Registry, evidence: EvidenceStore, *, actor: str) -> None:
        self.registry = registry
        self.evidence = evidence
        self.actor = actor

    @property
    def probe(self) -> str:
        return self.registry.probe

    # --- the policy ----------------------------------------------------------

    def situation(self) -> Situation:
        st = self.registry.stages()
        wanted = [v for v in (st.live, st.canary) if v is not None]
        ev = self.evidence.read_many(self.probe, wanted)
        return Situation(
            stages=st,
            versions=tuple(self.registry.versions()),
            rolled_back=frozenset(self.registry.rolled_back()),
            tried=frozenset(self.registry.tried()),
            live=ev.get(st.live) if st.live is not None else None,
            canary=ev.get(st.canary) if st.canary is not None else None,
        )

    def evaluate(self, policy: Policy) -> Decision:
        """Decide and apply; records the outcome for ``probeguard probe status``."""
        sit = self.situation()
        decision = decide(policy, sit)
        self.apply(decision, sit.stages, share=policy.canary_share)
        self.registry.client.hset(
            self.registry.keys.policy(self.registry.probe),
            mapping={
                "mode": policy.mode,
                "holder": self.actor,
                "at": f"{time.time():.3f}",
                "note": decision.reason[:500],
            },
        )
        return decision

    def apply(self, decision: Decision, expect: Stages, *, share: float) -> None:
        v, why, numbers = decision.version, decision.reason, decision.numbers
        if decision.action == "none" or v is None:
            return
        if decision.action == "promote":
            self.promote(v, reason=why, details=numbers, expect=expect)
        elif decision.action == "start_canary":
            self.start_canary(v, share, reason=why, details=numbers, expect=expect)
        elif decision.action == "rollback":
            self.rollback_canary(reason=why, details=numbers, expect=expect)
        elif decision.action == "clear":
            self.clear_canary(reason=why, details=numbers, expect=expect)

    # --- operations ------------------------------------------------------------

    def promote(
        self,
        version: int,
        *,
        reason: str,
        details: dict[str, Number] | None = None,
        expect: Stages | None = None,
    ) -> None:
        self.registry.promote(
            version,
            reason=reason,
            actor=self.actor,
            details=details,
            expect=expect or self.registry.stages(),
        )

    def start_canary(
        self,
        version: int,
        share: float,
        *,
        reason: str,
        details: dict[str, Number] | None = None,
        expect: Stages | None = None,
    ) -> None:
        """Put ``version`` on trial for ``share`` of conversations, with fresh evidence."""
        st = expect or self.registry.stages()
        if not 0.0 < share <= 1.0:
            raise RegistryError(f"canary share must be in (0, 1], got {share}")
        if version == st.live:
            raise RegistryError(f"{self.probe} v{version} is already live")
        self.registry.set_stages(
            "canary",
            set_fields={"canary": version, "canary_share": share},
            version=version,
            previous=st.canary,
            reason=reason,
            actor=self.actor,
            details={"share": share, **(details or {})},
            expect=_pointers(st),
            mark_tried=[version],
            reset=[
                self.registry.keys.evidence(self.probe, version),
                self.registry.keys.pairs(self.probe, version),
            ],
        )

    def rollback_canary(
        self,
        *,
        reason: str,
        details: dict[str, Number] | None = None,
        expect: Stages | None = None,
    ) -> int:
        """End the canary's trial and mark it rolled back; returns its version."""
        st = expect or self.registry.stages()
        if st.canary is None:
            raise RegistryError(f"{self.probe} has no canary to roll back")
        self.registry.set_stages(
            "rolled_back",
            delete=["canary", "canary_share"],
            version=st.canary,
            reason=reason,
            actor=self.actor,
            details={"stage": "canary", **(details or {})},
            expect=_pointers(st),
            mark_rolled_back={st.canary: reason[:500] or "rolled back"},
        )
        return st.canary

    def clear_canary(
        self,
        *,
        reason: str,
        details: dict[str, Number] | None = None,
        expect: Stages | None = None,
    ) -> int:
        """End the canary's trial without a verdict (it is not marked bad)."""
        st = expect or self.registry.stages()
        if st.canary is None:
            raise RegistryError(f"{self.probe} has no canary")
        self.registry.set_stages(
            "canary_cleared",
            delete=["canary", "canary_share"],
            version=st.canary,
            reason=reason,
            actor=self.actor,
            details=details,
            expect=_pointers(st),
        )
        return st.canary

    def rollback_target(self, st: Stages | None = None) -> int | None:
        """The live version a rollback restores: the latest earlier live that is still
        published and was never rolled back."""
        st = st or self.registry.stages()
        bad = self.registry.rolled_back()
        published = set(self.registry.versions())
        for v in reversed(self.registry.lineage()):
            if v != st.live and v not in bad and v in published:
                return v
        return None

    def rollback_live(self, *, reason: str, pin: bool = True, expect: Stages | None = None) -> int:
        """Restore the previous live version, mark the current one rolled back; returns
        the restored version. ``pin`` also freezes automatic changes (so e.g. an
        ``auto_live`` updater does not immediately replace the restored version)."""
        st = expect or self.registry.stages()
        if st.live is None:
            raise RegistryError(f"{self.probe} has no live version to roll back")
        target = self.rollback_target(st)
        if target is None:
            raise RegistryError(
                f"{self.probe}: no earlier live version to roll back to from v{st.live} "
                "(see `probeguard probe history`; `probeguard probe promote VERSION` "
                "makes any version live)"
            )
        sets: dict[str, int | float | bool] = {"live": target}
        if pin:
            sets["pinned"] = True
        self.registry.set_stages(
            "rolled_back",
            set_fields=sets,
            delete=["canary", "canary_share"] if st.canary == target else [],
            version=st.live,
            previous=st.live,
            reason=reason,
            actor=self.actor,
            details={"stage": "live", "restored": target, "pinned": pin},
            expect=_pointers(st),
            mark_rolled_back={st.live: reason[:500] or "rolled back"},
        )
        return target

    def pin(self, *, reason: str) -> None:
        self.registry.set_stages(
            "pinned", set_fields={"pinned": True}, reason=reason, actor=self.actor
        )

    def unpin(self, *, reason: str) -> None:
        self.registry.set_stages("unpinned", delete=["pinned"], reason=reason, actor=self.actor)


def _pointers(st: Stages) -> dict[str, int | str | None]:
    return {"live": st.live, "canary": st.canary}
