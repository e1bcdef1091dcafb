"""An operator's stage changes, with the refusals every front end shares.

``probeguard probe`` (the CLI) and ``probeguard console`` (the web page) both call
:class:`Operator`, so a version that one refuses the other refuses too, for the same
reason, in the same words::

    op = Operator(registry, evidence, actor="alice@console")
    print(op.promote(7, reason="hotfix"))        # "toxicity: v7 is live (was v6)"
    print(op.rollback(reason="F1 dropped"))      # previous live back, current marked bad
    note = op.policy_note()                      # an updater may change stages again

The refusals (:class:`~worker.errors.RolloutError`, or a registry error such as an
unknown version): a version trained on another LLM than the live one (or than the
``fingerprint`` given, e.g. the configured model's); a version that was rolled back or
that scorers refused (``force`` overrides); a canary already on trial (``force``
replaces it); stages changed by someone else since they were read (every change is a
compare-and-set, and the message names the updater that may have acted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.errors import RolloutError, StagesChanged
from worker.rollout.changes import Rollout
from worker.store.checkpoints import CheckpointRegistry, Stages
from worker.store.evidence import EvidenceStore
from worker.store.lease import Lease

if TYPE_CHECKING:
    from schemas import LLMFingerprint

__all__ = ["Operator"]


class Operator:
    """One probe's manual stage changes by ``actor`` (recorded in every event)."""

    def __init__(
        self, registry: CheckpointRegistry, evidence: EvidenceStore, *, actor: str
    ) -> None:
        self.registry = registry
        self.evidence = evidence
        self.actor = actor
        self.rollout = Rollout(registry, evidence, actor=actor)

    @property
    def probe(self) -> str:
        return self.registry.probe

    # --- what the front ends show beside a change --------------------------------

    def holder(self) -> str | None:
        """The updater holding this probe's lease (it runs the automatic policy)."""
        current = Lease(self.registry.client, self.registry.lease_key, "operator").current()
        return current[1] if current else None

    def policy_note(self) -> str | None:
        """A warning when an updater's automatic rollout may change stages again."""
        holder = self.holder()
        raw = self.registry.client.hgetall(self.registry.keys.policy(self.probe))
        mode = raw.get(b"mode", b"").decode()
        if holder and mode in ("canary", "auto_live") and not self.registry.stages().pinned:
            return (
                f"updater {holder} holds the {self.probe} lease and runs the {mode!r} rollout "
                "policy; it may change stages after this (`probeguard probe pin` freezes it)"
            )
        return None

    # --- checks ---------------------------------------------------------------

    def check(
        self,
        version: int,
        *,
        force: bool = False,
        fingerprint: LLMFingerprint | None = None,
        hint: str = "",
    ) -> None:
        """Refuse versions that do not exist, do not fit the model, or are known bad
        (:meth:`Rollout.check_usable`). ``fingerprint``: the model to check against
        (default: the live version's); ``hint`` ends an incompatibility message."""
        self.rollout.check_usable(version, model=fingerprint, force=force, hint=hint)

    def _changed(self, exc: Exception) -> RolloutError:
        holder = self.holder()
        who = f"updater {holder} holds the lease and may have acted" if holder else "someone else"
        return RolloutError(
            f"{self.probe}: the stages changed while this command ran ({who}): {exc}; "
            "check `probeguard probe status` and retry"
        )

    # --- changes (each returns what happened, in one line) --------------------------

    def promote(
        self,
        version: int,
        *,
        reason: str = "",
        force: bool = False,
        fingerprint: LLMFingerprint | None = None,
        hint: str = "",
        expect: Stages | None = None,
    ) -> str:
        """Make ``version`` live now. ``expect``: the stages the operator saw (else now)."""
        self.check(version, force=force, fingerprint=fingerprint, hint=hint)
        st = self._expect(expect)
        if st.live == version:
            return f"{self.probe}: v{version} is already live"
        try:
            self.rollout.promote(
                version,
                reason=reason or "operator promote",
                expect=st,
                resign=force,  # re-signs stage pointers that do not verify (drops any canary)
            )
        except StagesChanged as exc:
            raise self._changed(exc) from None
        was = f" (was v{st.live})" if st.live is not None else ""
        return f"{self.probe}: v{version} is live{was}"

    def canary(
        self,
        version: int,
        share: float,
        *,
        reason: str = "",
        force: bool = False,
        fingerprint: LLMFingerprint | None = None,
        hint: str = "",
        expect: Stages | None = None,
    ) -> str:
        """Trial ``version`` on ``share`` of conversations."""
        if not 0.0 < share <= 1.0:
            raise RolloutError(f"--share must be in (0, 1], got {share}")
        self.check(version, force=force, fingerprint=fingerprint, hint=hint)
        st = self._expect(expect)
        if st.live == version:
            raise RolloutError(f"{self.probe} v{version} is live already; nothing to trial")
        if st.canary is not None and st.canary != version and not force:
            holder = self.holder()
            by = f"; updater {holder} holds the lease and runs the rollout policy" if holder else ""
            raise RolloutError(
                f"{self.probe} already has canary v{st.canary} on trial{by}. End it first "
                "(`probeguard probe rollback --canary`) or pass --force to replace it"
            )
        try:
            self.rollout.start_canary(version, share, reason=reason or "operator canary", expect=st)
        except StagesChanged as exc:
            raise self._changed(exc) from None
        return f"{self.probe}: v{version} is the canary for {share:.0%} of conversations"

    def rollback(
        self,
        *,
        canary: bool = False,
        pin: bool = True,
        reason: str = "",
        expect: Stages | None = None,
    ) -> str:
        """Live: restore the previous live version, mark the current one bad, pin (unless
        ``pin=False``). ``canary``: end the canary's trial and mark it bad."""
        st = self._expect(expect)
        try:
            if canary:
                v = self.rollout.rollback_canary(
                    reason=reason or "operator rollback of the canary", expect=st
                )
                return f"{self.probe}: canary v{v} rolled back; live stays v{st.live}"
            restored = self.rollout.rollback_live(
                reason=reason or "operator rollback", pin=pin, expect=st
            )
        except StagesChanged as exc:
            raise self._changed(exc) from None
        said = f"{self.probe}: v{restored} is live again; v{st.live} rolled back"
        if pin:
            said += f"\n{self.probe} is pinned: `probeguard probe unpin` resumes automatic rollout"
        return said

    def pin(self, *, reason: str = "") -> str:
        self.rollout.pin(reason=reason or "operator pin")
        return f"{self.probe}: pinned; no automatic stage changes until `unpin`"

    def unpin(self, *, reason: str = "") -> str:
        self.rollout.unpin(reason=reason or "operator unpin")
        return f"{self.probe}: unpinned; automatic rollout resumes"

    def _expect(self, expect: Stages | None) -> Stages:
        """The stages the change is conditional on. Given by a page that showed them, a
        change the operator never saw (e.g. the updater's) refuses the click instead of
        being silently overridden."""
        return expect if expect is not None else self.registry.stages()
