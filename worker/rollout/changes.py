"""Stage changes of a probe: the rollout policy applied, and the operator's own.

Every change is a compare-and-set on the stage pointers with an event carrying its
reason and numbers (see :mod:`worker.rollout.policy` for the rules).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from schemas import LLMFingerprint
from worker.errors import RegistryError, RolloutError, StagesChanged
from worker.rollout.policy import (
    Number,
    Policy,
    RolloutDecision,
    Situation,
    next_action,
)
from worker.store.checkpoints import CheckpointRegistry, Stages
from worker.store.evidence import EvidenceStore

if TYPE_CHECKING:
    pass

__all__ = ["Rollout"]
# --- applying decisions, and the operator's stage changes ---------------------------

log = logging.getLogger(__name__)


class Rollout:
    """Stage changes of one probe, each an event with its reason and numbers.

    Every change is a compare-and-set against the stages read before deciding
    (``expect``); :class:`~worker.store.checkpoints.StagesChanged` means someone else changed
    them first.
    """

    def __init__(
        self, registry: CheckpointRegistry, evidence: EvidenceStore, *, actor: str
    ) -> None:
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
            now=time.time(),
        )

    def tick(self, policy: Policy) -> RolloutDecision | None:
        """:meth:`evaluate`, for a role's periodic check: a concurrent stage change or a
        Redis failure is logged and skipped (the next tick decides again); None then."""
        try:
            decision = self.evaluate(policy)
        except StagesChanged as exc:
            log.info("rollout: %s; deciding again next time", exc)
            return None
        except (RegistryError, redis.RedisError, OSError) as exc:
            log.warning("rollout policy could not run (%s)", exc)
            return None
        if decision.action != "none":
            probe = self.registry.probe
            log.info("rollout: %s %s v%s: %s", decision.action, probe, decision.version,
                     decision.reason)  # fmt: skip
        return decision

    def evaluate(self, policy: Policy) -> RolloutDecision:
        """Decide and apply; records the outcome for ``probeguard probe status``."""
        sit = self.situation()
        decision = next_action(policy, sit)
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

    def apply(self, decision: RolloutDecision, expect: Stages, *, share: float) -> None:
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
        resign: bool = False,
    ) -> None:
        self.registry.promote(
            version,
            reason=reason,
            actor=self.actor,
            details=details,
            expect=expect or self.registry.stages(),
            resign=resign,
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

    def check_usable(
        self,
        version: int,
        *,
        model: LLMFingerprint | None = None,
        force: bool = False,
        hint: str = "",
    ) -> None:
        """Refuse (:class:`RolloutError`) a version an operator should not put on a stage:
        one that does not exist or fails integrity (:class:`UnknownVersion`, …), one trained
        on another LLM than ``model`` (default: live's LLM), and unless ``force`` one that
        was rolled back or that a scorer refused to load. ``hint`` ends the
        incompatibility message (what the caller can do instead)."""
        reg = self.registry
        llm = reg.get(version).manifest.llm
        want: LLMFingerprint | None
        if model is not None:
            want, against = model, f"the configured model {model.model_id}"
        else:
            live = reg.stages().live
            want = None if live is None or live == version else reg.manifest(live).llm
            against = f"live v{live}"
        if want is not None and llm != want:
            raise RolloutError(
                f"{reg.probe} v{version} is incompatible with {against}: it was trained on "
                f"another LLM ({llm.diff(want, mine='v' + str(version), theirs=against)}); "
                f"scorers would refuse it{hint}"
            )
        if force:
            return
        bad = reg.rolled_back()
        if version in bad:
            raise RolloutError(
                f"{reg.probe} v{version} was rolled back ({bad[version]}); --force to use it anyway"
            )
        ev = self.evidence.read(reg.probe, version)
        if ev.errors:
            raise RolloutError(
                f"{reg.probe} v{version} was refused by {ev.errors} scorer(s) ({ev.last_error}); "
                "--force to use it anyway"
            )

    def pin(self, *, reason: str) -> None:
        self.registry.set_stages(
            "pinned", set_fields={"pinned": True}, reason=reason, actor=self.actor
        )

    def unpin(self, *, reason: str) -> None:
        self.registry.set_stages("unpinned", delete=["pinned"], reason=reason, actor=self.actor)


def _pointers(st: Stages) -> dict[str, int | str | None]:
    return st.expected()
