"""Exception hierarchy of the running parts.

::

    ProbeguardError
    ├── ConfigError          settings that cannot work together
    ├── StackError           the embedded broker / Redis failed to start or died
    ├── KafkaSetupError      topics could not be created or the broker is unreachable
    ├── ModelLoadError       the frozen LLM or its tokenizer could not be located or loaded
    ├── ExtractionError      a hidden-state extraction request cannot be served (bad layers)
    │   └── ExtractionInputError   one input item cannot be extracted (empty, not UTF-8, ...)
    ├── OfflineError         offline work (cache, fit, eval) failed: a bad data file, an
    │                        incomplete cache, a refused checkpoint (wraps probes.ProbeError)
    ├── ExplainError         `probeguard explain` cannot explain: an empty text, no live
    │                        version, no cached text for a message id
    ├── LensUnavailable      the model lacks what the logit lens needs (LM head, final norm)
    ├── TransientError       a dependency (e.g. Redis) is down: the batch loop rewinds the
    │   │                    batch and retries it after a backoff, never dead-letters it
    │   └── DeviceError      the accelerator failed (out of memory, a CUDA error): says
    │                        nothing about the inputs
    ├── RegistryError        the checkpoint registry refused an operation
    │   ├── UnknownVersion   the version was never published (or has been pruned)
    │   ├── Fenced           the writer's fencing token is not the lease holder's
    │   └── StagesChanged    a compare-and-set stage change found the pointers changed
    ├── RolloutError         an operator's stage change was refused: an incompatible or
    │                        rolled-back version, a canary already on trial, a concurrent
    │                        change
    └── ReviewError          a console reviewer's answer was refused: not their item (the
                             claim timed out), a label the probe does not have, nothing
                             left to undo

Dependency errors are translated into these with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DeviceError",
    "ExplainError",
    "ExtractionError",
    "ExtractionInputError",
    "Fenced",
    "KafkaSetupError",
    "LensUnavailable",
    "ModelLoadError",
    "OfflineError",
    "ProbeguardError",
    "RegistryError",
    "ReviewError",
    "RolloutError",
    "StackError",
    "StagesChanged",
    "TransientError",
    "UnknownVersion",
]


class ProbeguardError(Exception):
    """Root of every error probeguard raises on purpose."""


class ConfigError(ProbeguardError):
    """Settings are missing or contradict each other."""


class StackError(ProbeguardError):
    """An embedded service could not be started or stopped."""


class KafkaSetupError(ProbeguardError):
    """Kafka topics or connections could not be set up."""


class ModelLoadError(ProbeguardError):
    """The configured LLM (or its tokenizer, or its weights cache) could not be loaded."""


class ExtractionError(ProbeguardError):
    """A hidden-state request that no input could satisfy, e.g. a layer the model lacks."""


class ExtractionInputError(ExtractionError):
    """One input item cannot be extracted; the others in its batch are unaffected.

    ``kind`` is a short stable code for dead letters and metrics: ``not_text``,
    ``invalid_utf8``, ``invalid_unicode``, ``empty`` or ``failed``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class OfflineError(ProbeguardError):
    """Offline data, cache, training or evaluation failed; the message names the value."""


class ExplainError(ProbeguardError):
    """An explanation cannot be produced; the message says what is missing."""


class RolloutError(ProbeguardError):
    """A stage change was refused; the message says why and what to do instead."""


class LensUnavailable(ProbeguardError):
    """The loaded model lacks what the logit lens needs (an LM head, a final norm)."""


class TransientError(ProbeguardError):
    """Raised by a handler when a dependency is down (e.g. Redis): the batch is rewound
    and retried after a backoff, as often as it takes, and never dead-lettered.

    ``sticky``: only a restart of the process clears it (see :class:`DeviceError`)."""

    sticky = False


class DeviceError(TransientError):
    """The accelerator failed (out of memory, a CUDA error): the inputs are not at fault.

    A CUDA error other than out of memory (e.g. an illegal memory access) is ``sticky``:
    it persists until the process restarts. The loop retries the batch, and after
    ``device_faults_to_restart`` of them in a row the role fails ``/healthz`` so the
    orchestrator restarts it (and its partitions move to a healthy member)."""

    def __init__(self, message: str, *, sticky: bool = False) -> None:
        super().__init__(message)
        self.sticky = sticky


class RegistryError(ProbeguardError):
    """The registry refused an operation or holds something unusable."""


class UnknownVersion(RegistryError):
    """The version was never published (or has been pruned)."""


class Fenced(RegistryError):
    """The writer's fencing token is not the current lease holder's."""


class StagesChanged(RegistryError):
    """A compare-and-set stage change found the pointers changed since they were read."""


class ReviewError(ProbeguardError):
    """A review answer, skip or undo was refused; the message tells the reviewer why."""
