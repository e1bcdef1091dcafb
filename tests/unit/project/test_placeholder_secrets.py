"""The placeholder keys shipped in deploy/k8s/secret.yaml are refused: applied as shipped,
they would sign checkpoints (or session cookies) with a key anyone can read on GitHub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr, ValidationError

from worker.settings import Settings

SECRET = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "secret.yaml"


def shipped(name: str) -> str:
    return str(yaml.safe_load(SECRET.read_text())["stringData"][name])


def test_the_shipped_placeholder_hmac_key_is_refused() -> None:
    placeholder = shipped("PROBEGUARD_CHECKPOINT_HMAC_KEY")
    with pytest.raises(ValidationError, match="placeholder") as info:
        Settings(checkpoint_hmac_key=placeholder)
    assert placeholder not in str(info.value)  # a key is never echoed, even a placeholder


@pytest.mark.parametrize("field", ["checkpoint_hmac_key", "console_secret_key", "cache_key"])
@pytest.mark.parametrize("value", ["change-me-to-openssl-rand-hex-32", "CHANGEME-0123456789abcdef"])
def test_placeholder_keys_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match=f"{field}.*placeholder"):
        kw: dict[str, Any] = {field: SecretStr(value)}
        Settings(**kw)


def test_a_random_key_is_accepted() -> None:
    key = "3f9a1c0e7b2d4a6f8e1c3b5d7f9a0c2e"
    assert Settings(checkpoint_hmac_key=key, deployment_id="t").checkpoint_hmac_key is not None
