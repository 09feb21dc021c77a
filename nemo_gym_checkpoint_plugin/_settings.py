"""The global ``checkpoint:`` block of a Gym config, validated once at startup.

``checkpoint`` is a reserved top-level key of the Gym config. Gym's parser passes
it through untouched; servers read it from ``get_global_config_dict()``. The
block is strict (unknown keys refused, with a did-you-mean for a near miss) so
that a typo fails before any server serves. Keys (defaults in brackets):

- ``enabled`` [false]: when false, the plugin installs nothing at all.
- ``control_auth_token_env`` [unset]: name of the environment variable holding
  the bearer token. Preferred: Gym's head server serves the whole config
  unauthenticated, so a token written in the YAML is readable by anyone who can
  reach it. A value that is not a variable name (a token pasted there by
  mistake), or a variable that is unset, is refused without the value ever
  being repeated in a message or log.
- ``control_auth_token`` [unset]: the token itself, accepted for wire
  compatibility; logs a warning.

Either way the token must be at least ``TOKEN_MIN_LENGTH`` (16) characters of printable
ASCII without spaces (``check_token``): a server refuses to start otherwise, and the CLI
refuses such a token before it sends it. ASCII because the two sides must agree on the
bytes: an HTTP server decodes a header as Latin-1, so a non-ASCII token configured on a
server would never match what a client sends.
- ``lease_grace_seconds`` [600, > 0]: how long after a call's deadline the
  participant waits for the controller before resuming on its own.
- ``storage`` (plugin key): ``backend`` ["local"], the storage backend a
  plugin provides under that name (the built-in one writes to the local or a
  shared filesystem); ``max_record_bytes`` [67108864 (64 MiB), > 0], the
  largest encoded record (one records-file line) the built-in backend writes
  or reads: a bigger record fails the write naming its episode, a longer line
  fails the read without being read whole; ``spool_dir`` [the system's temporary
  directory], backend ``fsspec`` only: the absolute local directory where a records
  file is encoded before its upload to an object store (it needs room for the
  largest participant's records).
- ``step_mode`` (plugin key) ["wait"]: what an environment server does with an
  episode step in flight when a checkpoint closes admission: ``wait`` (the
  checkpoint waits for the step to finish) or ``replay`` (the step does not
  block; after a crash it runs again from the last boundary).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._storage.layout import DEFAULT_MAX_RECORD_BYTES

__all__ = [
    "CHECKPOINT_KEY",
    "CheckpointSettings",
    "SettingsError",
    "StorageSettings",
    "TOKEN_MIN_LENGTH",
    "TOKEN_RULE",
    "check_token",
    "load_settings",
    "settings_from_global_config",
    "token_problem",
]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "checkpoint"


# What a POSIX shell accepts as a variable name; anything else in control_auth_token_env is likely a token.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Long enough not to be guessed by a caller that can reach the control port; a guess costs a request.
TOKEN_MIN_LENGTH = 16
# Printable ASCII without the space (0x21-0x7e): the bytes a header carries the same way both ends decode it.
_TOKEN_CHARS = re.compile(r"[!-~]+")
TOKEN_RULE = f"at least {TOKEN_MIN_LENGTH} characters of printable ASCII, without spaces"


class SettingsError(ValueError):
    """The ``checkpoint:`` block is invalid; the server must not start. The message names the key.

    ``server`` is the config name of the server refusing to start, when known; the message then
    begins with it (``for_server`` adds it to an error raised before the name was at hand).
    """

    def __init__(self, message: str, *, server: str | None = None) -> None:
        self.detail = message
        self.server = server
        super().__init__(message if server is None else f"server {server!r}: {message}")

    def for_server(self, server: str | None) -> SettingsError:
        """This error naming ``server`` (itself when it already names one, or when ``server`` is unknown)."""
        if self.server is not None or not server:
            return self
        named = type(self).__new__(type(self))
        SettingsError.__init__(named, self.detail, server=server)
        named.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("detail", "server")})
        return named


class StorageSettings(BaseModel):
    """Where checkpoint records go: a backend registered by a storage plugin."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(default="local", min_length=1)
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, gt=0)
    spool_dir: str | None = Field(default=None, min_length=1)

    @field_validator("spool_dir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isabs(value):
            raise ValueError("must be an absolute directory (each server runs in its own working directory)")
        return value


class CheckpointSettings(BaseModel):
    """The validated ``checkpoint:`` block. ``token`` is resolved, never part of the model dump."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    control_auth_token: str | None = Field(default=None, repr=False)
    # repr=False: a token pasted here by mistake must not reach a log through the settings' repr.
    control_auth_token_env: str | None = Field(default=None, min_length=1, repr=False)
    lease_grace_seconds: float = Field(default=600.0, gt=0)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    step_mode: Literal["wait", "replay"] = "wait"

    @field_validator("lease_grace_seconds")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number of seconds")
        return value

    @field_validator("control_auth_token_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            # Never repeat the value: it is most likely the token itself.
            raise ValueError(
                "must be the name of an environment variable (letters, digits and underscores, not starting "
                "with a digit); the value given is not one and is not repeated here: if it is the token, "
                "export it in an environment variable and name that variable here"
            )
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

        Raises ``SettingsError`` naming the key when neither resolves to a non-empty token, or when
        the token does not follow the rule (``check_token``; the message names where it came from).
        """
        env = os.environ if environ is None else environ
        if self.control_auth_token_env:
            value = env.get(self.control_auth_token_env, "")
            if value:
                # The variable's name may be told here: it did resolve, so it is a name, not a pasted token.
                return check_token(
                    value, f"the variable {self.control_auth_token_env} (checkpoint.control_auth_token_env)"
                )
            if not self.control_auth_token:
                # The name is not repeated: a token that happens to look like a name may have been pasted there.
                raise SettingsError(
                    "checkpoint.control_auth_token_env names an environment variable that is unset or empty "
                    "(the name is not repeated here, in case it is the token itself): "
                    "export the token in the variable it names"
                )
        if self.control_auth_token:
            return check_token(self.control_auth_token, "checkpoint.control_auth_token")
        raise SettingsError(
            "checkpoint.enabled is true but no token is configured: set checkpoint.control_auth_token_env "
            "to the name of an environment variable holding the token (or checkpoint.control_auth_token)"
        )


def token_problem(token: str) -> str | None:
    """What is wrong with ``token`` in words that never repeat it (None: it follows the rule)."""
    if not _TOKEN_CHARS.fullmatch(token):
        # Neither the token nor the offending character is told: a log would then hold part of it.
        return f"holds a character outside printable ASCII or a space (the token must be {TOKEN_RULE})"
    if len(token) < TOKEN_MIN_LENGTH:
        return f"is {len(token)} characters long (the token must be {TOKEN_RULE})"
    return None


def check_token(token: str, source: str) -> str:
    """``token`` when it follows the rule; else ``SettingsError`` naming ``source`` and the rule, not the token."""
    problem = token_problem(token)
    if problem is not None:
        raise SettingsError(f"the control token from {source} {problem}")
    return token


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
        # Only the key and pydantic's message: the input itself (a pasted token?) is never echoed.
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise SettingsError(f"invalid checkpoint: block: {problems}") from None


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the block accepts at the mapping holding ``loc``'s last key."""
    model: Any = CheckpointSettings
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = getattr(field, "annotation", None) if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return []
    return list(model.model_fields)


def _problem(err: Any) -> str:
    loc = tuple(err["loc"])
    where = "checkpoint." + ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _known_keys(loc), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(_known_keys(loc))})"
        return f"{where}: unknown key{hint}"
    return f"{where}: {err['msg']}"


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
