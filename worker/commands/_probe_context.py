"""What every ``probeguard probe`` action works on: settings, the probe's registry, its
evidence and an operator (shared by ``probe`` and ``probe_heads``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["ProbeContext", "note_policy", "probe_context"]


@dataclass
class ProbeContext:
    settings: Any
    registry: Any
    evidence: Any
    operator: Any


def probe_context(args: argparse.Namespace) -> ProbeContext:
    from worker.commands._common import registry_redis
    from worker.rollout.operator import Operator
    from worker.settings import load_settings
    from worker.store.checkpoints import CheckpointRegistry
    from worker.store.evidence import EvidenceStore
    from worker.store.redis import keys_for

    settings = load_settings()
    client = registry_redis(settings, probe_given=bool(args.probe))
    keys = keys_for(settings)
    registry = CheckpointRegistry(
        client, keys, args.probe or settings.probe_to_train, signing_key=settings.signing_key
    )
    evidence = EvidenceStore.from_settings(client, settings)
    actor = getattr(args, "actor", "probeguard-cli")
    return ProbeContext(settings, registry, evidence, Operator(registry, evidence, actor=actor))


def note_policy(ctx: ProbeContext) -> None:
    """Warn (stderr) when an updater's automatic rollout may change stages again."""
    note = ctx.operator.policy_note()
    if note:
        print(f"note: {note}", file=sys.stderr)
