"""A live command's episode scope, checked against the checkpoint directory before any server is called.

``restore --all`` restores every episode the checkpoint holds, and a restore scope naming
an episode the checkpoint does not hold is refused: a participant restores only what its
records hold, so such a scope would otherwise "succeed" with nothing restored. The
episodes are read offline with the storage reader (every manifest, digest and record is
checked on the way), the union over all participants (an episode may be absent from some).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from .._errors import InvalidCheckpointState
from .._storage import capture_key_of, decode_line, load_manifest
from .._storage.location import Location, is_dir, location
from .._storage.objstore import is_url, normalize_url
from .._storage.reader import iter_verified_lines
from ._offline import find_participants
from ._where import UsageError

__all__ = ["CheckpointUnreadable", "checkpoint_episodes", "commit_all_scope", "read_episodes", "restore_scope"]


class CheckpointUnreadable(Exception):
    """The checkpoint directory does not verify, so its episodes cannot be listed: exit 1."""


def read_episodes(args: argparse.Namespace) -> list[str]:
    """Capture keys from ``--episode`` and ``--episodes-file`` (one key per line, ``#`` comments)."""
    keys = list(args.episode or ())
    if getattr(args, "episodes_file", None):
        try:
            text = Path(args.episodes_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"--episodes-file {args.episodes_file} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise UsageError(f"--episodes-file {args.episodes_file} cannot be read: {why}") from None
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    return keys


def dir_argument(value: str, option: str = "--dir") -> str:
    """A checkpoint directory as the servers receive it: an absolute path (resolved), or a URL
    (``s3://...``) normalized; ``UsageError`` for a URL that cannot name one (never repeating it:
    it may carry credentials)."""
    if is_url(value):
        try:
            return normalize_url(value)
        except ValueError as exc:
            raise UsageError(f"{option}: {exc}") from None
    return str(Path(value).resolve())


def existing_dir(path: str, option: str = "--dir") -> Location:
    """``path`` as a directory that exists (a URL: a prefix holding objects), else a ``UsageError``."""
    if is_url(path):
        where = location(dir_argument(path, option))
        if not is_dir(where):
            raise UsageError(f"{option} {where} holds nothing (no object under that prefix)")
        return where
    directory = Path(path)
    if not directory.exists():
        raise UsageError(f"{option} {path} does not exist")
    if not directory.is_dir():
        raise UsageError(f"{option} {path} is not a directory")
    return directory


def checkpoint_episodes(checkpoint_dir: Location) -> set[str]:
    """Every capture key some participant of the checkpoint holds (each participant fully verified)."""
    try:
        participants = find_participants(checkpoint_dir)
    except FileNotFoundError as exc:
        raise CheckpointUnreadable(str(exc)) from None
    if not participants:
        raise CheckpointUnreadable(f"{checkpoint_dir} holds no participant directories under gym/")
    keys: set[str] = set()
    problems = []
    for kind, instance, directory in participants:
        try:
            manifest = load_manifest(directory, kind=kind, instance=instance)
            # Exhausting the iterator checks count and digest before the keys are trusted.
            keys.update(
                capture_key_of(decode_line(line)["episode_id"]) for line in iter_verified_lines(directory, manifest)
            )
        except InvalidCheckpointState as exc:
            problems.append(f"{kind}/{instance}: {exc.detail}")
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{kind}/{instance}: a record has no valid episode_id ({exc})")
    if problems:
        raise CheckpointUnreadable(
            f"{checkpoint_dir} does not verify, so its episodes cannot be listed:\n  " + "\n  ".join(problems)
        )
    return keys


def _listing(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def restore_scope(args: argparse.Namespace) -> list[str]:
    """The checkpointed attempts ``restore`` names: ``--all``, or the given keys, each held by the checkpoint."""
    directory = existing_dir(args.dir)
    given = read_episodes(args)
    if args.all and given:
        raise UsageError("restore takes --all or --episode/--episodes-file, not both")
    if not args.all and not given:
        raise UsageError("restore needs its scope: --episode KEY (repeatable), --episodes-file, or --all")
    held = checkpoint_episodes(directory)
    if args.all:
        if not held:
            raise UsageError(f"the checkpoint in {args.dir} holds no episodes: nothing to restore")
        return sorted(held)
    missing = sorted({key for key in given if key not in held})
    if missing:
        raise UsageError(
            f"the checkpoint in {args.dir} does not hold {_listing(missing)}; it holds "
            f"{len(held)} episode(s): {_listing(sorted(held)) or 'none'} "
            f"(list them with: {shlex.join(['ng-checkpoint', 'inspect', args.dir, '--episodes'])})"
        )
    return list(dict.fromkeys(given))


def commit_all_scope(statuses: dict[str, dict[str, Any]]) -> tuple[list[str] | None, list[str]]:
    """``commit --all``'s scope from every participant's status: (scope, the restarts it leaves out).

    Everything each participant holds, minus every episode any participant reported as a
    restart (as ``PrepareResult.continued`` does for a controller): a ``null`` scope would let a
    participant that did not report an episode as a restart (an agent holding its session)
    write it while another (the environment) calls it a restart. Without restarts the scope
    is ``None`` (everything). With restarts the episodes are those the environments list in
    ``episode_keys`` (every episode they run or restored, by capture key): episodes live in
    the environment, and a commit may name episodes a participant never saw. When no
    environment lists them, the scope cannot be known: a ``UsageError`` asks for an explicit one.
    """
    restarts = sorted(
        {key for status in statuses.values() for key in ((status.get("report") or {}).get("restarts") or ())}
    )
    if not restarts:
        return None, []
    environments = {name: status for name, status in statuses.items() if status.get("kind") == "environment"}
    silent = sorted(name for name, status in environments.items() if not isinstance(status.get("episode_keys"), list))
    if not environments or silent:
        why = (
            f"environment participant(s) {', '.join(silent)} do not list their episodes"
            if silent
            else "no environment participant lists the episodes in flight"
        )
        raise UsageError(
            f"commit --all must leave out {len(restarts)} restart(s) ({_listing(restarts)}), but {why}: "
            "name the scope with --episode/--episodes-file (every episode to continue, without the restarts)"
        )
    held = {key for status in environments.values() for key in status["episode_keys"]}
    return sorted(held - set(restarts)), restarts
