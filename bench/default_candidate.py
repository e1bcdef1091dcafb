"""May a rebuilt default replace the shipped one? Both measured on the same held-out rows
of the same caches and on the plain lines a new user tries, judged by the rule fixed in
:mod:`worker.offline.adoption` (meet what the shipped one meets, lose nothing where it
misses, judge every line it judges right, and be better somewhere).

Rows: as ``bench/default_probe.py`` (the held-out 20 % of every recipe source, all of
ToxicChat's train + validation rows: ``--toxicchat``, its cache). Lines: the LLM of the
caches' fingerprint, read in the text form of this process's settings (so run a chat-form
candidate with ``PROBEGUARD_TEXT_FORM=chat``; a mismatch stops before anything runs).

Example (caches of ``probeguard default build --cache-root CACHES``)::

    PROBEGUARD_TEXT_FORM=chat python bench/default_candidate.py --cache-root CACHES \\
        --data-root ../shared/data --toxicchat TC_CACHE/toxicchat-all --candidate OUT

The last line is one JSON object: ``adopt``, the targets failed and newly met, the lines
lost and gained, and every target's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from probes import Probe, load_checkpoint
from worker.defaults import find_default, missing
from worker.offline.adoption import Judgement, judge, lines_judged_right
from worker.offline.default_recipe import default_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_probe import _load, _summary, add_row_args, measure  # bench/default_probe.py

from _shared import log


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_row_args(p, toxicchat=True)
    p.add_argument("--candidate", type=Path, required=True, help="a `default build --out`")
    p.add_argument(
        "--shipped",
        type=Path,
        default=None,
        help="the checkpoint folder to judge it against (default: the packaged default for "
        "the caches' LLM and text form)",
    )
    return p.parse_args(argv)


def _print(j: Judgement) -> None:
    print(f"{'target':<44} {'shipped':>9} {'candidate':>10} {'limit':>9}")
    for v in j.verdicts:
        mark = "" if v.ok else "  FAIL"
        mark += "  newly met" if v.newly_met else ""
        print(f"{v.target.name:<44} {v.shipped:>9.4f} {v.candidate:>10.4f} {v.limit:>9.4f}{mark}")
    for what, lines in (("lost", j.lines_lost), ("gained", j.lines_gained)):
        print(f"lines {what}: {len(lines)}" + "".join(f"\n  {t[:60]!r}" for t in lines))
    print("adopt" if j.adopt else "not adopted")


def main(argv: list[str] | None = None) -> int:
    from probes.offline.cache import HiddenStateCache
    from worker.llm.extract import HiddenStateExtractor
    from worker.settings import load_settings

    args = parse_args(argv)
    started = time.time()
    llm = HiddenStateCache(args.cache_root / "convabuse").manifest.llm
    extractor = HiddenStateExtractor.from_settings(load_settings())
    if extractor.fingerprint != llm:
        raise SystemExit(
            f"the caches were built by {llm.digest} (text form {llm.text_form or 'raw'}); "
            f"this process reads {extractor.fingerprint.digest} (text form "
            f"{extractor.fingerprint.text_form or 'raw'}): set PROBEGUARD_TEXT_FORM and the "
            "model as the caches were built"
        )
    if args.shipped is not None:
        shipped, _ = load_checkpoint(args.shipped, llm)
    elif (found := find_default(llm, "moderation")) is not None:
        shipped = found.probe
    else:
        raise SystemExit(missing(llm))
    candidate, _ = load_checkpoint(args.candidate, llm)

    # The held-out rows and the lines' states, read once for both probes where they read
    # the same layers and pool (a rebuild of the recipe does).
    rows: dict[tuple, dict[str, Any]] = {}
    states: dict[tuple, Any] = {}

    def scores_of(probe: Probe) -> Any:
        def scores(texts: Any) -> torch.Tensor:
            key = (tuple(probe.spec.layers), tuple(texts))
            if key not in states:
                states[key] = extractor.extract(list(texts), layers=list(key[0]))
            out = states[key]
            if out.index != list(range(len(texts))):
                raise SystemExit(f"a line could not be read: {out.errors}")
            return probe.predict_proba_many(out.hidden.float(), out.mask)

        return scores

    tables, lines = {}, {}
    for name, probe in (("shipped", shipped), ("candidate", candidate)):
        key = (tuple(probe.spec.layers), probe.spec.token_pool)
        if key not in rows:
            spec = default_spec(llm.hidden_size, list(key[0]), pool=key[1])
            rows[key] = _load(spec, args)[1]
        held = rows[key]
        tables[name] = {ds: _summary(measure(probe, item), ds) for ds, item in held.items()}
        lines[name] = lines_judged_right(probe, scores_of(probe))
        log(f"{name}: measured")
    judgement = judge(tables["shipped"], tables["candidate"], lines["shipped"], lines["candidate"])
    _print(judgement)
    print(json.dumps({"question": "may the candidate default replace the shipped one",
                      **judgement.as_json(), "tables": tables,
                      "seconds": round(time.time() - started, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
