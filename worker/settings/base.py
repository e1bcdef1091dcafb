"""What every settings section shares: the environment it reads, the types and names more
than one section uses, and the checks of a secret key."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "DEFAULT_PROBE_NAME",
    "LEGACY_PROBE_NAME",
    "RESERVED_PROBE_NAMES",
    "PositiveInt",
    "Section",
    "StateDtypeSetting",
    "check_key",
    "default_cache_dir",
    "deprecated",
]

# The first segments of the deployment-wide Redis keys (``P:text:{message_id}``, ...,
# worker/store/redis.py): per-probe keys are ``P:{probe}:...``, so a probe with one of
# these names would share keys with message ids (a message with id ``stages`` would
# overwrite probe ``text``'s stage record).
RESERVED_PROBE_NAMES: Final = frozenset(
    {"text", "decided", "review_budget", "review", "counted", "once", "console"}
)

# The probe a deployment serves unless PROBEGUARD_PROBES names others: the packaged
# multi-head default serves under it. It was `toxicity` (LEGACY_PROBE_NAME) while the
# default was one head; registries from then keep their versions under that name.
DEFAULT_PROBE_NAME: Final = "moderation"
LEGACY_PROBE_NAME: Final = "toxicity"

PositiveInt = Annotated[int, Field(ge=1)]
# ``Settings.state_dtype``: a storage dtype, or ``auto`` (resolved per model by
# worker.llm.precision.resolve_state_dtype).
StateDtypeSetting = Literal["auto", "float16", "bfloat16", "float32"]

# The package's logger (``worker.settings``): deprecations are logged under it.
log = logging.getLogger("worker.settings")


class Section(BaseSettings):
    """One section of the settings: its fields read ``PROBEGUARD_<FIELD>`` from the
    environment, like the whole ``Settings`` (which is every section at once)."""

    model_config = SettingsConfigDict(
        env_prefix="PROBEGUARD_",
        frozen=True,
        extra="ignore",
        case_sensitive=False,
        populate_by_name=True,
    )


@functools.cache
def deprecated(message: str) -> None:
    """Log ``message`` once per process: settings are built many times (each CLI command,
    each ``load_settings``), and one warning per start says it."""
    log.warning(message)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "probeguard"


def check_key(name: str, key: SecretStr | None) -> None:
    """A signing key is long enough and not a placeholder: deploy/k8s/secret.yaml ships
    ``change-me-…`` values, and applied as shipped they would sign with a public key."""
    if key is None:
        return
    value = key.get_secret_value()
    if len(value.encode()) < 16:
        raise ValueError(f"{name} must be at least 16 bytes")
    if "changeme" in "".join(c for c in value.lower() if c.isalnum()):
        raise ValueError(
            f"{name} is a placeholder (it contains 'change-me'): set a random key, "
            "e.g. `openssl rand -hex 32`"
        )
