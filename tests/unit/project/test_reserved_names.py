"""Probe names cannot take the segments of deployment-wide keys: with a probe named
``text``, a message with id ``stages`` would have had its text written over that probe's
stage record (``P:text:stages``), breaking every scorer's stage read."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from worker.errors import ConfigError
from worker.settings import RESERVED_PROBE_NAMES, Settings
from worker.store.redis import Keys

PER_MESSAGE = ("text", "decided")


@pytest.mark.parametrize("name", ["text", "decided", "review", "review_budget", "console"])
def test_settings_refuse_a_probe_named_like_a_deployment_wide_key(name: str) -> None:
    with pytest.raises(ValidationError, match="reserved"):
        Settings(probes=f"toxicity,{name}")
    with pytest.raises(ValidationError, match="reserved"):
        Settings(probes="toxicity", train_probe=name)


def test_keys_refuse_a_reserved_probe_name() -> None:
    keys = Keys("P")
    with pytest.raises(ConfigError, match="reserved"):
        keys.stages("text")
    assert keys.stages("toxicity") == "P:toxicity:stages"


def _deployment_wide_segments() -> set[str]:
    """The first segment after the prefix of every key method that takes no probe."""
    keys = Keys("P")
    segments = set()
    for name, method in inspect.getmembers(keys, inspect.ismethod):
        params = list(inspect.signature(method).parameters)
        if name.startswith("_") or name == "pattern" or (params and params[0] == "probe"):
            continue
        key = method(*(["x"] * len(params)))
        segments.add(key.split(":")[1])
    return segments


def test_every_deployment_wide_key_segment_is_reserved() -> None:
    segments = _deployment_wide_segments()
    assert set(PER_MESSAGE) <= segments  # the introspection found the message keys
    assert segments <= RESERVED_PROBE_NAMES, segments - RESERVED_PROBE_NAMES


def test_the_probes_setting_documents_the_reserved_names() -> None:
    description = Settings.model_fields["probes"].description or ""
    for name in RESERVED_PROBE_NAMES:
        assert f"`{name}`" in description, name
