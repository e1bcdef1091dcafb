"""``probeguard score``: the scoring worker."""

from __future__ import annotations

import argparse
import logging

from worker.commands._common import serve, settings_with

__all__ = ["register"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "score",
        help="consume chat messages, publish verdicts (the scoring worker)",
        description=(
            "Join the scorer consumer group on PROBEGUARD_TOPIC_CHAT, score every message "
            "with the live probe(s) from the Redis registry (PROBEGUARD_PROBES) on the frozen "
            "LLM, and produce verdicts, review requests and dead letters. Offsets are "
            "committed only after the broker acknowledged the outputs. SIGTERM/Ctrl-C: "
            "finish the batch, commit, leave the group, exit 0. All settings are "
            "PROBEGUARD_* environment variables; the options below override them."
        ),
    )
    p.add_argument("--probes", help="comma-separated probe names (PROBEGUARD_PROBES)")
    p.add_argument("--batch-size", type=int, help="messages per batch (PROBEGUARD_BATCH_SIZE)")
    p.add_argument("--metrics-port", type=int, help="/metrics, /healthz, /readyz port; 0 = off")
    p.add_argument("--bootstrap-checkpoint", help="checkpoint dir to serve until one is live")
    p.add_argument(
        "--shadow",
        action="store_true",
        default=None,
        help="score with live and canary, act on live",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from worker.commands._common import registry_redis
    from worker.kafka.early_join import EarlyJoin

    settings = settings_with(
        probes=args.probes,
        batch_size=args.batch_size,
        metrics_port=args.metrics_port,
        bootstrap_checkpoint=args.bootstrap_checkpoint,
        shadow=args.shadow,
    )
    client = registry_redis(settings)  # a missing Redis is said before the LLM loads
    # The consumer group forms (~3 s) while torch imports and the LLM loads (~5 s), not
    # after them: started before anything imports torch.
    early = EarlyJoin.start(settings, settings.group_scorer, settings.topic_chat)
    try:
        from worker.llm.extract import HiddenStateExtractor
        from worker.scoring.scorer import Scorer

        extractor = HiddenStateExtractor.from_settings(settings)
    except BaseException:
        early.release()
        raise
    scorer = Scorer(settings, extractor, client, early=early)
    return serve(scorer, "finishing the batch in hand, then leaving")
