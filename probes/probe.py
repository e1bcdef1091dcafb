"""The probe: normalize -> pool tokens per layer -> mix layers -> linear head.

::

    hidden [L, B, T, D] + mask [B, T]                (token-level states), or
    pooled [L, B, D]                                 (cached summaries, separable pools)
        -> (h - shift) / scale   per layer and dim   (training-set statistics; buffers;
                                                      applied by the pooling, which may
                                                      fold it into cheaper operations)
        -> token pool            [L, B, D]
        -> layer mix             [B, D]
        -> dropout, linear head  [B, C] logits

``L`` is ``len(spec.layers)``, in the spec's order. The normalization is a
fixed per-(layer, dimension) affine map, so it commutes with mean, max, first
and last pooling: a probe trained on cached summaries scores token-level
states identically.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from probes.calibration import calibrated_probabilities, multiclass_columns
from probes.errors import ProbeError

# Importing the kinds registers every one of them.
from probes.kinds import LAYER_MIXES, TOKEN_POOLS, LayerMixModule, TokenPoolModule
from probes.kinds.base import Prepared
from schemas import HeadCalibration, ProbeSpec

__all__ = [
    "Prepared",
    "Probe",
    "build_probe",
    "keep_layers",
    "multiclass_columns",
    "slice_layer_state",
    "weight_entropy",
]


def weight_entropy(weights: Tensor) -> float:
    """Shannon entropy (nats) of a weight vector ``[L]``; ``log L`` is uniform, 0 is collapsed."""
    w = weights.detach().clamp_min(1e-12)
    return max(0.0, float(-(w * w.log()).sum()))


class Probe(nn.Module):
    """A trainable probe built from a :class:`ProbeSpec`.

    >>> spec = ProbeSpec(name="tox", token_pool="mean", layer_mix="scalar_mix", layers=[1, 2],
    ...                  hidden_size=8, task="multiclass", labels=["ok", "toxic"])
    >>> probe = build_probe(spec, seed=0)
    >>> probe.predict_proba_many(torch.randn(2, 3, 5, 8), torch.ones(3, 5, dtype=torch.bool)).shape
    torch.Size([3, 2])
    """

    shift: Tensor  # [L, D] buffer
    scale: Tensor  # [L, D] buffer
    pool: TokenPoolModule
    mix: LayerMixModule
    exit_head: Probe | None  # the cascade's exit head (spec.exit), a probe over one layer

    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()
        if spec.token_pool not in TOKEN_POOLS:
            raise ProbeError(
                f"unknown token_pool {spec.token_pool!r}; known: {sorted(TOKEN_POOLS)}"
            )
        if spec.layer_mix not in LAYER_MIXES:
            raise ProbeError(f"unknown layer_mix {spec.layer_mix!r}; known: {sorted(LAYER_MIXES)}")
        self._spec = spec
        L, D, C = len(spec.layers), spec.hidden_size, len(spec.labels)
        self.register_buffer("shift", torch.zeros(L, D))  # [L, D]
        self.register_buffer("scale", torch.ones(L, D))  # [L, D]
        self.pool = TOKEN_POOLS[spec.token_pool](spec)
        self.mix = LAYER_MIXES[spec.layer_mix](spec)
        self.drop = nn.Dropout(spec.dropout)
        self.head = nn.Linear(D, C)
        # Its tensors live in this probe's state dict ("exit_head.*"), so checkpoints,
        # signatures, hot swaps and the updater's optimizer carry it unchanged.
        self.exit_head = Probe(spec.exit_view()) if spec.exit is not None else None

    # --- description -----------------------------------------------------
    @property
    def spec(self) -> ProbeSpec:
        """The spec this probe was built from (with its current thresholds)."""
        return self._spec

    def set_thresholds(self, thresholds: dict[str, float]) -> None:
        """Replace the decision thresholds in the spec (validated like any spec)."""
        data = self._spec.model_dump()
        data["thresholds"] = {k: float(v) for k, v in thresholds.items()}
        self._spec = ProbeSpec.model_validate(data)

    def set_calibration(self, calibration: Mapping[str, HeadCalibration]) -> None:
        """Replace the per-head calibration of the probabilities (``{}``: none). Thresholds
        chosen on other probabilities no longer mean what they did: set them after."""
        data = self._spec.model_dump()
        data["calibration"] = {k: v.model_dump() for k, v in calibration.items()}
        self._spec = ProbeSpec.model_validate(data)

    def rename(self, name: str) -> None:
        """Serve under another probe name (e.g. a packaged default as a deployment's probe)."""
        data = {**self._spec.model_dump(), "name": name}
        if not self._spec.heads and self._spec.name in self._spec.calibration:
            # A single-head probe's one head is named after the probe.
            data["calibration"] = {name: data["calibration"][self._spec.name]}
        self._spec = ProbeSpec.model_validate(data)

    @property
    def layers(self) -> tuple[int, ...]:
        """Hidden-state indices this probe reads; the extractor may stop at the last one."""
        return tuple(self._spec.layers)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self._spec.labels)

    @property
    def separable(self) -> bool:
        """True when the probe can score cached per-layer summaries ``[L, B, D]``."""
        return self.pool.separable

    def num_parameters(self) -> int:
        """Trainable parameters (normalization statistics are buffers, not counted)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @torch.no_grad()
    def set_input_stats(self, shift: Tensor, scale: Tensor) -> None:
        """Set the per-(layer, dimension) normalization ``(h - shift) / scale``; both ``[L, D]``."""
        want = tuple(self.shift.shape)
        for name, t in (("shift", shift), ("scale", scale)):
            if tuple(t.shape) != want:
                raise ProbeError(f"{name} has shape {tuple(t.shape)}, expected {want}")
            if not torch.isfinite(t).all():
                raise ProbeError(f"{name} holds non-finite values")
        if (scale <= 0).any():
            raise ProbeError(f"scale must be positive; smallest is {float(scale.min()):.3g}")
        self.shift.copy_(shift)
        self.scale.copy_(scale)
        if self.exit_head is not None and self._spec.exit is not None:
            at = self._spec.layers.index(self._spec.exit.layer)
            self.exit_head.set_input_stats(shift[at : at + 1], scale[at : at + 1])

    def exit_input(self, hidden: Tensor) -> Tensor:
        """The exit layer's slice ``[1, B, ...]`` of this probe's input ``[L, B, ...]``."""
        if self._spec.exit is None:
            raise ProbeError(f"probe {self._spec.name!r} has no exit head")
        at = self._spec.layers.index(self._spec.exit.layer)
        return hidden[at : at + 1]

    # --- scoring ---------------------------------------------------------
    def _check(self, hidden: Tensor, mask: Tensor | None) -> None:
        L, D = len(self._spec.layers), self._spec.hidden_size
        if hidden.dim() == 4:
            if mask is None:
                raise ProbeError("token-level hidden states [L, B, T, D] need a mask [B, T]")
            if mask.dtype != torch.bool or tuple(mask.shape) != tuple(hidden.shape[1:3]):
                raise ProbeError(
                    f"mask must be bool {tuple(hidden.shape[1:3])}, got {mask.dtype} "
                    f"{tuple(mask.shape)}"
                )
            empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
            if empty:
                raise ProbeError(f"rows {empty[:10]} of the batch have no real token")
        elif hidden.dim() == 3:
            if mask is not None:
                raise ProbeError("pooled summaries [L, B, D] take no mask")
            if not self.separable:
                raise ProbeError(
                    f"token_pool {self._spec.token_pool!r} needs token-level states, "
                    "not pooled summaries"
                )
        else:
            raise ProbeError(f"hidden states must be [L, B, T, D] or [L, B, D], got {hidden.shape}")
        if hidden.shape[0] != L or hidden.shape[-1] != D:
            raise ProbeError(
                f"hidden states have {hidden.shape[0]} layers of size {hidden.shape[-1]}; "
                f"the probe reads {L} layers {list(self._spec.layers)} of size {D}"
            )

    @torch.no_grad()
    def prepare(
        self, hidden: Tensor, mask: Tensor | None, *, dtype: torch.dtype | None = None
    ) -> Prepared | None:
        """A token-level batch with the pooling's parameter-free passes done under this
        probe's current normalization, to pass wherever ``hidden`` goes (``mask`` then
        unused) as long as the normalization stays; None when the pooling has no such
        passes, the states are summaries, or the probe has an exit head (it reads the raw
        states of its layer). Training prepares its batches once per fit (probes.offline.fit).
        ``dtype``: keep the token-level parts in it (bfloat16: half the memory, and the
        pooling's matrix products run in it); the rest stays in the probe's dtype."""
        self._check(hidden, mask)
        if mask is None or self.exit_head is not None:
            return None
        parts = self.pool.prepare(hidden.to(self.shift.dtype), mask, self.shift, self.scale)
        if parts is None:
            return None
        if dtype is not None:
            parts = tuple(p.to(dtype) if p.dim() == hidden.dim() else p for p in parts)
        return Prepared(parts, mask, self.shift.clone(), self.scale.clone())

    def summarize(self, hidden: Tensor | Prepared, mask: Tensor | None = None) -> Tensor:
        """Normalized per-layer summaries ``[L, B, D]`` (before the layer mix)."""
        if isinstance(hidden, Prepared):
            if not (
                torch.equal(hidden.shift, self.shift) and torch.equal(hidden.scale, self.scale)
            ):
                raise ProbeError(
                    "this batch was prepared under other input statistics than the probe's "
                    "(set_input_stats or a state load since): prepare it again"
                )
            return self.pool.forward_prepared(hidden.parts, hidden.mask)
        self._check(hidden, mask)
        hidden = hidden.to(self.shift.dtype)
        shift, scale = self.shift[:, None], self.scale[:, None]  # [L, 1, D]
        if mask is None:  # cached summaries [L, B, D] (checked above)
            return (hidden - shift) / scale
        return self.pool(hidden, mask, self.shift, self.scale)  # normalizes as it pools

    def forward(self, hidden: Tensor | Prepared, mask: Tensor | None = None) -> Tensor:
        """Logits ``[B, C]`` from ``[L, B, T, D]`` + ``[B, T]`` or from summaries ``[L, B, D]``."""
        mixed = self.mix(self.summarize(hidden, mask))  # [B, D]
        return self.head(self.drop(mixed))  # [B, C]

    def forward_with_layer_weights(
        self, hidden: Tensor | Prepared, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Logits ``[B, C]`` and the layer weights the mix used ``[L, B]`` (with gradients),
        for a learner that regularizes the mix (see ``Learner(mix_entropy=...)``)."""
        pooled = self.summarize(hidden, mask)  # [L, B, D]
        return self.head(self.drop(self.mix(pooled))), self.mix.weights(pooled)

    def probabilities(self, logits: Tensor) -> Tensor:
        """Softmax (multiclass) or sigmoid (multilabel) of logits ``[..., C]``, calibrated
        by ``spec.calibration`` when it has one; with heads, each multiclass head's columns
        take a softmax of their own. Every path from this probe's logits to probabilities
        goes through here (:mod:`probes.calibration`)."""
        return calibrated_probabilities(self._spec, logits)

    @torch.no_grad()
    def predict_logits_many(self, hidden: Tensor | Prepared, mask: Tensor | None = None) -> Tensor:
        """Uncalibrated logits ``[B, C]``, in eval mode, without gradients
        (:meth:`probabilities` of them is :meth:`predict_proba_many`)."""
        was_training = self.training
        self.eval()
        try:
            return self(hidden, mask)
        finally:
            self.train(was_training)

    @torch.no_grad()
    def predict_proba_many(self, hidden: Tensor | Prepared, mask: Tensor | None = None) -> Tensor:
        """Probabilities ``[B, C]`` in label order, in eval mode, without gradients."""
        return self.predict_proba_pooled(hidden, mask)[0]

    @torch.no_grad()
    def predict_proba_pooled(
        self, hidden: Tensor | Prepared, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Probabilities ``[B, C]`` and the normalized per-layer summaries ``[L, B, D]`` they
        came from (one pooling pass: drift monitoring reads the summaries for free)."""
        was_training = self.training
        self.eval()
        try:
            pooled = self.summarize(hidden, mask)  # [L, B, D]
            return self.probabilities(self.head(self.drop(self.mix(pooled)))), pooled
        finally:
            self.train(was_training)

    # --- monitoring ------------------------------------------------------
    @torch.no_grad()
    def layer_weights(self, hidden: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """Mean layer weights ``[L]`` over a batch; without a batch, the input-free weights.

        For ``scalar_mix`` and ``single`` the weights do not depend on the input.
        For ``gate`` they do: without a batch this returns ``softmax(prior)``.
        """
        if hidden is None:
            prior = getattr(self.mix, "prior", None)
            logits = getattr(self.mix, "logits", prior)
            if logits is None:
                return torch.ones(1)
            return torch.softmax(logits.detach(), dim=0)
        return self.mix.weights(self.summarize(hidden, mask)).mean(dim=1)  # [L]

    def layer_entropy(self, hidden: Tensor | None = None, mask: Tensor | None = None) -> float:
        """Entropy (nats) of :meth:`layer_weights`; near 0 means the mix collapsed on one layer."""
        return weight_entropy(self.layer_weights(hidden, mask))

    def extra_repr(self) -> str:
        s = self._spec
        return (
            f"name={s.name!r}, pool={s.token_pool}, mix={s.layer_mix}, layers={s.layers}, "
            f"labels={len(s.labels)}, params={self.num_parameters()}"
        )


def build_probe(spec: ProbeSpec, *, seed: int | None = None) -> Probe:
    """Build a fresh probe for ``spec``; with ``seed``, the initial weights are reproducible
    and the global RNG is left untouched."""
    if seed is None:
        return Probe(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Probe(spec)


def with_attention(
    probe: Probe, *, d_inner: int | None = None, num_heads: int | None = None, seed: int = 0
) -> Probe:
    """A copy of a mean-pool ``probe`` that pools tokens by attention (the ``mha`` kind,
    in ``d_inner`` dimensions split into ``num_heads`` heads: unset, the spec's), scoring
    exactly as ``probe`` does until it learns: the attention block adds its output to the
    plain mean of the same normalized states, and that output projection starts at zero.
    Every other tensor (normalization, layer mix, heads, the exit head) is copied; the
    block's query, key and value projections are drawn with ``seed``.

    Fine-tuning then learns which tokens matter, which a mean pool cannot (the packaged
    default is a mean pool: ``docs/default-probe.md``, "With the deployment's labels").

    >>> spec = ProbeSpec(name="tox", token_pool="mean", layer_mix="scalar_mix", layers=[1, 2],
    ...                  hidden_size=8, task="multiclass", labels=["ok", "toxic"], d_inner=4)
    >>> with_attention(build_probe(spec, seed=0)).spec.token_pool
    'mha'
    """
    if probe.spec.token_pool != "mean":
        raise ProbeError(
            f"only a mean pool starts an attention pool scoring as it did; this probe pools "
            f"by {probe.spec.token_pool!r}"
        )
    data = {**probe.spec.model_dump(), "token_pool": "mha"}
    data["d_inner"] = d_inner or data["d_inner"]
    data["num_heads"] = num_heads or data["num_heads"]
    spec = ProbeSpec.model_validate(data)
    attending = build_probe(spec, seed=seed)
    state = attending.state_dict()  # a mean pool has no tensors of its own: all are here
    state.update({k: v.detach().clone() for k, v in probe.state_dict().items()})
    state["pool.out"].zero_()  # the block's output: nothing added to the mean until it learns
    state["pool.out_bias"].zero_()
    attending.load_state_dict(state)
    attending.train(probe.training)
    return attending


def slice_layer_state(
    state: dict[str, Tensor], shapes: dict[str, torch.Size], pick: Tensor
) -> dict[str, Tensor]:
    """``state`` (of a probe over ``L`` layers) reshaped to ``shapes`` (the same probe kind
    over the layers ``pick`` of them): every per-layer tensor has the layer on its first
    axis, so a tensor whose shape changed is indexed there; the others are kept whole."""
    out = {}
    for name, want in shapes.items():
        if name not in state:
            continue  # e.g. an optimizer holding no state for a parameter yet
        t = state[name]
        if t.shape != want:
            t = t.index_select(0, pick)
            if t.shape != want:
                raise ProbeError(f"{name}: cannot slice {tuple(state[name].shape)} to {want}")
        out[name] = t.clone()
    return out


def keep_layers(probe: Probe, layers: list[int]) -> Probe:
    """A copy of ``probe`` reading only ``layers`` (a subset of its own): the same weights
    for those layers, the rest dropped. With a scalar mix the remaining layers' weights are
    renormalized (softmax over fewer logits), so the scores move by about the weight the
    dropped layers had.

    >>> spec = ProbeSpec(name="tox", token_pool="mha", layer_mix="scalar_mix", layers=[1, 2, 4],
    ...                  hidden_size=8, task="multiclass", labels=["ok", "toxic"], d_inner=4)
    >>> keep_layers(build_probe(spec, seed=0), [1, 2]).layers
    (1, 2)
    """
    old = list(probe.layers)
    if not layers or sorted(set(layers)) != layers or not set(layers) <= set(old):
        raise ProbeError(f"layers {layers} are not a sorted, non-empty subset of {old}")
    data = {**probe.spec.model_dump(), "layers": layers}
    gone = probe.spec.exit is not None and not probe.spec.exit.layer < layers[-1]
    if gone or (probe.spec.exit is not None and probe.spec.exit.layer not in layers):
        data["exit"] = None  # the exit head's layer is no longer read below the deepest
    spec = ProbeSpec.model_validate(data)
    smaller = Probe(spec)
    pick = torch.tensor([old.index(i) for i in layers])
    want = {k: v.shape for k, v in smaller.state_dict().items()}
    state = {k: v for k, v in probe.state_dict().items() if k in want}
    smaller.load_state_dict(slice_layer_state(state, want, pick))
    smaller.train(probe.training)
    return smaller
