"""Per-episode cost of the built-in participants' hooks at N open episodes, in process.

Each participant plugin is the one the attachment registers on the wheel's real Gym server
(wrapped class, enabled ``checkpoint:`` block, ``setup_webserver``), and holds N episodes
shaped as a held second model call leaves them in ``benchmarks/scale.py``:

- agent (``simple_agent``): N open sessions seeded with a direct tool access under the
  rollout's prefix, activated once, each with a mid-turn journal (one model answer, one tool
  result) as a turn waiting on its second model call has;
- resources (``example_single_tool_call``): N session bindings;
- environment (``single_agent_turn``): N episodes at boundary ``seeded``, in the captured agent step,
  each with a running task;
- model (``policy_model``): N calls in flight, each with a running task (no token capture: nothing
  to export, so its restore hooks have nothing to do).

Timed, by calling the hookimpls directly (no HTTP, no storage): ``export`` (scope of all N) on
the populated server and ``retire_live``, its retire of all N (running tasks cancelled and awaited);
then on a fresh server (a restarted process) ``retire`` of the N
checkpointed attempts, ``install`` of the N exported records (JSON round-tripped, as a restore
reads them), ``restored_pending`` and ``delete_restored`` of the N replacements. Each hook runs
after a full collection with the garbage collector off (``--gc`` leaves it on: a collection of
the heap then lands in whichever hook is allocating when one is due). Times are this process's CPU
seconds (``time.process_time``: a machine shared with other work does not inflate them much; the
hooks run on one thread). Prints seconds
and microseconds per episode per hook per kind, a cProfile top-N with ``--profile``, and one
JSON object as its last line.

    .venv/bin/python benchmarks/participants.py [--episodes 16000] [--kinds agent,resources,...] [--repeat 3]
        [--profile] [--gc]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import cProfile
import gc
import hashlib
import inspect
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_checkpoint_plugin._identity import EpisodeId, episode_to_wire
from nemo_gym_checkpoint_plugin._types import ParticipantExport, RestoredRecord, plain_records
from nemo_gym_checkpoint_plugin.testing.gym_config import (
    AGENT,
    ENVIRONMENT,
    MODEL,
    RESOURCES,
    TOKEN_ENV,
    build_gym_config,
    server_location,
)

KINDS = {"agent": AGENT, "resources": RESOURCES, "environment": ENVIRONMENT, "model": MODEL}
KEEP_GC = False
HOOKS = ("export", "retire", "install", "restored_pending", "delete_restored", "retire_live")
_TOKEN = "participants-benchmark"


class Servers:
    """Builds the real Gym server of a kind, wrapped and attached, and returns its built-in participant."""

    def __init__(self, directory: Path, token_capture: bool = False) -> None:
        os.environ[TOKEN_ENV] = _TOKEN
        enabled = {"enabled": True, "control_auth_token_env": TOKEN_ENV}
        # With token capture: Gym's run-wide file store under the directory (the model participant carries it).
        capture = {"token_id_capture": {"enabled": True, "dir": str(directory / "captures")}} if token_capture else None
        self.config = build_gym_config(21000, directory, checkpoint=enabled, gym_settings=capture)
        self.controls: list[Any] = []

    def build(self, kind: str) -> tuple[Any, Any]:
        import importlib

        from nemo_gym.server_utils import BaseServerConfig, ServerClient
        from nemo_gym_checkpoint_plugin.builtin_participants.agent.open_sessions import SimpleAgentSessions
        from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode_book import EpisodeBook
        from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCalls
        from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import ResourcesSessions
        from omegaconf import OmegaConf

        from nemo_gym_checkpoint_plugin._attach import ATTACHMENT_STATE
        from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable, find_server_class

        name = KINDS[kind]
        server_type, implementation, inner = server_location(self.config, name)
        module = importlib.import_module(f"{server_type}.{implementation}.app")
        server_class = derive_checkpointable(find_server_class(module))
        config_cls = server_class.model_fields["config"].annotation
        head = BaseServerConfig(**self.config.head_server)
        client = ServerClient(head_server_config=head, global_config_dict=self.config)
        inner = OmegaConf.to_container(inner, resolve=True)
        server = server_class(config=config_cls.model_validate({**inner, "name": name}), server_client=client)
        app = server.setup_webserver()
        server.setup_liveness(app)
        control = getattr(app.state, ATTACHMENT_STATE).control
        self.controls.append(control)
        self.last_app = app
        wanted = {
            "agent": SimpleAgentSessions,
            "resources": ResourcesSessions,
            "environment": EpisodeBook,
            "model": ModelCalls,
        }[kind]
        (plugin,) = [p for p in control.pm.get_plugins() if isinstance(p, wanted)]
        return server, plugin

    async def aclose(self) -> None:
        for control in self.controls:
            await control.aclose()


def episodes(count: int) -> list[EpisodeId]:
    return [EpisodeId.model_construct(rollout_id=f"rollout-{index:06d}", attempt=0) for index in range(count)]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _model_answer(index: int) -> dict[str, Any]:
    """A first model answer of a tool-calling turn (what the journal keeps), about 1 KB."""
    return {
        "id": f"resp-{index}",
        "object": "response",
        "created_at": 1764590000,
        "model": "fake-model",
        "status": "completed",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "type": "reasoning",
                "id": f"rs-{index}",
                "summary": [{"type": "summary_text", "text": "Look it up. " * 8}],
            },
            {
                "type": "function_call",
                "id": f"fc-{index}",
                "call_id": f"call-{index}",
                "name": "get_weather",
                "arguments": json.dumps({"city": f"city-{index}"}),
                "status": "completed",
            },
        ],
        "usage": {"input_tokens": 120, "output_tokens": 40, "total_tokens": 160},
    }


async def populate_agent(server: Any, plugin: Any, ids: list[EpisodeId]) -> None:
    from nemo_gym.base_responses_api_agent import AgentSeedSessionRequest, _AgentSessionRecord
    from nemo_gym_checkpoint_plugin.builtin_participants.agent.turn_journal import Turn

    for episode in ids:
        session_id = f"agent-session-{episode.rollout_id}"
        seed = AgentSeedSessionRequest.model_validate(
            {
                "agent_session_id": session_id,
                "episode_id": episode_to_wire(episode),
                "task_id": {"taskset": "scale", "task_id": episode.rollout_id},
                "tool_accesses": [
                    {
                        "kind": "direct_http",
                        "name": "example_single_tool_call",
                        "required": True,
                        "base_url": f"http://127.0.0.1:21003/ng-rollout/{episode.capture_key}",
                        "cookies": {"session": f"cookie-{episode.rollout_id}"},
                    }
                ],
            }
        )
        record = _AgentSessionRecord(episode_id=seed.episode_id)
        record.state = await server._seed_agent_session_state(seed.model_copy(deep=True))
        record.state.activations = 1
        server._session_records[session_id] = record
        if hasattr(plugin, "remember_seed"):
            plugin.remember_seed(session_id)  # what the seed route's reply path does (agent/open_sessions.py)
        if plugin.turns is not None:
            tool_body = json.dumps({"city": f"city-{episode.rollout_id}", "weather": "sunny, 21 C"}).encode()
            plugin.turns.turns[session_id] = Turn(
                activation=1,
                request_sha256=_sha(f"turn-{session_id}"),
                cookies_before={"session": f"cookie-{episode.rollout_id}"},
                observations_before=None,
                calls=[
                    {
                        "call": "model",
                        "sha256": _sha(f"model-{session_id}"),
                        "body": base64.b64encode(json.dumps(_model_answer(len(ids))).encode()).decode(),
                        "cookies": {},
                    },
                    {
                        "call": "tool",
                        "sha256": _sha(f"tool-{session_id}"),
                        "status": 200,
                        "body": base64.b64encode(tool_body).decode(),
                        "cookies": {"session": "next"},
                    },
                ],
            )


def populate_resources(server: Any, plugin: Any, ids: list[EpisodeId]) -> None:
    from nemo_gym.episode_types import TaskId

    for episode in ids:
        server._session_episodes[f"resources-session-{episode.rollout_id}"] = (
            episode,
            TaskId(taskset="scale", task_id=episode.rollout_id),
        )


def populate_environment(server: Any, book: Any, ids: list[EpisodeId]) -> None:
    from nemo_gym_checkpoint_plugin.builtin_participants.environment.episode import Episode

    for episode in ids:
        state = {
            "resources_session_id": f"resources-session-{episode.rollout_id}",
            "resources_cookies": {"session": f"cookie-{episode.rollout_id}"},
            "agent_session_id": f"agent-session-{episode.rollout_id}",
            "agent_cookies": {"session": f"agent-cookie-{episode.rollout_id}"},
            "verify_replay": True,
            "agent_mid_turn": True,
        }
        running = Episode(episode, episode.capture_key, _forever(), boundary="seeded", state=state)
        running.step, running.step_captured = "agent", True
        book._episodes[episode.capture_key] = running


def populate_model(server: Any, calls: Any, ids: list[EpisodeId]) -> None:
    for episode in ids:
        call = calls.begin((episode.rollout_id, episode.attempt))
        call.task = _forever(lambda call=call: calls.end(call))  # a generation a retire cancels


def _forever(finally_: Callable[[], None] | None = None) -> asyncio.Task[None]:
    """A task that runs until cancelled (an episode's or a model call's), then runs ``finally_``."""

    task = asyncio.ensure_future(asyncio.Event().wait())
    if finally_ is not None:
        # A callback, not a finally: a task cancelled before it first ran never runs its body.
        task.add_done_callback(lambda _task: finally_())
    return task


async def _call(fn: Callable[..., Any], **kwargs: Any) -> Any:
    result = fn(**kwargs)
    return await result if inspect.isawaitable(result) else result


async def timed(fn: Callable[..., Any], profile: cProfile.Profile | None, **kwargs: Any) -> tuple[float, Any]:
    # The hook's own work: a full collection of this process's heap (Gym, two servers, N episodes) costs
    # seconds and lands in whichever hook allocates when it is due; --gc leaves the collector on.
    gc.collect()
    if not KEEP_GC:
        gc.disable()
    if profile is not None:
        profile.enable()
    started = time.process_time()
    result = await _call(fn, **kwargs)
    if isinstance(result, ParticipantExport):
        result = result.records
    if result is not None and not isinstance(result, list):
        result = list(result)  # an iterator export is consumed by the writer: its cost is the export's
    if isinstance(result, list):
        # Versioned records built, as a first (full) checkpoint's writer builds them: part of the export's cost.
        result = plain_records(result)
    elapsed = time.process_time() - started
    if profile is not None:
        profile.disable()
    gc.enable()
    return elapsed, result


async def run_kind(kind: str, count: int, directory: Path, profile: cProfile.Profile | None) -> dict[str, float]:
    servers = Servers(directory)
    try:
        ids = episodes(count)
        server, plugin = servers.build(kind)
        populate = {
            "agent": populate_agent,
            "resources": populate_resources,
            "environment": populate_environment,
            "model": populate_model,
        }[kind]
        done = populate(server, plugin, ids)
        if inspect.isawaitable(done):
            await done
        seconds: dict[str, float] = {}
        scope = frozenset(episode.capture_key for episode in ids)
        seconds["export"], exported = await timed(plugin.export, profile, checkpoint_id="ckpt-bench", scope=scope)
        exported = exported or []
        # As a restore reads them: decoded from JSON, with the checkpointed and replacement attempts.
        records = orjson.loads(orjson.dumps(exported))
        restored = []
        for record in records:
            checkpointed = EpisodeId.model_validate(record["episode_id"])
            replacement = EpisodeId(rollout_id=checkpointed.rollout_id, attempt=checkpointed.attempt + 1)
            restored.append(RestoredRecord(checkpointed, replacement, record))
        # The commit side's own retire (a controller retiring what it checkpointed): every episode held.
        seconds["retire_live"], _ = await timed(plugin.retire, profile, episode_ids=ids)
        fresh_server, fresh = servers.build(kind)
        checkpointed = [r.checkpointed for r in restored] or ids
        replacements = [r.replacement for r in restored]
        seconds["retire"], _ = await timed(fresh.retire, profile, episode_ids=checkpointed)
        install_args: dict[str, Any] = {"checkpoint_id": "ckpt-bench", "manifest": {}, "records": restored}
        if "scope" in inspect.signature(fresh.install).parameters:
            install_args["scope"] = replacements
        seconds["install"], _ = await timed(fresh.install, profile, **install_args)
        seconds["restored_pending"], pending = await timed(fresh.restored_pending, profile)
        seconds["delete_restored"], _ = await timed(fresh.delete_restored, profile, episode_ids=replacements)
        left = await _call(fresh.restored_pending)
        if len(pending or []) != len(restored) or left:
            raise AssertionError(f"{kind}: {len(pending or [])} pending of {len(restored)} installed, {len(left)} left")
        seconds["records"] = len(exported)
        return seconds
    finally:
        await servers.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=16_000)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--profile", action="store_true", help="print a cProfile top-N of the timed hooks per kind")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=1, help="runs per kind; the best time of each hook is kept")
    parser.add_argument("--gc", action="store_true", help="leave the garbage collector on while a hook runs")
    args = parser.parse_args()
    global KEEP_GC
    KEEP_GC = args.gc
    figures: dict[str, Any] = {"episodes": args.episodes, "kinds": {}}
    print(f"{'kind':<12}{'records':>8}" + "".join(f"{hook:>18}" for hook in HOOKS) + "   (CPU s, us/episode)")
    for kind in args.kinds.split(","):
        profile = cProfile.Profile() if args.profile else None
        seconds: dict[str, float] = {}
        for _ in range(max(1, args.repeat)):
            with tempfile.TemporaryDirectory() as directory:
                run = asyncio.run(run_kind(kind, args.episodes, Path(directory), profile))
            seconds = {k: min(v, seconds.get(k, v)) for k, v in run.items()}
        records = int(seconds.pop("records"))
        cells = "".join(f"{seconds[h]:>9.3f} {seconds[h] / args.episodes * 1e6:>7.1f}" for h in HOOKS)
        print(f"{kind:<12}{records:>8}{cells}", flush=True)
        figures["gc"] = args.gc
        figures["kinds"][kind] = {
            "records": records,
            **{h: round(seconds[h], 4) for h in HOOKS},
            "us_per_episode": {h: round(seconds[h] / args.episodes * 1e6, 1) for h in HOOKS},
        }
        if profile is not None:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"--- cProfile {kind} (hooks only, by own time) ---\n{out.getvalue()}", file=sys.stderr, flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
