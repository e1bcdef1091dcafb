"""A tiny random LLM for tests and benches: built in-process, offline, in well under a second.

The tokenizer is character-level (one token per printable ASCII character, ``<unk>`` for
anything else), so a text's token count is easy to predict: ``len(text)`` content tokens
plus the special tokens of the architecture:

- ``arch="llama"``: a Llama decoder; ``<s>`` before the text; the tokenizer has **no**
  pad token of its own (loading gives it one, as for real decoder LLMs), and a chat
  template (:data:`CHAT_TEMPLATE`: ``"system: be nice\nuser: hi\nassistant: "``);
- ``arch="bert"``: a BERT encoder; ``[CLS]`` before and ``[SEP]`` after the text; no
  chat template.

Example::

    llm = make_tiny_llm()                      # in memory
    llm = make_tiny_llm(tmp_path, arch="bert") # saved to tmp_path and loaded with load_llm
    llm.num_layers, llm.hidden_size            # (4, 32)
    llm = make_tiny_llm(lm_head="own")         # a Llama with an LM head (logit lens tests)

What tests and benches put on it: :func:`toxicity_spec` and :func:`moderation_spec` (the
specs of random probes on its layers), and :func:`settings_env` (the environment that runs
a ``probeguard`` role as a child process on a tiny model saved by ``make_tiny_llm(path)``).
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertModel,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma3TextModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from schemas import HeadSpec, ProbeSpec
from worker.llm.load import LoadedLLM, load_llm
from worker.settings import Settings

if TYPE_CHECKING:
    from probes.checkpoint import WeightFormat
    from probes.probe import Probe
    from schemas import LLMFingerprint

__all__ = [
    "CHAT_TEMPLATE",
    "HIDDEN_SIZE",
    "NUM_LAYERS",
    "make_tiny_gemma3",
    "make_tiny_llm",
    "moderation_spec",
    "publish_probe",
    "settings_env",
    "tiny_tokenizer",
    "toxicity_spec",
]

Arch = Literal["llama", "bert"]
# None: a base model; "own": an untied LM head of its own; "tied": the input embeddings.
Head = Literal["own", "tied"] | None
HIDDEN_SIZE = 32
NUM_LAYERS = 4
# The Llama tokenizer's: a default system line unless the first turn is one, then
# "<role>: <content>\n" per turn, and "assistant: " as the generation prompt.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}system: be nice\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_SPECIALS: dict[Arch, list[str]] = {
    "llama": ["<unk>", "<s>", "</s>"],
    "bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
}


def tiny_tokenizer(arch: Arch = "llama", *, extra_chars: str = "") -> PreTrainedTokenizerFast:
    """Character-level tokenizer; ``extra_chars`` grows the vocabulary (changes its hash)."""
    specials = _SPECIALS[arch]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable + extra_chars))}
    unk = "<unk>" if arch == "llama" else "[UNK]"
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if arch == "llama":
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            chat_template=CHAT_TEMPLATE,
        )
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def tiny_model(
    arch: Arch = "llama", *, vocab_size: int, seed: int = 0, lm_head: Head = None
) -> PreTrainedModel:
    """A randomly initialised base model (no LM head), seeded: same seed, same weights.

    The weights come from a private generator, not torch's global one, so building a
    model while another thread seeds or draws from the global generator (a probe being
    built, a scorer starting) still gives the same weights and the same fingerprint.

    ``lm_head`` (Llama only) wraps the same base model in a ``LlamaForCausalLM`` whose
    head is its own random matrix (``"own"``) or the input embeddings (``"tied"``).
    """
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    }
    if arch == "llama":
        model: PreTrainedModel = LlamaModel(LlamaConfig(**common, num_key_value_heads=2))
    else:
        model = BertModel(BertConfig(**common, pad_token_id=0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm scales and biases
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    if lm_head is not None:
        if arch != "llama":
            raise ValueError("tiny models have an LM head only for arch='llama'")
        config = cast(LlamaConfig, model.config)
        config.tie_word_embeddings = lm_head == "tied"
        causal = LlamaForCausalLM(config)
        causal.model = cast(LlamaModel, model)
        if lm_head == "tied":
            causal.lm_head.weight = causal.model.embed_tokens.weight
        else:
            with torch.no_grad():
                causal.lm_head.weight.copy_(torch.randn(causal.lm_head.weight.shape, generator=g))
        model = causal
    return model.eval()


def make_tiny_llm(
    tmp_path: Path | None = None,
    *,
    arch: Arch = "llama",
    padding_side: Literal["right", "left"] = "right",
    seed: int = 0,
    lm_head: Head = None,
) -> LoadedLLM:
    """A frozen tiny LLM; with ``tmp_path`` it is saved there and loaded through ``load_llm``
    (in ``tmp_path / "tiny-{arch}-{seed}"``, or ``"tiny-{arch}-{seed}-{lm_head}"``)."""
    tokenizer = tiny_tokenizer(arch)
    model = tiny_model(arch, vocab_size=len(tokenizer), seed=seed, lm_head=lm_head)
    name = f"tiny-{arch}-{seed}" + (f"-{lm_head}" if lm_head else "")
    if tmp_path is None:
        llm = LoadedLLM.from_model(model, tokenizer, model_id=name)
    else:
        directory = tmp_path / name
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        settings = Settings(model=str(directory), cache_dir=tmp_path / "cache")
        llm = load_llm(settings, lm_head=lm_head is not None)
    llm.tokenizer.padding_side = padding_side
    return llm


def make_tiny_gemma3(
    tmp_path: Path | None = None, *, lm_head: bool = False, wide: bool = False
) -> LoadedLLM:
    """A tiny Gemma 3 text model (sliding-window and global layers, scaled embeddings) with
    the Llama tiny tokenizer; ``lm_head``: a ``Gemma3ForCausalLM`` that can generate.

    ``wide``: embeddings scaled so that the residual stream is ~1e5, beyond fp16's 65504, as
    the real Gemma 3's is in its middle layers (its states need ``STATE_DTYPE=bfloat16``).
    With ``tmp_path`` it is saved there (``tmp_path / "tiny-gemma3[-head][-wide]"``) and
    loaded through ``load_llm``, as a Hugging Face model directory.
    """
    tokenizer = tiny_tokenizer("llama")
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,  # shorter than most texts: the sliding layers' own mask matters
        layer_types=["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config) if lm_head else Gemma3TextModel(config)
    if wide:
        with torch.no_grad():  # init std 0.02, times sqrt(32) in the forward: std ~1.1e5
            embed = model.get_input_embeddings()
            assert isinstance(embed, torch.nn.Embedding)
            embed.weight.mul_(1e6)
    if tmp_path is None:
        return LoadedLLM.from_model(model, tokenizer, model_id="tiny-gemma3")
    directory = tmp_path / (
        "tiny-gemma3" + ("-head" if lm_head else "") + ("-wide" if wide else "")
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return load_llm(Settings(model=str(directory), cache_dir=tmp_path / "cache"), lm_head=lm_head)


def toxicity_spec(
    hidden_size: int, layers: list[int] | None = None, name: str = "toxicity"
) -> ProbeSpec:
    """A two-class mean-pooling probe (``ok`` / ``toxic``) on ``layers`` (default 1 and 2)."""
    return ProbeSpec(
        name=name,
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=layers or [1, 2],
        hidden_size=hidden_size,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )


def moderation_spec(hidden_size: int, name: str = "moderation") -> ProbeSpec:
    """A multi-head probe whose labels are OpenAI categories, as the packaged default's."""
    return ProbeSpec(
        name=name,
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1, 2],
        hidden_size=hidden_size,
        task="multilabel",
        labels=["non-toxic", "toxic", "hate", "violence", "self-harm"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
            HeadSpec(name="hate", task="multilabel", labels=["hate"]),
            HeadSpec(name="violence", task="multilabel", labels=["violence"]),
            HeadSpec(name="self-harm", task="multilabel", labels=["self-harm"]),
        ],
        flag_labels=["toxic", "hate", "violence", "self-harm"],
    )


# The settings a child process gets from ``settings_env`` (besides Redis, model and cache).
_PASS_THROUGH = (
    "probes",
    "kafka_bootstrap",
    "redis_prefix",
    "topic_chat",
    "topic_labels",
    "topic_verdicts",
    "topic_review",
    "topic_dead_letter",
    "group_scorer",
    "group_updater",
    "kafka_session_timeout_ms",
    "kafka_heartbeat_interval_ms",
)


def publish_probe(
    registry: Any,  # a worker.store CheckpointRegistry (llm/ may not import store/)
    fingerprint: LLMFingerprint,
    *,
    spec: ProbeSpec | None = None,
    seed: int | None = 0,
    set_live: bool = True,
    probe: Probe | None = None,
    signing_key: bytes | None = None,
    weights: WeightFormat = "fp32",
) -> int:
    """Publish ``probe`` (else a random probe of ``spec``, else of :func:`toxicity_spec`
    under the registry's probe name; ``seed=None``: from torch's global generator) on
    ``fingerprint`` as the registry's next version; returns the version."""
    from probes.checkpoint import checkpoint_to_bytes
    from probes.probe import build_probe

    if probe is None:
        spec = spec or toxicity_spec(fingerprint.hidden_size, name=registry.probe)
        probe = build_probe(spec, seed=seed)
    version = registry.allocate_version()
    blob, manifest = checkpoint_to_bytes(
        probe,
        llm=fingerprint,
        version=version,
        signing_key=signing_key,
        weights=weights,
        deployment=registry.keys.deployment,
    )
    registry.publish(blob, manifest, set_live=set_live)
    return version


def settings_env(settings: Settings, model_dir: Path, **extra: object) -> dict[str, str]:
    """Environment giving a child process these settings, on the tiny model at ``model_dir``
    (saved by ``make_tiny_llm(path)``: its cache is ``path / "cache"``, beside it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBEGUARD_")}
    for field in _PASS_THROUGH:
        env[f"PROBEGUARD_{field.upper()}"] = str(getattr(settings, field))
    if settings.redis_url is not None:
        env["PROBEGUARD_REDIS_URL"] = settings.redis_url.get_secret_value()
    env["PROBEGUARD_MODEL"] = str(model_dir)
    env["PROBEGUARD_CACHE_DIR"] = str(model_dir.parent / "cache")
    env["PROBEGUARD_METRICS_PORT"] = "0"
    for key, value in extra.items():
        env[f"PROBEGUARD_{key.upper()}"] = str(value)
    return env
