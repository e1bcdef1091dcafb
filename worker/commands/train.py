"""``probeguard train``: the updater (online learning from human labels)."""

from __future__ import annotations

import argparse
import logging

from worker.commands._common import serve, settings_with

__all__ = ["register"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "train",
        help="learn from human labels and publish probe versions (the updater)",
        description=(
            "Hold the probe's updater lease in Redis (or wait as a hot standby), consume "
            "PROBEGUARD_TOPIC_LABELS, score each label before learning from it (prequential "
            "metrics), take Lion steps with a class-balanced replay buffer, and publish a new "
            "version every PROBEGUARD_PUBLISH_EVERY_LABELS labels or PROBEGUARD_PUBLISH_EVERY_S "
            "seconds. Label offsets are committed only once a published version reflects them. "
            "Cold start: the newest published version, else PROBEGUARD_SEED_CHECKPOINT, else "
            "a fresh probe (PROBEGUARD_SEED_SPEC or a default binary toxicity probe). "
            "SIGTERM/Ctrl-C: publish what was learned, commit, release the lease, exit 0."
        ),
    )
    p.add_argument("--probe", help="probe to train (PROBEGUARD_TRAIN_PROBE)")
    p.add_argument("--seed-checkpoint", help="checkpoint dir to start from if none is published")
    p.add_argument("--seed-spec", help="ProbeSpec JSON file to start from zero with")
    p.add_argument("--metrics-port", type=int, help="/metrics, /healthz, /readyz port; 0 = off")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from worker.commands._common import registry_redis
    from worker.learning.updater import Updater
    from worker.llm.extract import HiddenStateExtractor

    settings = settings_with(
        train_probe=args.probe,
        seed_checkpoint=args.seed_checkpoint,
        seed_spec=args.seed_spec,
        metrics_port=args.metrics_port,
    )
    client = registry_redis(settings)  # a missing Redis is said before the LLM loads
    updater = Updater(settings, HiddenStateExtractor.from_settings(settings), client)
    return serve(updater, "publishing what was learned, then leaving")
