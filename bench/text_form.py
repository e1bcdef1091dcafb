"""What does the text form cost in held-out quality?

An inline guard scores the serving chat model's own hidden states of the templated prompt
(``PROBEGUARD_TEXT_FORM=chat``: the system prompt and user header run but are not pooled;
the text and the end of turn / assistant header are). Is a probe trained on that form as
good as one trained on the bare text, and what does a raw-trained probe give if the guard
simply scores the text's own tokens inside the template?

Data: the rows of ``--data`` whose id hashes into ``--holdout-share`` (default 0.3,
``probes.offline.select.held_out``, as ``bench/quality.py``) are held out, the rest train
(``--limit N``: only the file's first N rows, for a smoke run). Hidden states come from
caches under ``--cache-root`` built with the configured LLM (``PROBEGUARD_MODEL``) when
missing and reused after: the file in the raw form (the cache ``bench/quality.py`` uses)
and in the chat form, and the held-out rows in the chat form with the suffix positions
masked out (the text's own tokens inside the template). The same probe kind (``--kind``,
default ``mha``; ``mean`` is quick) is chosen by ``--folds``-fold CV on the training rows
(epochs and thresholds out of fold) on each form, then scored on the held-out rows:

- ``raw``: the raw-trained probe on raw states;
- ``chat``: the chat-trained probe on chat states;
- ``raw_in_chat``: the raw-trained probe (its own thresholds) on the text's tokens of the
  chat-form states.

Each with F1 at the CV threshold, AUPRC and recall at 1 % false positives. Example
(ToxicChat; the chat cache is one more LLM pass over the file, the held-out content cache
a third of one)::

    python bench/text_form.py --data ../shared/data/toxicchat/train.jsonl \\
        --cache-root runs/cache --kind mha --folds 2

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from probes.metrics import evaluate
from probes.offline.cache import HiddenStateCache
from probes.offline.fit import FitConfig, predict_dataset
from probes.offline.select import fit_cv, held_out
from schemas import LLMFingerprint, ProbeSpec
from worker.llm.extract import Extraction, HiddenStateExtractor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # bench/quality.py: caches, data loading, splits, specs

from _shared import log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="labeled JSONL (id, text, label)")
    p.add_argument("--holdout-share", type=float, default=0.3, help="held out by id hash (0.3)")
    p.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")
    p.add_argument("--cache-root", type=Path, default=Path("runs/cache"))
    p.add_argument("--kind", choices=quality.KINDS, default="mha", help="probe kind (mha)")
    p.add_argument("--folds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=FitConfig.max_epochs)
    p.add_argument("--patience", type=int, default=FitConfig.patience)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- data --------------------------------------------------------------------------------


def part_file(rows: list[str], source: Path, root: Path, name: str) -> Path:
    """``rows`` (JSONL lines of ``source``) as ``{root}/text_form/{folder}/{stem}-{name}.jsonl``,
    rewritten only when they changed (a cache records its source's hash)."""
    out = root / "text_form" / source.parent.name / f"{source.stem}-{name}.jsonl"
    text = "".join(line + "\n" for line in rows)
    if not out.exists() or out.read_text() != text:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return out


def lines(path: Path, limit: int) -> list[str]:
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


class ContentOnly:
    """A chat-form extractor whose rows leave out the suffix: each row's last
    ``suffix`` tokens are masked (and zeroed), so its states are the text's own tokens
    inside the template, what a guard scoring the text's span pools."""

    def __init__(self, chat: HiddenStateExtractor, suffix: int) -> None:
        if chat.max_chunks != 1:
            raise SystemExit("the content-only states need PROBEGUARD_MAX_CHUNKS=1")
        self.chat, self.suffix = chat, suffix
        self.max_tokens = chat.max_tokens

    @property
    def truncation(self) -> str:
        return self.chat.truncation

    @property
    def num_layers(self) -> int:
        return self.chat.num_layers

    @property
    def fingerprint(self) -> LLMFingerprint:
        return self.chat.fingerprint

    @property
    def autocast(self) -> str | None:
        return self.chat.autocast

    def extract(self, texts: Sequence[str], layers: Sequence[int]) -> Extraction:
        out = self.chat.extract(texts, layers)
        mask = out.mask.clone()  # [B, T]
        for row in range(mask.shape[0]):
            real = mask[row].nonzero().flatten()
            mask[row, real[len(real) - self.suffix :]] = False
        return replace(out, hidden=out.hidden * mask[None, :, :, None], mask=mask)


def content_cache(held: Path, root: Path) -> tuple[HiddenStateCache, dict[str, Any]]:
    """The chat-form cache of ``held`` with the suffix masked out (built when missing), and
    the chat form: its key and how many ids it puts before and after a text."""
    from probes.errors import CacheError
    from worker.llm.chat_form import turn_ids
    from worker.llm.precision import resolve_state_dtype
    from worker.offline.build_cache import build_cache, cache_dir_for, llm_variant
    from worker.settings import load_settings

    settings = load_settings(text_form="chat")
    chat = HiddenStateExtractor.from_settings(settings)
    turn = turn_ids(chat.llm.tokenizer, system_prompt=settings.chat_system_prompt)
    form = {"key": turn.key, "context_tokens": len(turn.context), "suffix_tokens": len(turn.suffix)}
    out = cache_dir_for(held, root, str(settings.model), llm_variant(chat) + "-content")
    try:
        cache = HiddenStateCache(out)
        if not cache.missing_shards():
            return cache, form
    except CacheError:
        pass  # not a cache yet: build it
    log(f"building the content-only chat cache of {held} in {out} …")
    extractor = ContentOnly(chat, len(turn.suffix))
    dtype = resolve_state_dtype(settings.state_dtype, chat.model_type)
    build_cache(held, out, extractor, batch_size=settings.batch_size, dtype=dtype)
    return HiddenStateCache(out), form


# --- probes ------------------------------------------------------------------------------


def figures(spec: ProbeSpec, probs: Tensor, targets: Tensor, thresholds: dict) -> dict:
    """Held-out F1 (at ``thresholds``), AUPRC and recall at 1 % FPR of the flag labels."""
    rep = evaluate(spec.model_copy(update={"thresholds": thresholds}), probs, targets)
    flagged = rep["flagged"]
    out = {
        "f1": rep["f1"],
        "auprc": rep["auprc"],
        "r_at_1pct_fpr": flagged["recall_at_1pct_fpr"],
        "precision": flagged["precision"],
        "recall": flagged["recall"],
    }
    return {k: round(float(v), 4) for k, v in out.items()} | {"positives": flagged["support"]}


def fit_form(name: str, cache: HiddenStateCache, args: argparse.Namespace) -> dict[str, Any]:
    """Fit ``args.kind`` by CV on the training rows of ``cache``; the held-out figures."""
    data = quality.load([cache], args.kind, "label")
    dev, held = quality.split(data, None, args.holdout_share)
    spec = quality.spec_for(args.kind, dev, cache.manifest.llm.hidden_size, "label", name=name)
    config = FitConfig(max_epochs=args.epochs, patience=args.patience, seed=args.seed)
    started = time.perf_counter()
    result, cv = fit_cv(spec, dev, config, folds=args.folds)
    cv_auprc, _ = quality.spread([{"auprc": f.auprc} for f in cv.folds], "auprc")
    probs = predict_dataset(result.probe, held)
    row = {
        "cv_auprc": round(cv_auprc, 4),
        **figures(spec, probs, held.targets, cv.thresholds),
        "seconds": round(time.perf_counter() - started, 1),
    }
    log(f"  {name}: {row}")
    return {
        "row": row,
        "probe": result.probe,
        "spec": spec,
        "thresholds": cv.thresholds,
        "dev": dev,
        "held": held,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, data, limited = lines(args.data, args.limit), args.data, ""
    if args.limit:
        limited = f"limit{args.limit}-"
        data = part_file(rows, args.data, args.cache_root, limited.rstrip("-"))
    # The held-out rows alone, for the third (content-only) states: the same split as
    # quality.split makes of the whole file's cache.
    held = held_out([json.loads(r)["id"] for r in rows], args.holdout_share).tolist()
    held_rows = [r for r, h in zip(rows, held, strict=True) if h]
    part = f"{limited}held{round(args.holdout_share * 100)}"
    held_file = part_file(held_rows, args.data, args.cache_root, part)
    log(f"{len(rows)} rows of {args.data}, {len(held_rows)} held out by id hash")
    caches = {
        "raw": quality.cache_for(data, args.cache_root, text_form="raw"),
        "chat": quality.cache_for(data, args.cache_root, text_form="chat"),
    }
    forms = {k: getattr(c.manifest.llm, "text_form", None) for k, c in caches.items()}
    if forms["raw"] is not None or forms["chat"] is None:
        hint = "an older probeguard first on the path? Run it with PYTHONPATH=."
        raise SystemExit(f"the caches' text forms are {forms}: {hint}")
    content, form = content_cache(held_file, args.cache_root)
    log(f"chat form: {form}")
    fits = {}
    for name, cache in caches.items():
        log(f"{name}: {args.kind}, {args.folds}-fold CV on the training rows, then held-out …")
        fits[name] = fit_form(f"text-form-{name}", cache, args)
    raw = fits["raw"]
    inside = quality.load([content], args.kind, "label").relabel(raw["dev"].labels)
    if inside.ids != raw["held"].ids:
        raise SystemExit("the content-only cache holds other rows than the raw held-out ones")
    probs = predict_dataset(raw["probe"], inside)
    cross = figures(raw["spec"], probs, inside.targets, raw["thresholds"])
    log(f"  raw_in_chat: {cross}")

    results = {"raw": raw["row"], "chat": fits["chat"]["row"], "raw_in_chat": cross}
    print(f"held-out ({len(inside)} rows of {args.data}, {args.kind} probe)")
    print(f"{'':<12}{'F1':>8}{'AUPRC':>8}{'R@1%FPR':>9}")
    for name, r in results.items():
        print(f"{name:<12}{r['f1']:>8.3f}{r['auprc']:>8.3f}{r['r_at_1pct_fpr']:>9.3f}")
    out = {
        "bench": "text_form",
        "data": str(args.data),
        "limit": args.limit or None,
        "holdout_share": args.holdout_share,
        "kind": args.kind,
        "folds": args.folds,
        "chat_form": form,
        "train_rows": len(raw["dev"]),
        "test_rows": len(inside),
        **results,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
