"""Wire contracts of probeguard: every Kafka message, probe specs, checkpoint manifests.

Pure pydantic v2 models, no I/O. Decode with ``Model.decode(raw_bytes, limits)``
(a thin wrapper over ``model_validate_json``); every failure is a
``pydantic.ValidationError`` that names the offending field.
"""

from schemas.base import WireModel, describe_error
from schemas.cache import (
    CacheEncryption,
    CacheManifest,
    CacheSource,
    LabeledText,
    StateDtype,
    SummaryKind,
)
from schemas.checkpoint import (
    CheckpointEvent,
    CheckpointManifest,
    EnsembleManifest,
    EnsembleMember,
    EventKind,
    LLMFingerprint,
    Stage,
    TrainingCounters,
)
from schemas.drift import DRIFT_BINS, DriftReference, DriftSnapshot
from schemas.limits import DEFAULT_LIMITS, Limits
from schemas.messages import (
    ChatMessage,
    DeadLetter,
    DeadLetterKind,
    HeadResult,
    HumanLabel,
    ProbeResult,
    ReviewRequest,
    ShadowResult,
    Verdict,
    utcnow,
)
from schemas.operating_point import OperatingPoint
from schemas.probe import (
    ExitSpec,
    HeadCalibration,
    HeadSpec,
    LayerMix,
    ProbeSpec,
    Task,
    TokenPool,
)
from schemas.rollout import DecidedRecord, ProbeDecision

__all__ = [
    "DEFAULT_LIMITS",
    "DRIFT_BINS",
    "CacheEncryption",
    "CacheManifest",
    "CacheSource",
    "ChatMessage",
    "CheckpointEvent",
    "CheckpointManifest",
    "DeadLetter",
    "DeadLetterKind",
    "DecidedRecord",
    "DriftReference",
    "DriftSnapshot",
    "EnsembleManifest",
    "EnsembleMember",
    "EventKind",
    "ExitSpec",
    "HeadCalibration",
    "HeadResult",
    "HeadSpec",
    "HumanLabel",
    "LLMFingerprint",
    "LabeledText",
    "LayerMix",
    "Limits",
    "OperatingPoint",
    "ProbeDecision",
    "ProbeResult",
    "ProbeSpec",
    "ReviewRequest",
    "ShadowResult",
    "Stage",
    "StateDtype",
    "SummaryKind",
    "Task",
    "TokenPool",
    "TrainingCounters",
    "Verdict",
    "WireModel",
    "describe_error",
    "utcnow",
]
