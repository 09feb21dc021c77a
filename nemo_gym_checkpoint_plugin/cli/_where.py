"""Which deployment a live command talks to, with which token, and how to say the same again.

The deployment is ``--config GYM_YAML`` or ``--url URL`` (repeatable), else the Gym config
``NG_CHECKPOINT_CONFIG`` names, so that a command the CLI suggests (``ng-checkpoint resume
step-1``) works when pasted into a shell where that variable is set. The control token
comes, first match wins, from:

1. ``--token-file PATH`` or ``--token-env VAR`` (explicit; at most one of them);
2. the config's ``checkpoint.control_auth_token_env`` (its variable must be set);
3. ``NG_CHECKPOINT_TOKEN``.

A token that does not follow the servers' rule (``_settings.TOKEN_RULE``: 16 or more printable
ASCII characters, no spaces) is refused here, naming where it was read from: the servers would
refuse to start with it, so sending it could only earn a 401 that hides the cause.
The token itself is never printed: every message names where it was read from instead.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .._settings import SettingsError, token_problem
from ..coordination import load_config, token_from_config

__all__ = ["CONFIG_ENV", "TOKEN_ENV", "Deployment", "UsageError", "default_owner", "resolve_deployment", "suggest"]

CONFIG_ENV = "NG_CHECKPOINT_CONFIG"
TOKEN_ENV = "NG_CHECKPOINT_TOKEN"


class UsageError(Exception):
    """Bad command-line input the parser cannot see (a missing token, an empty scope): exit 2."""


@dataclass
class Deployment:
    """Where the servers are, the token and where it came from, the owner id this CLI sends, and the
    options that say all that again."""

    source: str | list[str]
    token: str = field(repr=False)
    token_source: str
    argv: list[str]
    owner: str = ""


def default_owner() -> str:
    """``cli-<user>@<host>``: the same for every command an operator runs, so prepare, commit and resume
    from separate shells are one owner."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    # Only the characters an owner id may hold (docs/protocol.md, "One controller per deployment").
    return re.sub(r"[^A-Za-z0-9._:@+-]", "-", f"cli-{user}@{socket.gethostname()}")[:200]


def _read_token_file(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise UsageError(f"--token-file {path} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"--token-file {path} is a directory, not a file holding the token") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise UsageError(f"--token-file {path} cannot be read: {why}") from None
    if not token:
        raise UsageError(f"--token-file {path} is empty")
    return token


def _load(path: str, named_by: str) -> dict[str, Any]:
    # "--config X does not exist" / "NG_CHECKPOINT_CONFIG names X, which does not exist"
    lead = f"{named_by} {path}" if named_by.startswith("-") else f"{named_by} names {path}, which"
    try:
        return load_config(path)
    except FileNotFoundError:
        raise UsageError(f"{lead} does not exist") from None
    except IsADirectoryError:
        raise UsageError(f"{lead} is a directory, not a Gym YAML file") from None
    except (OSError, yaml.YAMLError, ValueError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UsageError(f"{lead} is not a readable Gym config: {detail}") from None


def _checked(token: str, source: str) -> str:
    problem = token_problem(token)
    if problem is not None:
        raise UsageError(f"the control token from {source} {problem}")
    return token


def _token(args: argparse.Namespace, config: dict[str, Any] | None) -> tuple[str, str, list[str]]:
    """(token, where it came from in words, the options that name that source again)."""
    token, source, argv = _found_token(args, config)
    return _checked(token, source), source, argv


def _found_token(args: argparse.Namespace, config: dict[str, Any] | None) -> tuple[str, str, list[str]]:
    if args.token_file:
        path = str(Path(args.token_file).resolve())
        return _read_token_file(args.token_file), f"--token-file {path}", ["--token-file", path]
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise UsageError(f"--token-env names the variable {args.token_env}, which is unset or empty")
        return token, f"the variable {args.token_env} (--token-env)", ["--token-env", args.token_env]
    config_problem = None
    if config is not None:
        try:
            configured = token_from_config(config)
        except SettingsError as exc:
            config_problem = str(exc)
        else:
            if configured:
                env = (config.get("checkpoint") or {}).get("control_auth_token_env")
                where = (
                    f"the variable {env} (the config's checkpoint.control_auth_token_env)"
                    if env and os.environ.get(env) == configured
                    else "the config's checkpoint block"
                )
                return configured, where, []
    token = os.environ.get(TOKEN_ENV, "")
    if token:
        return token, f"the variable {TOKEN_ENV}", []
    if config_problem:
        raise UsageError(f"{config_problem} (or set {TOKEN_ENV}, or pass --token-file or --token-env)")
    raise UsageError(
        f"no control token: set {TOKEN_ENV}, pass --token-file PATH or --token-env VAR, "
        "or use a config whose checkpoint: block names the token's variable"
    )


def resolve_deployment(args: argparse.Namespace) -> Deployment:
    """The deployment and token of a live command; ``UsageError`` when either is missing."""
    config: dict[str, Any] | None = None
    if args.url:
        source: str | list[str] = list(args.url)
        argv = [part for url in args.url for part in ("--url", url)]
    elif args.config:
        source = str(Path(args.config).resolve())
        config = _load(args.config, "--config")
        argv = ["--config", source]
    elif os.environ.get(CONFIG_ENV):
        source = os.environ[CONFIG_ENV]
        config = _load(source, CONFIG_ENV)
        argv = []  # the variable names it again in the same shell
    else:
        raise UsageError(f"no deployment: pass --config GYM_YAML or --url URL, or set {CONFIG_ENV} to the Gym config")
    token, token_source, token_argv = _token(args, config)
    explicit = getattr(args, "owner", None)
    # A suggested command must name the same owner, or the deployment this CLI owns would refuse it.
    owner_argv = ["--owner", explicit] if explicit else []
    return Deployment(source, token, token_source, argv + token_argv + owner_argv, explicit or default_owner())


def suggest(command: str, deployment: Deployment | None, *extra: str) -> str:
    """A command line to paste: ``ng-checkpoint <command> <extra...> <the deployment's options>``."""
    words = ["ng-checkpoint", command, *extra, *(deployment.argv if deployment else ())]
    return shlex.join(words)
