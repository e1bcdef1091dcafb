"""The scoring engine against a plain forward pass: what does the code around the LLM cost?

Side by side in one process, on the same texts and at ``--sizes`` texts per call (default
1, 16, 64, 256):

- **plain**: the tokenizer (padding to the call's longest text, truncation at
  ``MAX_TOKENS``) and one transformers forward with ``output_hidden_states=True`` (every
  layer), under the same autocast as the extractor: the floor any scorer is measured
  against;
- **scorer**: :meth:`BatchScorer.score <worker.scoring.batch.BatchScorer.score>` with the
  packaged default's probe spec (mean pooling over every hidden state, scalar mix, its
  eleven heads; a seeded random probe: speed does not depend on the weights), split into
  extraction (``extract_s``), the probe (``probe_s - build_s``) and building the results
  (``build_s``: decisions, per-message results).

ms per message are the median of ``--repeats`` rounds, plain and scorer alternating within
each round so that load from other processes hits both alike. Then **paced**: Poisson
arrivals at ``--loads`` fractions (default 30/50/70/90 %) of the scorer's backlog rate
(its best msg/s over the sizes), one loop scoring whatever is queued (up to
``--max-batch``) each pass: p50/p99 from arrival to the end of the pass that scored it.
No Kafka and no Redis: the engine alone (``bench/scale.py`` measures the rest).

The LLM (``--device cpu|cuda``):

- default: the configured LLM (``PROBEGUARD_MODEL``, the packaged SmolLM2-135M);
- ``--random-weights``: that LLM's architecture (its config and tokenizer; ``--arch DIR``
  reads them from a folder, ``--save-arch DIR`` writes them there, ~3.5 MB for SmolLM2)
  with seeded random weights, so the check runs where the GGUF cannot travel (a GPU
  machine); speed does not depend on weight values;
- ``--tiny``: the tests' tiny random LLM (``worker/llm/tiny.py``: 4 layers of 32
  dimensions, one token per character). On the CPU its forward costs next to nothing, so
  **scorer minus plain is the host overhead**: issue 44's target is at most 0.3 ms per
  message at 64 texts per call.

The last line printed is one JSON object: per size (``sizes``) ``plain_ms``, ``scorer_ms``,
``scorer_over_plain``, ``extract_ms``, ``probe_ms``, ``build_ms`` (ms per message), and at
the top level ``host_overhead_ms`` (scorer minus plain at 64 texts per call), ``device``,
``backlog_msg_s`` and ``paced``.

Example (``PYTHONPATH=.``: the script imports this checkout's packages, and ``tests/`` for
``--tiny``)::

    PYTHONPATH=. python bench/score_engine.py --tiny --device cpu \\
        --data ../shared/data/toxicchat/validation.jsonl
    PYTHONPATH=. python bench/score_engine.py --random-weights --device cuda --arch ARCH_DIR \\
        --data validation.jsonl

Results: ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _shared import log

# Issue 44: scorer minus plain forward, ms per message at 64 texts per call (tiny, CPU).
TARGET_HOST_OVERHEAD_MS = 0.3
DEFAULT_PROBE = Path(__file__).resolve().parents[1] / "worker/defaults/smollm2-135m-instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="JSONL file with a 'text' field")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--tiny", action="store_true", help="the tests' tiny random LLM")
    which.add_argument(
        "--random-weights", action="store_true", help="the LLM's architecture, random weights"
    )
    p.add_argument("--arch", type=Path, help="config + tokenizer folder for --random-weights")
    p.add_argument("--save-arch", type=Path, help="write the LLM's config + tokenizer here")
    p.add_argument("--texts", type=int, default=256, help="texts per round (%(default)s)")
    p.add_argument("--sizes", default="1,16,64,256", help="texts per call (%(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, median kept (%(default)s)")
    p.add_argument("--loads", default="0.3,0.5,0.7,0.9", help="paced fractions ('' for none)")
    p.add_argument("--paced-seconds", type=float, default=10.0, help="per load (%(default)s)")
    p.add_argument("--max-batch", type=int, default=256, help="paced pass (%(default)s)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    return p.parse_args(argv)


# --- what runs ----------------------------------------------------------------------------


def build_llm(args: argparse.Namespace, settings: Any) -> Any:
    """The LoadedLLM the run measures, on ``args.device``, autocast as the settings say."""
    import torch

    from worker.llm.load import LoadedLLM, apply_autocast, load_llm

    if args.tiny:
        from worker.llm.tiny import make_tiny_llm

        llm = make_tiny_llm()
        llm.model.to(args.device)
        return apply_autocast(llm, settings.autocast)
    if not args.random_weights:
        return load_llm(settings)
    from transformers import AutoModel

    config, tokenizer = arch(args, settings)
    torch.manual_seed(0)
    model = AutoModel.from_config(config).to(args.device)
    # The source hash names the weights; hashing 0.5 GB of random ones would say nothing.
    llm = LoadedLLM.from_model(model, tokenizer, model_id="random", source_sha256="0" * 64)
    return apply_autocast(llm, settings.autocast)


def arch(args: argparse.Namespace, settings: Any) -> tuple[Any, Any]:
    """The configured LLM's config and tokenizer (from ``--arch``, or its own files)."""
    from transformers import AutoConfig, AutoTokenizer

    from worker.llm.source import resolve_source

    if args.arch is not None:
        config = AutoConfig.from_pretrained(args.arch)
        tokenizer = AutoTokenizer.from_pretrained(args.arch)
    else:
        source = resolve_source(
            settings.model, settings.model_gguf_file, cache_dir=settings.cache_dir
        )
        extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        config = AutoConfig.from_pretrained(source.directory, local_files_only=True, **extra)
        tokenizer = AutoTokenizer.from_pretrained(source.directory, local_files_only=True, **extra)
    if args.save_arch is not None:
        config.save_pretrained(args.save_arch)
        tokenizer.save_pretrained(args.save_arch)
    return config, tokenizer


def build_scorer(llm: Any, settings: Any) -> Any:
    """A BatchScorer serving a seeded random probe of the packaged default's spec, its
    layers and width fitted to ``llm`` (every hidden state, as the default reads)."""
    from probes.probe import build_probe
    from schemas import CheckpointManifest
    from worker.llm.extract import HiddenStateExtractor
    from worker.scoring.batch import BatchScorer
    from worker.scoring.served import ProbeSlot, ServedProbe

    extractor = HiddenStateExtractor.for_llm(llm, settings)
    manifest = CheckpointManifest.model_validate_json((DEFAULT_PROBE / "manifest.json").read_text())
    spec = manifest.spec.model_copy(
        update={"layers": list(range(llm.num_layers + 1)), "hidden_size": llm.hidden_size}
    )
    manifest = manifest.model_copy(update={"spec": spec})
    probe = build_probe(spec, seed=0).to(extractor.device).eval()
    slot = ProbeSlot(name=spec.name, live=ServedProbe(probe, manifest))
    return BatchScorer(extractor, {slot.name: slot}, limits=settings.limits)


def messages(texts: list[str]) -> list[Any]:
    from schemas import ChatMessage, utcnow

    now = utcnow()
    return [
        ChatMessage(message_id=f"m{i}", conversation_id=f"c{i}", text=t, created_at=now)
        for i, t in enumerate(texts)
    ]


# --- measuring ----------------------------------------------------------------------------


class Plain:
    """Tokenizer + forward passes with every hidden state, as transformers gives them.

    ``batched=False``: one pass per call, padded to its longest text (the issue's plain
    forward). ``batched=True``: the call's texts tokenized once, then cut into the
    extractor's own micro-batches (length-sorted, ``BATCH_TOKENS`` / ``BATCH_SIZE`` /
    ``BATCH_MIN_FILL``), one pass each: the same forward work the scorer does, so scorer
    minus this is what the code around the forward costs, whatever the padding."""

    def __init__(self, llm: Any, settings: Any, *, batched: bool) -> None:
        self.llm, self.settings, self.batched = llm, settings, batched

    def __call__(self, texts: list[str]) -> None:
        import torch

        llm, s = self.llm, self.settings
        tok = dict(truncation=True, max_length=s.max_tokens)
        if not self.batched:
            encs = [llm.tokenizer(texts, padding=True, return_tensors="pt", **tok)]
        else:
            from worker.llm.plan import length_batches

            ids = llm.tokenizer(texts, **tok)["input_ids"]
            groups = length_batches(
                [len(i) for i in ids], s.batch_tokens or None, s.batch_size, s.batch_min_fill
            )
            encs = [
                llm.tokenizer.pad({"input_ids": [ids[i] for i in g]}, return_tensors="pt")
                for g in groups
            ]
        with (
            torch.inference_mode(),
            torch.autocast(llm.device.type, dtype=llm.autocast, enabled=llm.autocast is not None),
        ):
            for enc in encs:
                llm.model(**enc.to(llm.device), output_hidden_states=True, use_cache=False)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn: Any, chunks: list[list[Any]], device: str) -> float:
    """Seconds for ``fn`` over every chunk, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    for chunk in chunks:
        fn(chunk)
    sync(device)
    return time.perf_counter() - t0


def by_size(
    plains: dict[str, Plain], scorer: Any, texts: list[str], size: int, repeats: int, device: str
) -> dict[str, float]:
    """ms per message of the plain forwards and the scorer at ``size`` texts per call
    (medians of rounds; within a round they alternate)."""
    chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
    msgs = messages(texts)
    mchunks = [msgs[i : i + size] for i in range(0, len(msgs), size)]
    split = {"extract": 0.0, "probe": 0.0, "build": 0.0}

    def score(chunk: list[Any]) -> None:
        out = scorer.score(chunk)
        split["extract"] += out.extract_s
        split["probe"] += out.probe_s - out.build_s
        split["build"] += out.build_s

    for plain in plains.values():  # warm-up: first calls allocate, autotune, fill caches
        plain(chunks[0])
    score(mchunks[0])
    n = len(texts)
    rounds: dict[str, list[float]] = {k: [] for k in (*plains, "scorer", *split)}
    for _ in range(repeats):
        for k in split:
            split[k] = 0.0
        for name, plain in plains.items():
            rounds[name].append(time_calls(plain, chunks, device) / n)
        rounds["scorer"].append(time_calls(score, mchunks, device) / n)
        for k, v in split.items():
            rounds[k].append(v / n)
    ms = {f"{k}_ms": round(1000 * statistics.median(v), 4) for k, v in rounds.items()}
    ratios = [s / p for s, p in zip(rounds["scorer"], rounds["plain"], strict=True)]
    ms["scorer_over_plain"] = round(statistics.median(ratios), 3)
    # The code around the forward: scorer minus the same micro-batches' plain forwards.
    ms["overhead_ms"] = round(
        1000
        * statistics.median(
            s - p for s, p in zip(rounds["scorer"], rounds["plain_batched"], strict=True)
        ),
        4,
    )
    ms["scorer_msg_s"] = round(1000 / ms["scorer_ms"], 1)
    ms["plain_msg_s"] = round(1000 / ms["plain_ms"], 1)
    return ms


def paced(scorer: Any, texts: list[str], rate: float, seconds: float, max_batch: int) -> dict:
    """Poisson arrivals at ``rate`` msg/s for ``seconds``; a loop scores whatever is queued."""
    msgs = messages(texts)
    queue: list[tuple[float, Any]] = []
    lock, done = threading.Lock(), threading.Event()
    rng = random.Random(1)

    def produce() -> None:
        t0 = nxt = time.perf_counter()
        n = 0
        while nxt - t0 < seconds:
            now = time.perf_counter()
            if now < nxt:
                time.sleep(min(nxt - now, 0.002))
                continue
            with lock:
                queue.append((nxt, msgs[n % len(msgs)]))
            n += 1
            nxt += rng.expovariate(rate)
        done.set()

    thread = threading.Thread(target=produce)
    thread.start()
    latencies: list[float] = []
    batches: list[int] = []
    device = scorer.extractor.device.type
    while not (done.is_set() and not queue):
        with lock:
            take, queue[:] = queue[:max_batch], queue[max_batch:]
        if not take:
            time.sleep(0.0005)
            continue
        scorer.score([m for _, m in take])
        sync(device)
        end = time.perf_counter()
        latencies += [end - t for t, _ in take]
        batches.append(len(take))
    thread.join()
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {
        "rate": round(rate, 1),
        "n": len(latencies),
        "p50_ms": round(1000 * statistics.median(latencies), 2),
        "p99_ms": round(1000 * p99, 2),
        "mean_batch": round(statistics.mean(batches), 1),
    }


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from worker.settings import Settings

    if args.threads:  # on a shared machine one thread spins less waiting for busy cores
        torch.set_num_threads(args.threads)

    settings = Settings(device=args.device, metrics_port=0)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    texts = [str(r["text"]) for r in rows if str(r.get("text", "")).strip()]
    texts = (texts * (args.texts // max(1, len(texts)) + 1))[: args.texts]
    llm = build_llm(args, settings)
    scorer = build_scorer(llm, settings)
    plains = {
        "plain": Plain(llm, settings, batched=False),
        "plain_batched": Plain(llm, settings, batched=True),
    }
    log(f"{llm.fingerprint.model_id} on {llm.device}: {llm.num_layers} layers, {len(texts)} texts")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    out: dict[str, Any] = {
        "bench": "score_engine",
        "device": device_name(args.device),
        "model": "tiny" if args.tiny else llm.fingerprint.model_id,
        "random_weights": bool(args.tiny or args.random_weights),
        "autocast": str(llm.autocast).removeprefix("torch.") if llm.autocast else None,
        "texts": len(texts),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "sizes": {},
    }
    for size in sizes:
        row = by_size(plains, scorer, texts, size, args.repeats, args.device)
        log(f"{size:>4} texts per call: {row}")
        out["sizes"][str(size)] = row
    if "64" in out["sizes"]:
        row = out["sizes"]["64"]
        out["host_overhead_ms"] = row["overhead_ms"]
        out["scorer_minus_plain_ms"] = round(row["scorer_ms"] - row["plain_ms"], 4)
        out["target_host_overhead_ms"] = TARGET_HOST_OVERHEAD_MS
    out["backlog_msg_s"] = max(r["scorer_msg_s"] for r in out["sizes"].values())
    loads = [float(x) for x in args.loads.split(",") if x]
    out["paced"] = []
    for load in loads:
        rate = load * out["backlog_msg_s"]
        row = {"load": load, **paced(scorer, texts, rate, args.paced_seconds, args.max_batch)}
        log(f"paced at {load:.0%}: {row}")
        out["paced"].append(row)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
