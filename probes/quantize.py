"""int8 probe weights: symmetric per-row quantization of a probe's state dict.

A row is every axis but the last (``head.weight [C, D]``: one scale per output class;
``mha.qkv [L, D, 3d]``: one per layer and input dimension). Each row ``r`` stores
``q = round(x / s_r)`` in int8 with ``s_r = max|x_r| / 127`` in fp32, so
``|x - q·s_r| <= s_r / 2``. How each tensor is stored (``encoding`` in the safetensors
metadata, a JSON object key -> encoding):

- ``"f32"``: unchanged (1-D tensors, scalars and rows shorter than :data:`MIN_ROW`,
  where the scales would cost more than the int8 saves: biases, mix logits, gamma).
- ``"int8"``: ``x ≈ q · s[..., None]``; the scales are stored as ``<key>.qscale``.
- ``"int8-log"``: the normalization ``scale`` (a positive std per layer and dimension,
  spanning decades: 0.013 to 1250 in SmolLM2's summaries): ``x ≈ exp(c + q · s)`` with a
  per-row centre ``c`` (``<key>.qcenter``), a relative error of at most ``s / 2`` (about
  2 % there).
- ``"int8-over-scale"``: the normalization ``shift`` in units of ``scale``, around the
  row's median ``c`` (``<key>.qcenter``): ``x ≈ (c + q · s) · scale``, except the
  :data:`OUTLIER_SHARE` of entries furthest from ``c``, stored exactly
  (``<key>.outlier_index`` int32 into the flattened tensor, ``<key>.outlier_value``
  fp32). A plain per-layer int8 of ``shift`` would spend its 255 steps on the dimensions
  with huge activations (means of ±400) and move every other dimension's normalized
  input by a sizeable fraction of a standard deviation. In std units the error is
  ``s / 2``: about 0.01 std for mean-pooled SmolLM2 states (99 % of the entries within
  3 std of the median); max-pooled ones spread wider (means 2 to 30 std from zero), and
  their error grows with that spread (``bench/int8_probes.py`` measures what it costs).

:func:`quantize_state` and :func:`dequantize_state` are exact inverses up to the rounding;
:mod:`probes.checkpoint` stores the first and loads through the second (dequantizing to
fp32: the bytes stored and transferred shrink, the probe serves in its usual dtype).

>>> import torch
>>> state = {"head.weight": torch.randn(2, 16), "head.bias": torch.randn(2)}
>>> tensors, enc = quantize_state(state)
>>> enc, tensors["head.weight"].dtype
({'head.weight': 'int8', 'head.bias': 'f32'}, torch.int8)
>>> back = dequantize_state(tensors, enc)
>>> bool((back["head.weight"] - state["head.weight"]).abs().max() <= tensors[
...     "head.weight.qscale"].max() / 2 + 1e-6)
True
"""

from __future__ import annotations

import torch
from torch import Tensor

from probes.errors import CheckpointError

__all__ = [
    "ENCODINGS",
    "MIN_ROW",
    "OUTLIER_SHARE",
    "SCALE_SUFFIX",
    "dequantize_state",
    "quantize_state",
]

MIN_ROW = 8  # shorter rows stay fp32: a 4-byte scale per row would eat the saving
OUTLIER_SHARE = 0.01  # the shift entries furthest from their row's median, stored exactly
SCALE_SUFFIX = ".qscale"
CENTER_SUFFIX = ".qcenter"
OUTLIER_INDEX = ".outlier_index"
OUTLIER_VALUE = ".outlier_value"
_EXTRA = {
    "f32": (),
    "int8": (SCALE_SUFFIX,),
    "int8-log": (SCALE_SUFFIX, CENTER_SUFFIX),
    "int8-over-scale": (SCALE_SUFFIX, CENTER_SUFFIX, OUTLIER_INDEX, OUTLIER_VALUE),
}
ENCODINGS = ("f32", "int8", "int8-log", "int8-over-scale")
_QMAX = 127.0


def _rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(q int8, s fp32 [x.shape[:-1]])`` with ``x ≈ q · s[..., None]``."""
    s = x.abs().amax(dim=-1) / _QMAX  # [rows]
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: any scale will do
    q = torch.round(x / s[..., None]).clamp(-_QMAX, _QMAX).to(torch.int8)
    return q, s.float()


def _encoding(key: str, x: Tensor, state: dict[str, Tensor]) -> str:
    if x.dim() < 2 or x.shape[-1] < MIN_ROW or not x.is_floating_point():
        return "f32"
    normalization = (
        "shift" in state and "scale" in state and state["shift"].shape == state["scale"].shape
    )
    if normalization and key == "scale" and bool((x > 0).all()):
        return "int8-log"
    if normalization and key == "shift" and bool((state["scale"] > 0).all()):
        return "int8-over-scale"
    return "int8"


def _log_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, s, c)`` with ``log x ≈ c[..., None] + q · s[..., None]`` (centred per row)."""
    lx = x.log()
    c = (lx.amax(dim=-1) + lx.amin(dim=-1)) / 2  # [rows]
    q, s = _rows_int8(lx - c[..., None])
    return q, s, c.float()


def _dequant_log(q: Tensor, s: Tensor, c: Tensor) -> Tensor:
    return (c[..., None] + q.float() * s[..., None]).exp()


def quantize_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A probe's fp32 state dict as safetensors-ready tensors and their encodings.

    Raises :class:`CheckpointError` for a non-finite value (it cannot be quantized)."""
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    for key, x in state.items():
        if not torch.isfinite(x).all():
            raise CheckpointError(f"tensor {key!r} holds NaN or inf; it cannot be quantized")
    tensors: dict[str, Tensor] = {}
    encodings: dict[str, str] = {}
    served_scale = state.get("scale")  # the normalization scale as it will be loaded
    for key, x in state.items():
        enc = encodings[key] = _encoding(key, x, state)
        if enc == "f32":
            tensors[key] = x
        elif enc == "int8":
            tensors[key], tensors[key + SCALE_SUFFIX] = _rows_int8(x)
        elif enc == "int8-log":
            q, s, c = _log_rows(x)
            tensors[key], tensors[key + SCALE_SUFFIX], tensors[key + CENTER_SUFFIX] = q, s, c
            served_scale = _dequant_log(q, s, c)
    if encodings.get("shift") == "int8-over-scale" and served_scale is not None:
        # In units of the scale the loader will divide by, so the two errors do not add up.
        shift = state["shift"]
        ratio = shift / served_scale
        center = ratio.median(dim=-1).values  # [rows]
        off = (ratio - center[..., None]).abs()
        reach = torch.quantile(off, 1.0 - OUTLIER_SHARE, dim=-1, keepdim=True)
        far = off > reach
        inner = torch.where(far, torch.zeros_like(ratio), ratio - center[..., None])
        q, s = _rows_int8(inner)
        index = far.flatten().nonzero().flatten()
        tensors["shift"], tensors["shift" + SCALE_SUFFIX] = q, s
        tensors["shift" + CENTER_SUFFIX] = center.float()
        tensors["shift" + OUTLIER_INDEX] = index.to(torch.int32)
        tensors["shift" + OUTLIER_VALUE] = shift.flatten()[index]
    return {k: v.contiguous() for k, v in tensors.items()}, encodings


def _decode_one(key: str, enc: str, tensors: dict[str, Tensor]) -> Tensor:
    q = tensors.get(key)
    if q is None:
        raise CheckpointError(f"int8 checkpoint lacks tensor {key!r} that its encoding names")
    if enc == "f32":
        if q.dtype != torch.float32:
            raise CheckpointError(f"tensor {key!r} is {q.dtype}, its encoding says float32")
        return q
    s = tensors.get(key + SCALE_SUFFIX)
    if q.dtype != torch.int8 or s is None or s.dtype != torch.float32:
        raise CheckpointError(
            f"tensor {key!r} ({q.dtype}) is not int8 with float32 scales {key + SCALE_SUFFIX!r}"
        )
    if tuple(s.shape) != tuple(q.shape[:-1]):
        raise CheckpointError(
            f"scales of {key!r} have shape {tuple(s.shape)}, expected {tuple(q.shape[:-1])}"
        )
    if not torch.isfinite(s).all() or bool((s <= 0).any()):
        raise CheckpointError(f"scales of {key!r} must be finite and positive")
    return q.float() * s[..., None]


def _tensor(tensors: dict[str, Tensor], key: str, dtype: torch.dtype) -> Tensor:
    t = tensors.get(key)
    if t is None:
        raise CheckpointError(f"int8 checkpoint lacks tensor {key!r} that its encoding names")
    if t.dtype != dtype:
        raise CheckpointError(f"tensor {key!r} is {t.dtype}, its encoding needs {dtype}")
    return t


def dequantize_state(tensors: dict[str, Tensor], encodings: dict[str, str]) -> dict[str, Tensor]:
    """The fp32 state dict that :func:`quantize_state` encoded (up to its rounding).

    Raises :class:`CheckpointError` naming the tensor when the pair does not fit together
    (an unknown encoding, a missing or stray tensor, wrong dtypes or shapes)."""
    bad = sorted(k for k, e in encodings.items() if e not in ENCODINGS)
    if bad:
        raise CheckpointError(f"unknown encodings for tensors {bad}; known: {list(ENCODINGS)}")
    expected = set(encodings) | {k + x for k, e in encodings.items() for x in _EXTRA[e]}
    stray = sorted(set(tensors) - expected)
    if stray:
        raise CheckpointError(f"int8 checkpoint holds tensors no encoding names: {stray}")
    state = {key: _decode_one(key, enc, tensors) for key, enc in encodings.items()}
    if encodings.get("scale") == "int8-log":
        c = _tensor(tensors, "scale" + CENTER_SUFFIX, torch.float32)
        if tuple(c.shape) != tuple(state["scale"].shape[:-1]) or not torch.isfinite(c).all():
            raise CheckpointError("the centres of 'scale' have the wrong shape or are not finite")
        state["scale"] = (state["scale"] + c[..., None]).exp()
    if encodings.get("shift") == "int8-over-scale":
        if "scale" not in state or state["scale"].shape != state["shift"].shape:
            raise CheckpointError("int8 'shift' is stored in units of 'scale', which is missing")
        c = _tensor(tensors, "shift" + CENTER_SUFFIX, torch.float32)
        if tuple(c.shape) != tuple(state["shift"].shape[:-1]) or not torch.isfinite(c).all():
            raise CheckpointError("the centres of 'shift' have the wrong shape or are not finite")
        shift = ((state["shift"] + c[..., None]) * state["scale"]).flatten()
        index = _tensor(tensors, "shift" + OUTLIER_INDEX, torch.int32).long()
        value = _tensor(tensors, "shift" + OUTLIER_VALUE, torch.float32)
        if index.shape != value.shape or index.dim() != 1:
            raise CheckpointError("the outliers of 'shift' have mismatched shapes")
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= shift.numel()):
            raise CheckpointError("an outlier index of 'shift' is out of range")
        shift[index] = value
        state["shift"] = shift.view_as(state["shift"])
    return state
