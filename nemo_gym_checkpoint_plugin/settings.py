"""The global ``checkpoint:`` block of a Gym config, validated once at startup.

``checkpoint`` is a reserved top-level key of the Gym config. Gym's parser passes
it through untouched; servers read it from ``get_global_config_dict()``. The
block is strict (unknown keys refused) so that a typo fails before any server
serves. Keys (defaults in brackets):

- ``enabled`` [false]: when false, the plugin installs nothing at all.
- ``control_auth_token_env`` [unset]: name of the environment variable holding
  the bearer token. Preferred: Gym's head server serves the whole config
  unauthenticated, so a token written in the YAML is readable by anyone who can
  reach it.
- ``control_auth_token`` [unset]: the token itself, accepted for wire
  compatibility; logs a warning.
- ``lease_grace_seconds`` [600, > 0]: how long after a call's deadline the
  participant waits for the controller before resuming on its own.
- ``storage`` (plugin key): ``backend`` ["local"], the storage backend a
  plugin provides under that name (the built-in one writes to the local or a
  shared filesystem); ``max_record_bytes`` [67108864 (64 MiB), > 0], the
  largest encoded record (one records-file line) the built-in backend writes
  or reads: a bigger record fails the write naming its episode, a longer line
  fails the read without being read whole.
- ``step_mode`` (plugin key) ["wait"]: what an environment server does with an
  episode step in flight when a checkpoint closes admission: ``wait`` (the
  checkpoint waits for the step to finish) or ``replay`` (the step does not
  block; after a crash it runs again from the last boundary).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .storage.layout import DEFAULT_MAX_RECORD_BYTES

__all__ = [
    "CHECKPOINT_KEY",
    "CheckpointSettings",
    "SettingsError",
    "StorageSettings",
    "load_settings",
    "settings_from_global_config",
]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "checkpoint"


class SettingsError(ValueError):
    """The ``checkpoint:`` block is invalid; the server must not start. The message names the key."""


class StorageSettings(BaseModel):
    """Where checkpoint records go: a backend registered by a storage plugin."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(default="local", min_length=1)
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, gt=0)


class CheckpointSettings(BaseModel):
    """The validated ``checkpoint:`` block. ``token`` is resolved, never part of the model dump."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    control_auth_token: str | None = Field(default=None, repr=False)
    control_auth_token_env: str | None = Field(default=None, min_length=1)
    lease_grace_seconds: float = Field(default=600.0, gt=0)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    step_mode: Literal["wait", "replay"] = "wait"

    @field_validator("lease_grace_seconds")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number of seconds")
        return value

    @model_validator(mode="after")
    def _warn_plain_token(self) -> CheckpointSettings:
        if self.enabled and self.control_auth_token and not self.control_auth_token_env:
            logger.warning(
                "checkpoint.control_auth_token is written in the Gym config, which Gym's head server "
                "serves unauthenticated; set checkpoint.control_auth_token_env to the name of an "
                "environment variable holding the token instead"
            )
        return self

    def resolve_token(self, environ: Mapping[str, str] | None = None) -> str:
        """The bearer token: from ``control_auth_token_env`` first, else ``control_auth_token``.

        Raises ``SettingsError`` naming the key when neither resolves to a non-empty token.
        """
        env = os.environ if environ is None else environ
        if self.control_auth_token_env:
            value = env.get(self.control_auth_token_env, "")
            if value:
                return value
            if not self.control_auth_token:
                raise SettingsError(
                    f"checkpoint.control_auth_token_env names the environment variable "
                    f"{self.control_auth_token_env!r}, which is unset or empty: export the token there"
                )
        if self.control_auth_token:
            return self.control_auth_token
        raise SettingsError(
            "checkpoint.enabled is true but no token is configured: set checkpoint.control_auth_token_env "
            "to the name of an environment variable holding the token (or checkpoint.control_auth_token)"
        )


def _plain(value: Any) -> Any:
    """Turn an OmegaConf node (what Gym's global config is) into plain Python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with nemo-gym
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def settings_from_global_config(global_config: Mapping[str, Any] | None) -> CheckpointSettings:
    """Validate the ``checkpoint:`` block of a Gym global config (absent: disabled defaults)."""
    block = None if global_config is None else _plain(global_config).get(CHECKPOINT_KEY)
    if block is None:
        return CheckpointSettings()
    if not isinstance(block, Mapping):
        raise SettingsError(f"checkpoint: must be a mapping, got {type(block).__name__}")
    try:
        return CheckpointSettings.model_validate(dict(block))
    except ValidationError as exc:
        problems = "; ".join(
            f"checkpoint.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise SettingsError(f"invalid checkpoint: block: {problems}") from None


def load_settings(
    global_config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[CheckpointSettings, str | None]:
    """Validate the block and resolve the token; ``(settings, token or None when disabled)``.

    Without ``global_config`` this reads Gym's own (``get_global_config_dict()``).
    Raises ``SettingsError`` when the block is invalid or enabled without a token.
    """
    if global_config is None:
        from nemo_gym.global_config import get_global_config_dict

        global_config = get_global_config_dict()
    settings = settings_from_global_config(global_config)
    if not settings.enabled:
        return settings, None
    return settings, settings.resolve_token(environ)
