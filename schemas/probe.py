"""Probe specs: what a probe reads, how it pools and mixes layers, its heads, labels,
thresholds, calibration and exit head; everything needed to rebuild one from its tensors.

What travels beside a probe (the checkpoint manifest, the LLM's fingerprint, ensembles and
the checkpoint event stream) is :mod:`schemas.checkpoint`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from schemas.base import WireModel
from schemas.limits import LabelName
from schemas.messages import ProbeName

__all__ = [
    "ExitSpec",
    "HeadCalibration",
    "HeadSpec",
    "LayerMix",
    "ProbeSpec",
    "Task",
    "TokenPool",
]

TokenPool = Literal["mean", "max", "first", "last", "gate", "mha"]
LayerMix = Literal["single", "scalar_mix", "gate"]
Task = Literal["multiclass", "multilabel"]


class HeadSpec(WireModel):
    """One task of a multi-head probe: a name and its own label space.

    ``multilabel`` with one label is a binary head (a sigmoid: the label, or none);
    ``multiclass`` heads take a softmax over their own labels. Thresholds and flag labels
    stay keyed by label on the :class:`ProbeSpec` (labels are unique across heads).
    """

    name: ProbeName
    task: Task
    labels: Annotated[list[LabelName], Field(min_length=1, max_length=1024)]

    @model_validator(mode="after")
    def _consistent(self) -> HeadSpec:
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"head {self.name!r}: labels must not repeat")
        if self.task == "multiclass" and len(self.labels) < 2:
            raise ValueError(f"multiclass head {self.name!r} needs at least two labels")
        return self


class ExitSpec(WireModel):
    """An exit head: a small probe over one shallow layer that decides easy messages there
    (the cascade), so the forward pass above that layer runs only for the others.

    It reads hidden-state index ``layer`` (one of the probe's layers, below its deepest)
    through ``token_pool``, has the probe's heads and labels, and its probabilities are
    those of ``logits / temperature + bias`` (one bias per label; both calibrated on
    out-of-fold scores: a temperature alone cannot move probabilities to the data's base
    rate, which a class-balanced head lacks). A message exits
    as *allowed* when every flag label's calibrated probability is below ``allow_below``
    (0: never), as *flagged* when one reaches ``flag_above`` (None: never).
    """

    layer: Annotated[int, Field(ge=1, le=1024)]
    token_pool: TokenPool = "mean"
    temperature: Annotated[float, Field(gt=0.0, le=1000.0)] = 1.0
    bias: (
        Annotated[list[Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)] | None
    ) = None
    allow_below: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    flag_above: Annotated[float, Field(gt=0.0, le=1.0)] | None = None


class HeadCalibration(WireModel):
    """How one head's logits become probabilities: softmax / sigmoid of ``logits /
    temperature + bias`` (one bias per label of the head), fitted on out-of-fold logits
    (``fit``) or on the updater's prequential window. A class-balanced loss leaves a head's
    probabilities at about half flagged whatever the data's base rate; the bias moves them
    back, the temperature spreads or squashes them. Monotone per sigmoid label (and for a
    two-class softmax), so their AUPRC does not move; thresholds are chosen on the
    calibrated probabilities.

    ``labels_seen``: the probe's training labels (``TrainingCounters.labels_seen``) when it
    was fitted; a checkpoint whose counters are ahead learned that many labels since.
    """

    temperature: Annotated[float, Field(gt=0.0, le=1000.0)] = 1.0
    bias: Annotated[
        list[Annotated[float, Field(ge=-100.0, le=100.0)]], Field(min_length=1, max_length=1024)
    ]
    labels_seen: Annotated[int, Field(ge=0)] = 0


class ProbeSpec(WireModel):
    """The architecture and label space of a probe.

    Hidden-state indices follow transformers: ``0`` is the embedding output,
    ``i`` the output of decoder layer ``i``, ``num_layers`` the last layer.

    A probe has one head (``task`` over ``labels``) or several named ``heads`` over one
    shared token pooling and layer mix. With heads, ``labels`` is every head's labels in
    head order (filled in when omitted) and ``task`` is the flat view, ``"multilabel"``:
    one probability per label, where a multiclass head's labels sum to one. A training
    row may annotate only some heads; the others are unknown, never negative.

    >>> spec = ProbeSpec(name="mod", token_pool="mean", layer_mix="scalar_mix", layers=[1],
    ...     hidden_size=8, heads=[HeadSpec(name="toxicity", task="multilabel", labels=["toxic"]),
    ...     HeadSpec(name="sentiment", task="multiclass", labels=["neg", "pos"])])
    >>> spec.labels, spec.task, spec.head_of("pos").name
    (['toxic', 'neg', 'pos'], 'multilabel', 'sentiment')
    """

    schema_version: Literal[1] = 1
    name: ProbeName
    token_pool: TokenPool
    layer_mix: LayerMix
    layers: Annotated[list[Annotated[int, Field(ge=0, le=1024)]], Field(min_length=1)]
    hidden_size: Annotated[int, Field(ge=1, le=65536)]
    task: Task
    labels: Annotated[list[LabelName], Field(min_length=1, max_length=1024)]
    # Labels whose prediction makes the verdict "flag" (e.g. ["toxic"]).
    flag_labels: list[LabelName] = Field(default_factory=list)
    # Per-label decision thresholds (multi-label) or on the flag labels' score.
    thresholds: dict[LabelName, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(
        default_factory=dict
    )
    # Downcast multi-head attention (token_pool="mha").
    d_inner: Annotated[int, Field(ge=1, le=8192)] = 64
    num_heads: Annotated[int, Field(ge=1, le=64)] = 4
    layer_norm: bool = True
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    # Named heads over the shared pooling and mix (empty: one head, ``task`` over ``labels``).
    heads: Annotated[list[HeadSpec], Field(max_length=64)] = Field(default_factory=list)
    # An exit head at a shallow layer that decides easy messages early (None: no cascade).
    exit: ExitSpec | None = None
    # Per head (by name; a single-head probe's one head is named after the probe), the
    # calibration of its probabilities; a head not named here is uncalibrated.
    calibration: dict[ProbeName, HeadCalibration] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _flat_view_of_heads(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        heads = data.get("heads")
        if not isinstance(heads, list) or not heads:
            return data  # no heads, or garbage the field's own validation names
        dicts = [h.model_dump() if isinstance(h, HeadSpec) else h for h in heads]
        if "labels" not in data and all(
            isinstance(h, dict) and isinstance(h.get("labels"), list) for h in dicts
        ):
            data = {**data, "labels": [label for h in dicts for label in h["labels"]]}
        return {"task": "multilabel", **data}

    @model_serializer(mode="wrap")
    def _omit_no_heads(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # Single-head specs serialize exactly as before heads existed, so their signed
        # manifests and digests stay valid and older readers accept them.
        data: dict[str, object] = handler(self)
        if not data.get("heads"):
            data.pop("heads", None)
        if data.get("exit") is None:
            data.pop("exit", None)  # likewise for specs without an exit head
        if not data.get("calibration"):
            data.pop("calibration", None)  # and for uncalibrated ones
        return data

    @model_validator(mode="after")
    def _heads_consistent(self) -> ProbeSpec:
        if not self.heads:
            return self
        if self.task != "multilabel":
            raise ValueError("with heads, task is the flat view and must be 'multilabel'")
        names = [h.name for h in self.heads]
        if len(set(names)) != len(names):
            raise ValueError(f"head names must not repeat: {names}")
        if self.labels != [label for h in self.heads for label in h.labels]:
            raise ValueError("labels must be the heads' labels in head order")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> ProbeSpec:
        if sorted(set(self.layers)) != self.layers:
            raise ValueError("layers must be strictly increasing (sorted, no repeats)")
        if self.layer_mix == "single" and len(self.layers) != 1:
            raise ValueError("layer_mix 'single' reads exactly one layer")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels must not repeat")
        if self.task == "multiclass" and len(self.labels) < 2:
            raise ValueError("a multiclass probe needs at least two labels")
        unknown = (set(self.flag_labels) | set(self.thresholds)) - set(self.labels)
        if unknown:
            raise ValueError(f"flag_labels/thresholds name unknown labels: {sorted(unknown)}")
        if self.token_pool == "mha" and self.d_inner % self.num_heads:
            raise ValueError("d_inner must be divisible by num_heads")
        if self.exit is not None:
            if self.exit.layer not in self.layers or self.exit.layer >= self.deepest_layer:
                raise ValueError(
                    f"exit layer {self.exit.layer} must be one of the layers {self.layers} "
                    "below the deepest"
                )
            if not self.flag_labels:
                raise ValueError("an exit head decides on the flag labels: set flag_labels")
            if self.exit.bias is not None and len(self.exit.bias) != len(self.labels):
                raise ValueError(
                    f"the exit head's bias has {len(self.exit.bias)} values for "
                    f"{len(self.labels)} labels"
                )
        self._calibration_fits()
        return self

    def _calibration_fits(self) -> None:
        heads = {h.name: h for h in self.head_specs}
        for name, cal in self.calibration.items():
            if name not in heads:
                raise ValueError(f"calibration names head {name!r}; the heads are {sorted(heads)}")
            if len(cal.bias) != len(heads[name].labels):
                raise ValueError(
                    f"head {name!r}'s calibration has {len(cal.bias)} biases for "
                    f"{len(heads[name].labels)} labels"
                )

    @property
    def deepest_layer(self) -> int:
        return self.layers[-1]

    @property
    def head_specs(self) -> list[HeadSpec]:
        """The heads; a single-head probe has one, named after the probe."""
        if self.heads:
            return list(self.heads)
        return [HeadSpec(name=self.name, task=self.task, labels=list(self.labels))]

    def head(self, name: str) -> HeadSpec:
        """The head called ``name`` (a single-head probe's one head is the probe's name)."""
        for h in self.head_specs:
            if h.name == name:
                return h
        known = [h.name for h in self.head_specs]
        raise ValueError(f"probe {self.name!r} has no head {name!r}; its heads: {known}")

    def head_of(self, label: str) -> HeadSpec:
        """The head whose label space holds ``label``."""
        for h in self.head_specs:
            if label in h.labels:
                return h
        raise ValueError(f"probe {self.name!r} has no label {label!r}")

    def head_columns(self, name: str) -> slice:
        """Where head ``name``'s labels sit among ``labels`` (the probe's output columns)."""
        start = 0
        for h in self.head_specs:
            if h.name == name:
                return slice(start, start + len(h.labels))
            start += len(h.labels)
        self.head(name)  # raises, naming the heads
        raise AssertionError("unreachable")

    def head_view(self, name: str) -> ProbeSpec:
        """Head ``name`` as a single-head spec (its labels, task, flag labels, thresholds):
        what metrics, decisions and reports of one head run on."""
        h = self.head(name)
        if not self.heads:
            return self
        return self.model_copy(
            update={
                "name": h.name,
                "task": h.task,
                "labels": list(h.labels),
                "flag_labels": [x for x in self.flag_labels if x in h.labels],
                "thresholds": {k: v for k, v in self.thresholds.items() if k in h.labels},
                "heads": [],
                "exit": None,
                "calibration": {k: v for k, v in self.calibration.items() if k == h.name},
            }
        )

    def exit_view(self) -> ProbeSpec:
        """The exit head's own spec: this probe's heads and labels over its exit layer
        alone (``layer_mix="single"``); raises when there is no exit head."""
        if self.exit is None:
            raise ValueError(f"probe {self.name!r} has no exit head")
        return self.model_copy(
            update={
                "layers": [self.exit.layer],
                "layer_mix": "single",
                "token_pool": self.exit.token_pool,
                "exit": None,
                "calibration": {},  # the exit head's own is ExitSpec's
            }
        )
