"""What does gradient checkpointing save and cost for the MHA probe, per training step?

With ``gradient_checkpointing`` the MHA token pool (``probes/kinds/mha.py``) keeps no
attention activations for the backward pass and recomputes them there instead. Both
settings run here side by side on the same tensors, one training step at a time
(forward, cross-entropy, backward, SGD step), and are compared on:

- bytes held for backward: every tensor autograd saves during the forward, counted once
  per storage through ``torch.autograd.graph.saved_tensors_hooks`` (exact and
  deterministic; tensors saved inside the checkpointed region are not kept, so they are
  not counted);
- peak memory of a step: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the growth of
  the peak resident set (``ru_maxrss``) during the first full step, each setting in a fresh
  subprocess so that one's peak cannot hide the other's, with glibc told to give large
  blocks back when they are freed (``MALLOC_MMAP_THRESHOLD_``) so that the RSS follows the
  live tensors;
- time per step (median of ``--repeats``, the two settings' steps alternating, after one
  warm-up step each);
- gradients: the largest absolute difference between the two settings' gradients.

Example::

    python bench/grad_checkpoint.py --batch 16 --tokens 128 --threads 2

Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("off", "on")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=6, help="probe layers (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=576, help="LLM width (SmolLM2: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="messages per step (%(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per message (%(default)s)")
    p.add_argument("--d-inner", type=int, default=64, help="MHA inner width (%(default)s)")
    p.add_argument("--heads", type=int, default=4, help="MHA heads (%(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per setting (%(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("--no-subprocess", action="store_true", help="skip the CPU RSS peaks")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one RSS measurement
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The probe spec and one batch: hidden ``[L, B, T, D]``, mask ``[B, T]``, labels ``[B]``."""
    import torch

    from schemas import ProbeSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    L, B, T, D = args.layers, args.batch, args.tokens, args.hidden
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(L, B, T, D, generator=g)
    lengths = torch.randint(max(1, T // 4), T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    y = torch.randint(0, 2, (B,), generator=g)
    spec = ProbeSpec(
        name="bench",
        token_pool="mha",
        layer_mix="scalar_mix",
        layers=list(range(1, L + 1)),
        hidden_size=D,
        task="multiclass",
        labels=["ok", "toxic"],
        d_inner=args.d_inner,
        num_heads=args.heads,
    )
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return spec, hidden.to(device), mask.to(device), y.to(device)


def make_step(spec: Any, hidden: Any, mask: Any, y: Any, mode: str) -> tuple[Any, Any]:
    """A probe (seed 0) with checkpointing ``mode`` and a function running one training step."""
    import torch
    import torch.nn.functional as F

    from probes.probe import build_probe

    probe = build_probe(spec, seed=0).to(hidden.device).train()
    probe.pool.gradient_checkpointing = mode == "on"
    opt = torch.optim.SGD(probe.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(probe(hidden, mask), y).backward()
        opt.step()

    return probe, step


def saved_bytes(probe: Any, hidden: Any, mask: Any, y: Any) -> int:
    """Bytes autograd keeps for backward during one forward, each storage counted once."""
    import torch
    import torch.nn.functional as F

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(probe(hidden, mask), y)
    loss.backward()
    probe.zero_grad(set_to_none=True)
    seen.pop(hidden.untyped_storage().data_ptr(), None)  # the input exists either way
    return sum(seen.values())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: the peak RSS growth of the first full step of ``args.child``."""
    spec, hidden, mask, y = setup(args)
    _, warm = make_step(spec, hidden[:, :1, :2], mask[:1, :2], y[:1], args.child)
    warm()  # one-time costs (autograd engine, lazy imports) on a 2-token message
    _, step = make_step(spec, hidden, mask, y, args.child)
    before = rss_bytes()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mode": args.child, "peak_rss_growth_bytes": max(0, peak - before)}


def run_child(args: argparse.Namespace, argv: list[str], mode: str) -> dict[str, Any]:
    root = str(Path(__file__).resolve().parents[1])  # this checkout's probes/, not another's
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    # Blocks over 64 KiB get their own mmap, given back when freed: the peak RSS then follows
    # the live tensors instead of what glibc's heap kept from earlier frees.
    env = {**os.environ, "PYTHONPATH": path, "MALLOC_MMAP_THRESHOLD_": "65536"}
    env["MALLOC_TRIM_THRESHOLD_"] = "0"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", mode]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    spec, hidden, mask, y = setup(args)
    cuda = hidden.device.type == "cuda"
    rows: dict[str, dict[str, Any]] = {}
    grads: dict[str, list[Any]] = {}
    steps = {}
    for mode in MODES:
        probe, step = make_step(spec, hidden, mask, y, mode)
        row: dict[str, Any] = {"saved_for_backward_bytes": saved_bytes(probe, hidden, mask, y)}
        probe.zero_grad(set_to_none=True)
        F.cross_entropy(probe(hidden, mask), y).backward()
        grads[mode] = [p.grad.detach().clone() for p in probe.parameters()]
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            row["peak_step_bytes"] = torch.cuda.max_memory_allocated() - base
        elif not args.no_subprocess:
            row.update({k: v for k, v in run_child(args, argv, mode).items() if k != "mode"})
        step()  # warm-up
        rows[mode], steps[mode] = row, step
    # Timed steps alternate between the settings, so that a busy neighbour slows both alike.
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            start = time.perf_counter()
            steps[mode]()
            if cuda:
                torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - start)
    for mode in MODES:
        rows[mode]["ms_per_step"] = round(statistics.median(times[mode]) * 1000.0, 2)
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["off"], grads["on"], strict=True))
    off, on = rows["off"], rows["on"]

    def change(key: str) -> float | None:
        if key not in off or not off[key]:
            return None
        return round(100.0 * (on[key] - off[key]) / off[key], 1)

    return {
        "bench": "grad_checkpoint",
        "device": str(hidden.device),
        "threads": torch.get_num_threads(),
        "shape": {
            "layers": args.layers,
            "batch": args.batch,
            "tokens": args.tokens,
            "hidden": args.hidden,
            "d_inner": args.d_inner,
            "heads": args.heads,
            "real_tokens": int(mask.sum()),
        },
        "off": off,
        "on": on,
        "saved_for_backward_change_pct": change("saved_for_backward_bytes"),
        "peak_change_pct": change("peak_step_bytes" if cuda else "peak_rss_growth_bytes"),
        "time_change_pct": change("ms_per_step"),
        "max_abs_grad_diff": diff,
        "grads_allclose": all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(grads["off"], grads["on"], strict=True)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    out = measure(args, argv)
    mib = 2**20
    for mode in MODES:
        r = out[mode]
        peak = r.get("peak_step_bytes", r.get("peak_rss_growth_bytes"))
        shown = "-" if peak is None else f"{peak / mib:8.1f} MiB"
        print(
            f"checkpointing {mode:3}  saved for backward {r['saved_for_backward_bytes'] / mib:8.1f}"
            f" MiB  peak step {shown}  {r['ms_per_step']:8.2f} ms/step",
            flush=True,
        )
    print(
        f"change: saved {out['saved_for_backward_change_pct']} %, peak {out['peak_change_pct']} %,"
        f" time {out['time_change_pct']} %; max |grad diff| {out['max_abs_grad_diff']:.2e}",
        flush=True,
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
