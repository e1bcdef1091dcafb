"""Errors raised by the probe library.

::

    ProbeError                 anything wrong with a probe, its input or its data
    ├── CheckpointError        a checkpoint that is corrupt, tampered with or unreadable
    │   └── IncompatibleCheckpoint   a sound checkpoint for another LLM or architecture
    └── CacheError             a hidden-state cache that is missing, incomplete or mismatched

Messages name the offending value. Dependency errors (safetensors, pydantic)
are translated with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = ["CacheError", "CheckpointError", "IncompatibleCheckpoint", "ProbeError"]


class ProbeError(Exception):
    """Root of every error the probe library raises on purpose."""


class CheckpointError(ProbeError):
    """A checkpoint is corrupt, tampered with, or cannot be read."""


class IncompatibleCheckpoint(CheckpointError):
    """A well-formed checkpoint that does not fit this LLM or this probe."""


class CacheError(ProbeError):
    """A hidden-state cache is missing, incomplete, or does not match the request."""
