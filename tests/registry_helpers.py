"""Build and publish small probes for tests."""

from __future__ import annotations

from worker.llm.tiny import publish_probe, toxicity_spec

__all__ = ["num", "publish_probe", "toxicity_spec"]


def num(value: object) -> float:
    """A number from an event's or decision's ``details`` (typed there as any JSON scalar)."""
    assert isinstance(value, int | float) and not isinstance(value, bool), value
    return float(value)
