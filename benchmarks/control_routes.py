"""CPU of one participant process's commit and restore at the scale benchmark's shape, through its real control routes.

``benchmarks/scale.py`` at 16,000 rollouts over two replica chains gives each environment, agent and
model server 8,000 episodes of a 16,000-id scope, and the one resources server all 16,000. This
script builds that one server in process (the wheel's real Gym server, wrapped and attached, as
``benchmarks/participants.py`` does), holds ``--episodes`` episodes shaped as a held second model
call leaves them, and sends the real ``prepare``, ``commit`` (scope: its own episodes plus
``--others`` it never saw) and, on a fresh server (a restarted process), ``restore`` of that scope
over the app's ASGI interface: body parsing, marks, export or read, encode or decode, hashing,
install, reply. No sockets, so the figures are the route's own CPU (``time.process_time``, every
thread), without the contention of seven servers on two cores.

    .venv/bin/python benchmarks/control_routes.py [--kinds agent,environment,model,resources]
        [--episodes 8000] [--others 8000] [--token-capture [--prompt-tokens 120]]
        [--second [--changed 0.0]] [--profile [--top 30]]

``--token-capture`` turns Gym's token capture on (its file store in the run's directory): each model
episode then holds one captured row (its first call, answered) that the commit exports and the restore
installs under the replacement attempt; the figures add the wall seconds (file creation is I/O).
``--prompt-tokens`` sets that row's prompt length (a real turn's prompt is thousands of tokens).

``--second`` commits again after the first commit's resume, into a sibling directory (the first
checkpoint's, ``-2``): an incremental checkpoint that refers to the records that did not change
(``Versioned`` ones, docs/protocol.md "Incremental checkpoints"), ``--changed`` of the episodes
changed in between (for the model with token capture: one more call captured and answered; for the
other kinds nothing is changed). Adds ``second_commit_s``, its wall seconds and ``second_written``
(the records it wrote itself); the restore still reads the first checkpoint.

``--profile`` prints a cProfile top-N (event loop thread only) of each route. Last line: one JSON
object ``{kind: {"commit_s", "restore_s", "exported", "restored"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import hashlib
import inspect
import io
import json
import pstats
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))
import participants  # noqa: E402  (a sibling script, not a package)

from nemo_gym_checkpoint_plugin._identity import episode_to_wire  # noqa: E402
from nemo_gym_checkpoint_plugin._wire import CONTROL_PREFIX  # noqa: E402

# The resources server holds every episode at the scale benchmark's 16,000 (one for all chains).
SHAPES = {"agent": (8000, 8000), "environment": (8000, 8000), "model": (8000, 8000), "resources": (16000, 0)}


async def _post(app: Any, route: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {participants._TOKEN}", "content-type": "application/json"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://participant", timeout=600
    ) as client:
        reply = await client.post(f"{CONTROL_PREFIX}/{route}", content=orjson.dumps(body), headers=headers)
    if reply.status_code != 200:
        raise RuntimeError(f"{route}: {reply.status_code} {reply.text[:300]}")
    return reply.json()


async def _timed(
    app: Any, route: str, body: dict[str, Any], profile: cProfile.Profile | None
) -> tuple[float, float, Any]:
    gc.collect()
    if profile is not None:
        profile.enable()
    started, wall = time.process_time(), time.perf_counter()
    reply = await _post(app, route, body)
    elapsed, wall = time.process_time() - started, time.perf_counter() - wall
    if profile is not None:
        profile.disable()
    return elapsed, wall, reply


def _capture_rows(server: Any, plugin: Any, ids: list[Any], prompt_tokens: int = 120) -> None:
    """A model call of each episode captured by Gym's store and answered (owned by this server)."""
    from nemo_gym.token_id_capture.records import TokenEntry

    store = plugin.captures.store
    for episode in ids:
        # Ids and digests as Gym makes them (uuid4 hex, sha256 hex), token ids of a real vocabulary's size.
        call_id = uuid.uuid4().hex
        store.append(
            TokenEntry(
                rollout_id=episode.capture_key,
                model_call_id=call_id,
                prompt_token_ids=[random.randrange(150_000) for _ in range(prompt_tokens)],
                generation_token_ids=[random.randrange(150_000) for _ in range(24)],
                generation_log_probs=[-random.random() for _ in range(24)],
                output_items=[{"type": "function_call", "name": "get_weather", "arguments": "{}", "call_id": "c"}],
                continuation_context_len=3,
                continuation_context_digest=hashlib.sha256(call_id.encode()).hexdigest(),
            )
        )
        plugin.book.delivered(episode.capture_key, call_id)


async def run_kind(
    kind: str,
    episodes: int,
    others: int,
    top: int | None,
    capture: bool = False,
    second: bool = False,
    changed: float = 0.0,
    prompt_tokens: int = 120,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        servers = participants.Servers(Path(directory), token_capture=capture)
        try:
            server, plugin = servers.build(kind)
            app = servers.last_app
            ids = participants.episodes(episodes)
            populate = {
                "agent": participants.populate_agent,
                "resources": participants.populate_resources,
                "environment": participants.populate_environment,
                "model": participants.populate_model,
            }[kind]
            done = populate(server, plugin, ids)
            if inspect.isawaitable(done):
                await done
            if capture and kind == "model":
                _capture_rows(server, plugin, ids, prompt_tokens)
            scope = [episode_to_wire(e) for e in ids]
            scope += [{"rollout_id": f"elsewhere-{i:06d}", "attempt": 0} for i in range(others)]
            checkpoint_dir = str(Path(directory) / "checkpoint")

            def deadline() -> float:
                return time.time() + 600

            await _post(app, "prepare", {"checkpoint_id": "c1", "deadline_ts": deadline()})
            profiles = {route: cProfile.Profile() if top else None for route in ("commit", "restore")}
            commit_s, commit_wall, committed = await _timed(
                app,
                "commit",
                {
                    "checkpoint_id": "c1",
                    "deadline_ts": deadline(),
                    "checkpoint_dir": checkpoint_dir,
                    "episode_ids": scope,
                },
                profiles["commit"],
            )
            await _post(app, "resume", {"checkpoint_id": "c1", "deadline_ts": deadline()})
            again: dict[str, Any] = {}
            if second:
                if capture and kind == "model" and changed > 0:
                    _capture_rows(server, plugin, ids[: round(len(ids) * changed)], prompt_tokens)
                await _post(app, "prepare", {"checkpoint_id": "c2", "deadline_ts": deadline()})
                second_s, second_wall, _reply = await _timed(
                    app,
                    "commit",
                    {
                        "checkpoint_id": "c2",
                        "deadline_ts": deadline(),
                        "checkpoint_dir": checkpoint_dir + "-2",
                        "episode_ids": scope,
                    },
                    None,
                )
                await _post(app, "resume", {"checkpoint_id": "c2", "deadline_ts": deadline()})
                manifest = next((Path(checkpoint_dir + "-2") / "gym").glob("*/*/manifest.json"))
                again = {
                    "second_commit_s": round(second_s, 3),
                    "second_commit_wall_s": round(second_wall, 3),
                    "second_written": orjson.loads(manifest.read_bytes())["record_count"],
                }
            servers.build(kind)  # a restarted process
            restore_s, restore_wall, restored = await _timed(
                servers.last_app,
                "restore",
                {
                    "checkpoint_id": "r1",
                    "deadline_ts": deadline(),
                    "checkpoint_dir": checkpoint_dir,
                    "episode_ids": scope,
                },
                profiles["restore"],
            )
            for route, profile in profiles.items():
                if profile is not None:
                    out = io.StringIO()
                    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
                    print(
                        f"--- cProfile {kind} {route} (event loop thread, by own time) ---\n{out.getvalue()}",
                        file=sys.stderr,
                        flush=True,
                    )
            return {
                "episodes": episodes,
                "scope": len(scope),
                "commit_s": round(commit_s, 3),
                "restore_s": round(restore_s, 3),
                "commit_wall_s": round(commit_wall, 3),
                "restore_wall_s": round(restore_wall, 3),
                "exported": len(committed["episode_ids"]),
                "restored": len(restored["restored"]),
                "token_capture": capture and kind == "model",
                **again,
            }
        finally:
            await servers.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(SHAPES))
    parser.add_argument(
        "--episodes", type=int, default=None, help="episodes held (default: the kind's share at 16,000)"
    )
    parser.add_argument(
        "--others",
        type=int,
        default=None,
        help="scope ids held elsewhere (default: the other replica's 8,000; 0 for resources)",
    )
    parser.add_argument(
        "--token-capture",
        action="store_true",
        help="Gym's token capture on: each model episode holds a captured row to export and install",
    )
    parser.add_argument("--prompt-tokens", type=int, default=120, help="prompt token ids per captured row")
    parser.add_argument(
        "--second", action="store_true", help="commit again into a sibling directory (an incremental checkpoint)"
    )
    parser.add_argument("--changed", type=float, default=0.0, help="share of episodes changed before --second")
    parser.add_argument("--profile", action="store_true", help="print a cProfile top-N of each route")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    print(
        f"{'kind':<12}{'episodes':>9}{'scope':>7}{'commit (CPU s)':>16}{'restore (CPU s)':>17}"
        f"{'commit (wall s)':>17}{'restore (wall s)':>18}"
    )
    for kind in args.kinds.split(","):
        if kind not in SHAPES:
            parser.error(f"unknown kind {kind!r}: one of {', '.join(SHAPES)}")
        episodes = args.episodes if args.episodes is not None else SHAPES[kind][0]
        others = args.others if args.others is not None else SHAPES[kind][1]
        figures[kind] = run = asyncio.run(
            run_kind(
                kind,
                episodes,
                others,
                args.top if args.profile else None,
                args.token_capture,
                args.second,
                args.changed,
                args.prompt_tokens,
            )
        )
        print(
            f"{kind:<12}{episodes:>9}{run['scope']:>7}{run['commit_s']:>16.3f}{run['restore_s']:>17.3f}"
            f"{run['commit_wall_s']:>17.3f}{run['restore_wall_s']:>18.3f}",
            flush=True,
        )
        if args.second:
            print(
                f"{'':<12}second commit: {run['second_commit_s']:.3f} CPU s, {run['second_commit_wall_s']:.3f} wall s, "
                f"{run['second_written']} records written",
                flush=True,
            )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
