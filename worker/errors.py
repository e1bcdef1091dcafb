"""Exception hierarchy of the running parts.

::

    ProbeguardError
    ├── ConfigError          settings that cannot work together
    ├── StackError           the embedded broker / Redis failed to start or died
    └── KafkaSetupError      topics could not be created or the broker is unreachable

Dependency errors are translated into these with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = ["ConfigError", "KafkaSetupError", "ProbeguardError", "StackError"]


class ProbeguardError(Exception):
    """Root of every error probeguard raises on purpose."""


class ConfigError(ProbeguardError):
    """Settings are missing or contradict each other."""


class StackError(ProbeguardError):
    """An embedded service could not be started or stopped."""


class KafkaSetupError(ProbeguardError):
    """Kafka topics or connections could not be set up."""
