"""``inspect`` and ``verify``: read a checkpoint directory offline, without any server.

Both find the participants of ``<dir>/gym/<kind>/<instance>/``. ``inspect`` reads the
manifests (and, with ``episodes``, the capture keys of the records); ``verify`` checks
every manifest and records file with the storage package's reader (digest, count, every
record decoded with a valid ``episode_id``, records file inside the participant
directory) and that all participants hold the same checkpoint id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidCheckpointState
from ..storage import MANIFEST_NAME, capture_key_of, decode_line, load_manifest, read_checkpoint
from ..storage.layout import EXACT_LINES, MANIFEST_FIELDS
from ..storage.reader import iter_verified_lines

__all__ = ["ParticipantCheck", "find_participants", "inspect_checkpoint", "verify_checkpoint"]


@dataclass
class ParticipantCheck:
    """One participant directory: what its manifest says, and whether it verifies."""

    kind: str
    instance: str
    directory: Path
    ok: bool = True
    problem: str | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    records_bytes: int | None = None
    episodes: list[str] | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.instance}"

    def to_json(self) -> dict[str, Any]:
        return {
            "participant": self.name, "kind": self.kind, "instance": self.instance, "ok": self.ok,
            "problem": self.problem, "checkpoint_id": self.manifest.get("checkpoint_id"),
            "record_count": self.manifest.get("record_count"), "records_file": self.manifest.get("records_file"),
            "records_sha256": self.manifest.get("records_sha256"), "records_bytes": self.records_bytes,
            # Participant extras; the storage's own bookkeeping key is not one.
            "extras": sorted(k for k in self.manifest if k not in MANIFEST_FIELDS and k != EXACT_LINES),
            **({"episodes": self.episodes} if self.episodes is not None else {}),
        }


def find_participants(checkpoint_dir: Path) -> list[tuple[str, str, Path]]:
    """Every ``gym/<kind>/<instance>`` directory, sorted. ``FileNotFoundError`` when there is no ``gym/``."""
    root = checkpoint_dir / "gym"
    if not root.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} holds no gym/ directory: not a checkpoint directory")
    found = []
    for kind_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for instance_dir in sorted(p for p in kind_dir.iterdir() if p.is_dir()):
            found.append((kind_dir.name, instance_dir.name, instance_dir))
    return found


def _records_size(directory: Path, manifest: dict[str, Any]) -> int | None:
    try:
        return (directory / manifest["records_file"]).stat().st_size
    except OSError:
        return None


def inspect_checkpoint(checkpoint_dir: Path, *, episodes: bool = False) -> list[ParticipantCheck]:
    """Read every participant's manifest (cheap); with ``episodes``, list record capture keys too."""
    checks = []
    for kind, instance, directory in find_participants(checkpoint_dir):
        check = ParticipantCheck(kind, instance, directory)
        try:
            check.manifest = load_manifest(directory, kind=kind, instance=instance)
            check.records_bytes = _records_size(directory, check.manifest)
            if episodes:
                check.episodes = [capture_key_of(decode_line(line)["episode_id"])
                                  for line in iter_verified_lines(directory, check.manifest)]
        except (InvalidCheckpointState, ValueError, KeyError, TypeError) as exc:
            check.ok, check.problem = False, str(exc)
        checks.append(check)
    return checks


def verify_checkpoint(checkpoint_dir: Path) -> list[ParticipantCheck]:
    """Verify every participant fully (one streaming pass each, no record kept)."""
    checks = []
    for kind, instance, directory in find_participants(checkpoint_dir):
        check = ParticipantCheck(kind, instance, directory)
        if not (directory / MANIFEST_NAME).exists() and not any(directory.iterdir()):
            check.ok, check.problem = False, f"{directory}: empty participant directory (no manifest.json)"
            checks.append(check)
            continue
        try:
            # An empty scope keeps no record in memory but still decodes and checks every one.
            restored = read_checkpoint(checkpoint_dir, kind, instance, scope=())
            check.manifest = restored.manifest
            check.records_bytes = _records_size(directory, restored.manifest)
        except InvalidCheckpointState as exc:
            check.ok, check.problem = False, exc.detail
        checks.append(check)
    ids = {c.manifest["checkpoint_id"] for c in checks if c.ok}
    if len(ids) > 1:
        for check in checks:
            if check.ok:
                check.ok = False
                check.problem = (
                    f"holds checkpoint {check.manifest['checkpoint_id']}, "
                    f"but the directory mixes {', '.join(sorted(ids))}"
                )
    return checks
