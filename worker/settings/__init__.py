"""The one settings object, and the only place that reads the environment.

Every field can be set with an environment variable ``PROBEGUARD_<FIELD>``
(case-insensitive), e.g. ``PROBEGUARD_KAFKA_BOOTSTRAP=broker:9092``. The
Redis URL also honours the conventional ``REDIS_URL``. Secrets are
``SecretStr`` and never appear in ``repr`` or logs.

``Settings`` is every section at once (:data:`SECTIONS`, one class per part of the system,
each in this package: ``transport``, ``llm``, ``roles``, ``learning``, ``web``). A part of
the code that needs one section types its argument with that section (``ServeSettings``,
``LLMSettings``): a ``Settings`` is one, and the type says which fields the code may read.
Each section checks its own fields; what spans sections is checked here.
"""

from __future__ import annotations

import os
from typing import Any, Final

from pydantic import TypeAdapter, ValidationError, model_validator

from schemas.messages import PROBE_NAME
from worker.settings.base import (
    DEFAULT_PROBE_NAME,
    LEGACY_PROBE_NAME,
    RESERVED_PROBE_NAMES,
    Section,
    StateDtypeSetting,
    deprecated,
)
from worker.settings.learning import RolloutSettings, UpdaterSettings
from worker.settings.llm import LLMSettings
from worker.settings.roles import CommonSettings, ScorerSettings
from worker.settings.transport import KafkaSettings, StoreSettings
from worker.settings.web import ConsoleSettings, GuardSettings, ServeSettings

__all__ = [
    "DEFAULTS",
    "DEFAULT_PROBE_NAME",
    "LEGACY_PROBE_NAME",
    "RESERVED_PROBE_NAMES",
    "SECTIONS",
    "CommonSettings",
    "ConsoleSettings",
    "GuardSettings",
    "KafkaSettings",
    "LLMSettings",
    "RolloutSettings",
    "ScorerSettings",
    "Section",
    "ServeSettings",
    "Settings",
    "StateDtypeSetting",
    "StoreSettings",
    "UpdaterSettings",
    "load_settings",
]

# The old boolean spelling of PROBEGUARD_ROLLOUT (Settings._fold_auto_live).
_AUTO_LIVE_ENV: Final = "PROBEGUARD_AUTO_LIVE"

# The sections in the order docs/configuration.md lists them.
SECTIONS: Final[tuple[type[Section], ...]] = (
    KafkaSettings,
    StoreSettings,
    LLMSettings,
    CommonSettings,
    ScorerSettings,
    UpdaterSettings,
    RolloutSettings,
    ConsoleSettings,
    ServeSettings,
    GuardSettings,
)


class Settings(
    GuardSettings,
    ServeSettings,
    ConsoleSettings,
    RolloutSettings,
    UpdaterSettings,
    ScorerSettings,
    CommonSettings,
    LLMSettings,
    StoreSettings,
    KafkaSettings,
):
    """probeguard configuration (frozen; build a new one to change it): every section."""

    @model_validator(mode="before")
    @classmethod
    def _fold_auto_live(cls, data: Any) -> Any:
        """``PROBEGUARD_AUTO_LIVE`` (or ``auto_live=``), the deprecated boolean spelling of
        ``rollout``: ``false`` is ``manual``, ``true`` ``auto_live``. An explicit ``rollout``
        wins. The environment is read here: the field is gone, so no source reads it."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "auto_live" in data:
            name, raw = "auto_live", data.pop("auto_live")
        else:
            found = [v for k, v in os.environ.items() if k.upper() == _AUTO_LIVE_ENV]
            if not found:
                return data
            name, raw = _AUTO_LIVE_ENV, found[0]
        try:
            value = TypeAdapter(bool).validate_python(raw)
        except ValidationError:
            raise ValueError(
                f"{name}={raw!r} is not a boolean; it is deprecated anyway: set "
                "PROBEGUARD_ROLLOUT=auto_live|canary|manual instead"
            ) from None
        mode = "auto_live" if value else "manual"
        explicit = data.get("rollout")
        if explicit is None:
            data["rollout"] = mode
            deprecated(
                f"{name} is deprecated: set PROBEGUARD_ROLLOUT={mode} instead "
                "(AUTO_LIVE=true is rollout auto_live, false is manual)"
            )
        elif explicit != mode:
            deprecated(
                f"{name}={str(value).lower()} (rollout {mode}) is ignored: PROBEGUARD_ROLLOUT="
                f"{explicit} wins; {name} is deprecated, remove it"
            )
        else:
            deprecated(f"{name} is deprecated and repeats PROBEGUARD_ROLLOUT: remove it")
        return data

    @model_validator(mode="after")
    def _probes_consistent(self) -> Settings:
        for name in [*self.probe_names, *([self.train_probe] if self.train_probe else [])]:
            if not PROBE_NAME.fullmatch(name):  # as the wire schema's ProbeName
                raise ValueError(
                    f"probe name {name[:64]!r} must match {PROBE_NAME.pattern} (lowercase "
                    "letters, digits, '_' and '-'; what every message on the wire allows)"
                )
            if name in RESERVED_PROBE_NAMES:
                raise ValueError(
                    f"probe name {name!r} is reserved (deployment-wide Redis keys use it: "
                    f"{', '.join(sorted(RESERVED_PROBE_NAMES))}); choose another name"
                )
        return self

    @property
    def probe_to_train(self) -> str:
        return self.train_probe or self.probe_names[0]


# Every default, without reading the environment (no validation runs: the defaults are
# valid). The slices with defaults of their own (`LearningConfig`, `Policy`,
# `EvidenceStore`) take them from here, so each default is stated once, in the sections.
DEFAULTS: Final[Settings] = Settings.model_construct()


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides winning."""
    return Settings(**overrides)  # type: ignore[arg-type]
