"""``inspect`` and ``verify``: read a checkpoint directory offline, without any server.

Both find the participants of ``<dir>/gym/<kind>/<instance>/``. ``inspect`` reads the
manifests (and, with ``episodes``, the capture keys of the records); ``verify`` checks
every manifest and records file with the storage package's reader (digest, count, every
record decoded with a valid ``episode_id``, no capture key twice, records file inside
the participant directory, only regular files read) and that all participants hold the
same checkpoint id. When the directory has a participants index (``gym/participants.json``)
every participant it lists must be there with the records digest it lists; without one,
``verify`` warns. Files a participant directory holds that no manifest references (left
by a crashed or aborted write) are warned about, never a failure. The directory may be a
path or an object-store URL (``s3://bucket/run/step-120``): both are read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._errors import InvalidCheckpointState
from .._storage import MANIFEST_NAME, capture_key_of, decode_line, load_manifest, read_checkpoint
from .._storage.index import index_problems, read_participants_index
from .._storage.layout import INDEX_NAME, MANIFEST_FIELDS
from .._storage.location import Location, child_dirs, is_dir, lexists, names, size
from .._storage.reader import iter_verified_lines

__all__ = ["ParticipantCheck", "find_participants", "inspect_checkpoint", "verify_checkpoint"]


@dataclass
class ParticipantCheck:
    """One participant directory: what its manifest says, and whether it verifies."""

    kind: str
    instance: str
    directory: Location
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
            "participant": self.name,
            "kind": self.kind,
            "instance": self.instance,
            "ok": self.ok,
            "problem": self.problem,
            "checkpoint_id": self.manifest.get("checkpoint_id"),
            "record_count": self.manifest.get("record_count"),
            "records_file": self.manifest.get("records_file"),
            "records_sha256": self.manifest.get("records_sha256"),
            "records_bytes": self.records_bytes,
            "extras": sorted(k for k in self.manifest if k not in MANIFEST_FIELDS),
            **({"episodes": self.episodes} if self.episodes is not None else {}),
        }


def find_participants(checkpoint_dir: Location) -> list[tuple[str, str, Location]]:
    """Every ``gym/<kind>/<instance>`` directory, sorted. ``FileNotFoundError`` when there is no ``gym/``."""
    root = checkpoint_dir / "gym"
    if not is_dir(root):
        raise FileNotFoundError(f"{checkpoint_dir} holds no gym/ directory: not a checkpoint directory")
    found = []
    for kind in child_dirs(root):
        for instance in child_dirs(root / kind):
            found.append((kind, instance, root / kind / instance))
    return found


def _records_size(directory: Location, manifest: dict[str, Any]) -> int | None:
    return size(directory / manifest["records_file"])


def inspect_checkpoint(checkpoint_dir: Location, *, episodes: bool = False) -> list[ParticipantCheck]:
    """Read every participant's manifest (cheap); with ``episodes``, list record capture keys too."""
    checks = []
    for kind, instance, directory in find_participants(checkpoint_dir):
        check = ParticipantCheck(kind, instance, directory)
        try:
            check.manifest = load_manifest(directory, kind=kind, instance=instance)
            check.records_bytes = _records_size(directory, check.manifest)
            if episodes:
                check.episodes = [
                    capture_key_of(decode_line(line)["episode_id"])
                    for line in iter_verified_lines(directory, check.manifest)
                ]
        except (InvalidCheckpointState, ValueError, KeyError, TypeError) as exc:
            check.ok, check.problem = False, str(exc)
        checks.append(check)
    return checks


def _unreferenced(checks: list[ParticipantCheck]) -> list[str]:
    """Files in participant directories that no manifest references (a dead writer's leftovers)."""
    found = []
    for check in checks:
        expected = {MANIFEST_NAME, check.manifest.get("records_file")}
        found += [
            f"{check.directory / name}: not referenced by any manifest (left by a crashed or aborted write?)"
            for name in names(check.directory)
            if name not in expected
        ]
    return found


def _check_index(checkpoint_dir: Location, checks: list[ParticipantCheck], warnings: list[str]) -> None:
    """Fail the participants the index lists and the directory lacks; warn when there is no index."""
    try:
        index = read_participants_index(checkpoint_dir)
    except InvalidCheckpointState as exc:
        checks.append(ParticipantCheck("(index)", INDEX_NAME, checkpoint_dir / "gym", ok=False, problem=exc.detail))
        return
    if index is None:
        warnings.append(
            f"{checkpoint_dir}: no gym/{INDEX_NAME} (written by another implementation?): cannot tell "
            "whether a whole participant is missing"
        )
        return
    by_name = {(c.kind, c.instance): c for c in checks}
    for kind, instance, problem in index_problems(checkpoint_dir, index):
        check = by_name.get((kind, instance))
        if check is None:
            checks.append(
                ParticipantCheck(kind, instance, checkpoint_dir / "gym" / kind / instance, ok=False, problem=problem)
            )
        elif check.ok:
            check.ok, check.problem = False, problem
    listed = {(e["kind"], e["instance"]) for e in index["participants"]}
    warnings += [
        f"{c.directory}: participant {c.name} is not listed in gym/{INDEX_NAME}"
        for c in checks
        if (c.kind, c.instance) not in listed and c.kind != "(index)"
    ]


def verify_checkpoint(checkpoint_dir: Location, warnings: list[str] | None = None) -> list[ParticipantCheck]:
    """Verify every participant fully (one streaming pass each, no record kept).

    ``warnings`` (when given) receives what does not fail the checkpoint: unreferenced files, a
    missing participants index, a participant the index does not list.
    """
    warnings = [] if warnings is None else warnings
    checks = []
    for kind, instance, directory in find_participants(checkpoint_dir):
        check = ParticipantCheck(kind, instance, directory)
        if not lexists(directory / MANIFEST_NAME) and not names(directory):
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
    warnings += _unreferenced([c for c in checks if c.ok])
    _check_index(checkpoint_dir, checks, warnings)
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
