"""``probeguard cache build|info``: hidden-state caches for offline training."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from worker.commands._common import layer_list, offline_errors, print_json

if TYPE_CHECKING:
    from schemas import CacheManifest

__all__ = ["register"]

SUMMARY_KINDS = ("mean", "max", "first", "last")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "cache",
        help="build or inspect a hidden-state cache for offline training",
        description="Run the frozen LLM once over a labeled JSONL file and store what probes need.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build",
        help="extract a labeled JSONL file into a cache directory (resumes a partial one)",
        description=(
            "Per-layer summaries (mean/max/first/last) serve the mean/max/first/last probes with "
            "any layer mix; token-level states serve the gate and MHA probes, which weigh tokens "
            "by learned scores. The LLM comes from PROBEGUARD_MODEL (see settings). With "
            "PROBEGUARD_CACHE_KEY set, every shard is encrypted (AES-256-GCM)."
        ),
    )
    build.add_argument("--data", type=Path, required=True, help="labeled JSONL file")
    build.add_argument("--out", type=Path, required=True, help="cache directory")
    build.add_argument(
        "--token-layers",
        type=layer_list,
        default=None,
        help="layers stored token by token: 'auto' (8 evenly spaced up to the last), 'none', "
        "or a list like 4,8,12 (default: auto)",
    )
    build.add_argument(
        "--summary-layers",
        type=layer_list,
        default=None,
        help="layers stored as per-row summaries: 'auto' (every layer, 0 = embeddings), "
        "'none', or a list (default: auto)",
    )
    build.add_argument(
        "--summaries",
        default=",".join(SUMMARY_KINDS),
        help="summary kinds, comma-separated from mean,max,first,last (default: all)",
    )
    build.add_argument("--shard-rows", type=int, default=256, help="rows per shard (default 256)")
    build.add_argument("--batch-size", type=int, default=None, help="texts per extractor call")
    build.add_argument(
        "--max-tokens", type=int, default=None, help="override PROBEGUARD_MAX_TOKENS"
    )
    build.add_argument(
        "--dtype",
        choices=["auto", "float16", "bfloat16", "float32"],
        default=None,
        help="how hidden states are stored (default: PROBEGUARD_STATE_DTYPE, auto: bfloat16 "
        "for Gemma 3, whose activations exceed fp16's 65504, float16 for other LLMs)",
    )
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    build.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    build.set_defaults(func=_build)
    info = actions.add_parser(
        "info",
        help="print a cache's manifest, completeness and size (an encrypted cache needs "
        "PROBEGUARD_CACHE_KEY)",
    )
    info.add_argument("cache", type=Path)
    info.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    info.set_defaults(func=_info)


@offline_errors
def _build(args: argparse.Namespace) -> int:
    from worker.errors import OfflineError
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.precision import resolve_state_dtype
    from worker.offline.build_cache import build_cache
    from worker.settings import load_settings

    kinds: list = [k.strip() for k in args.summaries.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(SUMMARY_KINDS))
    if unknown:
        raise OfflineError(f"unknown summary kinds {unknown}; choose from {list(SUMMARY_KINDS)}")
    overrides = {
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "state_dtype": args.dtype,
    }
    settings = load_settings(**{k: v for k, v in overrides.items() if v is not None})
    extractor = HiddenStateExtractor.from_settings(settings)
    manifest = build_cache(
        args.data,
        args.out,
        extractor,
        token_layers=args.token_layers,
        summary_layers=args.summary_layers,
        summaries=kinds,
        shard_rows=args.shard_rows,
        batch_size=settings.batch_size,
        progress=not args.no_progress,
        dtype=resolve_state_dtype(settings.state_dtype, extractor.model_type),
        key=settings.cache_key_bytes,
    )
    return _report(args.out, manifest, settings.cache_key_bytes, as_json=args.json)


@offline_errors
def _info(args: argparse.Namespace) -> int:
    from probes.offline.cache import HiddenStateCache
    from worker.settings import load_settings

    key = load_settings().cache_key_bytes
    cache = HiddenStateCache(args.cache, key=key)
    return _report(
        args.cache, cache.manifest, key, as_json=args.json, missing=cache.missing_shards()
    )


def _report(
    out: Path,
    manifest: CacheManifest,
    key: bytes | None,
    *,
    as_json: bool,
    missing: list[int] | None = None,
) -> int:
    from probes.offline.cache import HiddenStateCache
    from worker.offline.fit_eval import dir_size

    cache = HiddenStateCache(out, key=key)
    missing = cache.missing_shards() if missing is None else missing
    errors = cache.errors() if not missing else {}
    size = dir_size(out)
    rows = manifest.source.rows - len(errors)
    summary = {
        "cache": str(out),
        "rows": rows,
        "skipped": len(errors),
        "shards": manifest.num_shards,
        "missing_shards": missing,
        "bytes": size,
        "mb_per_1000_messages": round(size / max(rows, 1) * 1000 / 1e6, 2),
        "token_layers": manifest.token_layers,
        "summary_layers": manifest.summary_layers,
        "summaries": manifest.summaries,
        "llm": manifest.llm.model_id,
        "llm_digest": manifest.llm.digest,
        "encryption": None if manifest.encryption is None else manifest.encryption.model_dump(),
    }
    if as_json:
        print_json(summary)
    else:
        print(
            f"{out}: {rows} rows ({len(errors)} skipped), {size / 1e6:.1f} MB "
            f"({summary['mb_per_1000_messages']} MB per 1,000 messages); token layers "
            f"{manifest.token_layers}, summaries {manifest.summaries} of "
            f"{len(manifest.summary_layers)} layers"
            + ("" if manifest.encryption is None else f"; {_sealed(manifest)}")
        )
    return 0


def _sealed(manifest: CacheManifest) -> str:
    sealed = manifest.encryption
    assert sealed is not None
    return f"encrypted ({sealed.algorithm}, key fingerprint {sealed.key_fingerprint})"
