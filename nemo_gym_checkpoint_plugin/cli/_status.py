"""``status`` (and ``status --watch``): every server's phase, checkpoint, lease and notes.

The table has six columns so it fits an 80-column terminal: NAME, KIND, PHASE,
CHECKPOINT, LEASE and NOTES (blockers, restarts, retired rollouts, an instance name
that differs from the server's name, why a server is not a participant). Everything
else (URLs, counts, the full reports) is in ``--json``. A failing server is one row
(phase ERROR) and its error is told once, on stderr; a token every server refuses is
one message naming where it was read from (see ``_failures.explain``).

``--watch [SECONDS]`` discovers and probes again every SECONDS (default 2) until
Ctrl-C: on a terminal the table is redrawn in place, otherwise each refresh is printed
after a time line (one JSON document per line with ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from rich.live import Live
from rich.text import Text

from ..coordination import ParticipantFailure, discover
from ._failures import UNAUTHORIZED, explain
from ._output import console, print_json, table
from ._where import Deployment

__all__ = ["run_status"]

DEPLOYMENT = "(deployment)"  # how discovery names a failure of the whole deployment
HEADERS = ["NAME", "KIND", "PHASE", "CHECKPOINT", "LEASE", "NOTES"]


def lease(value: Any) -> str | None:
    if not isinstance(value, int | float):
        return None
    return f"{value - time.time():+.0f}s"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _notes(name: str, status: dict[str, Any]) -> str | None:
    report = status.get("report") or {}
    notes = []
    instance = status.get("instance")
    if instance and instance != name:
        notes.append(f"instance {instance}")
    if report.get("blocker_count"):
        notes.append(_plural(int(report["blocker_count"]), "blocker"))
    if report.get("worker_blockers"):
        notes.append(_plural(len(report["worker_blockers"]), "worker blocker"))
    if report.get("restarts"):
        notes.append(_plural(len(report["restarts"]), "restart"))
    if status.get("owner"):
        notes.append(f"owned by {status['owner']} ({lease(status.get('owner_expires_at'))})")
    if status.get("retired_rollouts"):
        notes.append(f"{status['retired_rollouts']} retired")
    if status.get("restart_warning"):
        # The whole text (why, and which hooks to implement) is restart_warning in --json and the server's log.
        notes.append("every episode restarts (why: --json)")
    last = last_checkpoint(status)
    if last is not None:
        notes.append(last)
    return ", ".join(notes) or None


def _size(value: Any) -> str | None:
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    size = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return None


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def last_checkpoint(status: dict[str, Any], now: float | None = None) -> str | None:
    """``last checkpoint 3m ago, paused 1.2s, 4.1 MB`` from the ``last_checkpoint`` status field (docs/telemetry.md)."""
    last = status.get("last_checkpoint")
    if not isinstance(last, dict) or not isinstance(last.get("published_at"), int | float):
        return None
    parts = [f"last checkpoint {_age(max(0.0, (now or time.time()) - last['published_at']))} ago"]
    paused = last.get("paused_seconds")
    if isinstance(paused, int | float):
        parts.append(f"paused {paused:.1f}s")
    size = _size(last.get("size_bytes"))
    if size is not None:
        parts.append(size)
    return ", ".join(parts)


def pause_warnings(statuses: dict[str, dict[str, Any]], interval: float | None, share: float) -> list[str]:
    """A line per server whose last checkpoint paused it longer than ``share`` of ``interval`` (none without one)."""
    if interval is None:
        return []
    allowed = share * interval
    lines = []
    for name, status in sorted(statuses.items()):
        last = status.get("last_checkpoint")
        if not isinstance(last, dict):
            continue
        paused = last.get("paused_seconds")
        if isinstance(paused, int | float) and paused > allowed:
            lines.append(
                f"{name}: checkpoint {last.get('checkpoint_id')} paused it {paused:.1f}s, more than "
                f"{share:g} of the {interval:g}s interval ({allowed:.1f}s)"
            )
    return lines


async def _probe(args: argparse.Namespace, deployment: Deployment) -> tuple[dict[str, Any], list[str], int]:
    """One round: the JSON document, the error lines for stderr, and the exit status."""
    async with await discover(
        deployment.source, deployment.token, probe_timeout=args.probe_timeout, tries=args.tries, strict=False
    ) as coordinator:
        statuses, failed = await coordinator.status(timeout=args.probe_timeout * args.tries)
        failures: list[ParticipantFailure] = coordinator.failures + failed
        servers = (
            len(coordinator.participants)
            + len(coordinator.non_participants)
            + len({f.server for f in failures if f.server != DEPLOYMENT})
        )
        errors, shown = explain(failures, deployment, servers)
        document: dict[str, Any] = {
            "participants": [
                {"name": p.name, "url": p.url, **statuses[p.name]}
                for p in coordinator.participants
                if p.name in statuses
            ],
            "non_participants": [{"name": e.name, "url": e.url} for e in coordinator.non_participants],
            "failures": [f.to_json() for f in shown],  # a refused token's follow-on failure left out
        }
        rows: list[list[Any]] = []  # the table: a row per server, its columns as printed
        for participant in coordinator.participants:
            status = statuses.get(participant.name)
            if status is not None:
                rows.append(
                    [
                        participant.name,
                        status.get("kind"),
                        status.get("phase"),
                        status.get("checkpoint_id"),
                        lease(status.get("lease_expires_at")),
                        _notes(participant.name, status),
                    ]
                )
        rows += [
            [e.name, None, None, None, None, "not a participant (no checkpointing)"]
            for e in coordinator.non_participants
        ]
        found = coordinator.participants or coordinator.non_participants
        if found or any(f.code != UNAUTHORIZED for f in shown):
            # A deployment-wide failure is no server's row; a token every server refused needs no table.
            rows += [[f.server, None, "ERROR", None, None, f.code] for f in shown if f.server != DEPLOYMENT]
        document["table"] = rows
        warnings = pause_warnings(statuses, getattr(args, "interval", None), getattr(args, "max_pause_share", 0.1))
        if warnings:
            document["warnings"] = warnings
        return document, errors, 1 if failures else 0


def _render(document: dict[str, Any]) -> str:
    return table(HEADERS, document["table"], wrap=("NAME", "CHECKPOINT", "NOTES"))


def _public(document: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k != "table"}


async def run_status(args: argparse.Namespace, deployment: Deployment) -> int:
    if args.watch is None:
        document, errors, code = await _probe(args, deployment)
        if args.json:
            print_json(_public(document))
        else:
            if document["table"]:
                print(_render(document))
            for line in document.get("warnings", ()):
                print(f"warning: {line}", file=sys.stderr)
            for line in errors:
                print(f"error: {line}", file=sys.stderr)
        return code
    return await _watch(args, deployment)


async def _watch(args: argparse.Namespace, deployment: Deployment) -> int:
    """Refresh every ``args.watch`` seconds, ``args.count`` times (None: until Ctrl-C)."""
    code, done = 0, 0
    out = console(sys.stdout)
    live = Live(console=out, auto_refresh=False) if out.is_terminal and not args.json else None
    if live is not None:
        live.start()
    try:
        while args.count is None or done < args.count:
            if done:
                await asyncio.sleep(args.watch)  # the refresh interval the user asked for
            document, errors, code = await _probe(args, deployment)
            done += 1
            stamp = time.strftime("%H:%M:%S")
            if args.json:
                print_json({"time": time.time(), **_public(document)}, compact=True)
            elif live is not None:
                notes = [f"warning: {line}" for line in document.get("warnings", ())] + [f"error: {e}" for e in errors]
                body = _render(document) + "".join(f"\n{line}" for line in notes)
                live.update(Text.from_ansi(f"every {args.watch:g}s, Ctrl-C stops  {stamp}\n{body}"), refresh=True)
            else:
                print(f"-- {stamp} (every {args.watch:g}s, Ctrl-C stops)", flush=True)
                print(_render(document), flush=True)
                for line in document.get("warnings", ()):
                    print(f"warning: {line}", file=sys.stderr, flush=True)
                for line in errors:
                    print(f"error: {line}", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0  # Ctrl-C is how a watch ends
    finally:
        if live is not None:
            live.stop()
    return code
