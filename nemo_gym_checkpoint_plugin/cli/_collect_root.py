"""Whether a checkpoint root can be trusted: nobody but this user can change what it holds.

A root another user can write (a ``0777`` scratch directory) let that user symlink the next
checkpoint's directory to one of their own (and receive the whole checkpoint), or plant a forged,
self-consistent ``collect-999999-<run>`` that ``--resume`` would choose. ``untrusted`` says why a
root is not safe, in words, or None:

- the root (when it exists) must belong to this user (or to root) and be writable by nobody else
  (no group or other write bit);
- every directory above it must not let another user replace the entry below it: not writable by
  group or others, unless its sticky bit is set and that entry belongs to this user (or to root),
  as for ``/tmp``.

Symbolic links in the path are resolved first: the check is of the directories the servers write into.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["untrusted"]


def _trusted_owner(uid: int) -> bool:
    return uid in (os.getuid(), 0)


def _who(mode: int) -> str:
    who = [name for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user")) if mode & bit]
    return " and ".join(who)


def untrusted(root: Path) -> str | None:
    """Why ``root`` (absolute; it may not exist yet) could be changed by another user, else None."""
    real = Path(os.path.realpath(root))
    entry = real
    if real.exists():
        info = os.stat(real)
        if not _trusted_owner(info.st_uid):
            return f"{real} belongs to another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{real} is writable by {_who(info.st_mode)} (mode {stat.S_IMODE(info.st_mode):04o})"
    for parent in real.parents:
        info = os.stat(parent)
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            sticky = bool(info.st_mode & stat.S_ISVTX)
            below = os.lstat(entry) if os.path.lexists(entry) else None
            # Sticky (like /tmp): others may add entries, but not rename or remove this user's.
            if not (sticky and (below is None or _trusted_owner(below.st_uid))):
                return (
                    f"{parent} (above it) is writable by {_who(info.st_mode)} (mode "
                    f"{stat.S_IMODE(info.st_mode):04o}), so another user can replace {entry}"
                )
        entry = parent
    return None
