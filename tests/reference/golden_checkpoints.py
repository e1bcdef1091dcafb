"""Golden checkpoints: written once by a release, loaded by every later one.

``golden/<pool>-<mix>/`` holds a checkpoint (``tensors.safetensors`` + ``manifest.json``,
signed with :data:`KEY`) of every token pool and every layer mix, plus ``inputs.safetensors``
(hidden states and mask) and ``expected.json`` (the probabilities the writing release
computed for them). ``tests/unit/probes/test_checkpoint.py`` loads them with the current code
and compares: renaming a state-dict key, changing a spec default, the manifest schema,
the signature or the format tag breaks it. When a format change is deliberate, add a
new golden directory (and a migration); do not rewrite these. Written by::

    python -m tests.reference.golden_checkpoints   # writes only the directories missing

Release 0.1 (format probeguard-probe/1) wrote the eight single-head kinds; the next one
added ``multihead-mha-scalar_mix`` (a binary, a multiclass and a two-label head).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from probes.checkpoint import FORMAT, save_checkpoint
from probes.probe import build_probe
from schemas import HeadSpec, LLMFingerprint, ProbeSpec, TrainingCounters

KEY = b"golden-checkpoint-key-0123456789"
ROOT = Path(__file__).with_name("golden")
FINGERPRINT = LLMFingerprint(
    model_id="golden-llm",
    source_sha256="a" * 64,
    num_layers=4,
    hidden_size=16,
    tokenizer_sha256="b" * 64,
)
KINDS = [(pool, "scalar_mix") for pool in ("first", "gate", "last", "max", "mean", "mha")]
KINDS += [("mean", "gate"), ("mean", "single"), ("multihead-mha", "scalar_mix")]


def spec(pool: str, mix: str) -> ProbeSpec:
    if pool.startswith("multihead-"):
        return ProbeSpec(
            name="golden",
            token_pool=pool.removeprefix("multihead-"),  # type: ignore[arg-type]
            layer_mix=mix,  # type: ignore[arg-type]
            layers=[1, 3],
            hidden_size=16,
            task="multilabel",
            labels=["toxic", "ok", "spam", "ads", "violence", "self-harm"],
            heads=[
                HeadSpec(name="toxicity", task="multilabel", labels=["toxic"]),
                HeadSpec(name="topic", task="multiclass", labels=["ok", "spam", "ads"]),
                HeadSpec(name="harm", task="multilabel", labels=["violence", "self-harm"]),
            ],
            flag_labels=["toxic", "spam", "self-harm"],
            thresholds={"toxic": 0.4, "spam": 0.6, "violence": 0.5, "self-harm": 0.3},
            d_inner=8,
            num_heads=2,
        )
    return ProbeSpec(
        name="golden",
        token_pool=pool,  # type: ignore[arg-type]
        layer_mix=mix,  # type: ignore[arg-type]
        layers=[2] if mix == "single" else [1, 3],
        hidden_size=16,
        task="multiclass",
        labels=["ok", "toxic", "spam"],
        flag_labels=["toxic"],
        thresholds={"toxic": 0.4},
        d_inner=8,
        num_heads=2,
    )


def main() -> None:
    for n, (pool, mix) in enumerate(KINDS):
        out = ROOT / f"{pool}-{mix}"
        if out.exists():
            continue  # written by an earlier release: never rewritten
        probe = build_probe(spec(pool, mix), seed=n)
        g = torch.Generator().manual_seed(100 + n)
        with torch.no_grad():  # non-trivial weights and normalization, not the init
            for p in probe.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        layers = len(probe.layers)
        probe.set_input_stats(
            torch.randn(layers, 16, generator=g), torch.rand(layers, 16, generator=g) + 0.5
        )
        hidden = torch.randn(layers, 3, 5, 16, generator=g)  # [L, B, T, D]
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
        save_checkpoint(
            probe,
            out,
            llm=FINGERPRINT,
            version=7,
            parent=6,
            counters=TrainingCounters(labels_seen=12, steps=3, per_label={"ok": 12}),
            metrics={"prequential_f1": 0.5},
            signing_key=KEY,
        )
        save_file({"hidden": hidden, "mask": mask}, str(out / "inputs.safetensors"))
        probs = probe.eval().predict_proba_many(hidden, mask)
        (out / "expected.json").write_text(
            json.dumps({"format": FORMAT, "probabilities": probs.tolist()}, indent=1) + "\n"
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
