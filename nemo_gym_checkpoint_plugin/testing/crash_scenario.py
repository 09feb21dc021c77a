"""Checkpoint rollouts in flight on a real Gym deployment, SIGKILL it, restore, and finish every rollout.

Shared by ``make demo`` (``demo.py``) and the process-level e2e test. The deployment is
this project's (``deployment.Deployment`` with every server wrapped, checkpointing on);
the controller side is the coordination library. ``run_scenario``:

1. holds, at the fake backend, the model call that ends each rollout's agent step (its
   step 1, the answer after the tool call), and sends every rollout's ``/run``;
   ``restart`` rollouts carry ``task_data: {"ng_checkpoint": "restart"}``, so the
   resources participant declares them restarts when they seed;
2. once every call is held, prepares (environment first) while those calls are still
   held: the agent records a boundary after each model and tool call, so a turn in flight
   blocks no step mode (the continued rollouts are exported inside their agent step, the
   agent's session holding the turn so far); restarts stay in flight through the checkpoint;
3. commits the continued rollouts (``PrepareResult.continued``), reads the counts the
   servers keep (seeds at the resources server, calls at the backend), then SIGKILLs
   every process group;
4. starts fresh processes, restores the checkpoint and resumes; retires the restarts
   (and any continued rollout the restore did not return), then sends ``/run`` for every
   rollout as its next attempt and waits for every reply: a continued rollout's turn goes
   on from its last boundary (its completed model call and tool call are not sent again).

Repeated steps are counted at the servers, never from the controller's belief: for a
continued rollout, any seed at the fresh resources server and any completed backend call
at a (conversation, step) it had completed before the crash is a step that ran twice.
Restarted rollouts start over by design (their steps run again as a new attempt).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .deployment import BACKEND, ENVIRONMENT, RESOURCES, Deployment, free_port_base, rollout_body
from .gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints

__all__ = ["ScenarioResult", "capture_dir", "new_deployment", "run_scenario", "run_body"]

RESTART_TASK_DATA = {"ng_checkpoint": "restart"}
_STATUS = "/ng-control/v1/checkpoint/status"
_POLL = 0.05


# uvicorn's worker health-check timeout in a deployment with several workers per server (new_deployment).
WORKER_HEALTHCHECK_SECONDS = 300


def start_timeout(num_workers: int) -> float:
    """How long a demo deployment may take to start: every worker imports Gym on its own."""
    return 120.0 if num_workers <= 1 else 120.0 + 60.0 * num_workers


def new_deployment(
    work_dir: Path,
    token: str,
    *,
    step_mode: str = "wait",
    port_base: int | None = None,
    model: dict[str, Any] | None = None,
    storage: dict[str, Any] | None = None,
    extra_env: dict[str, str] | None = None,
    num_workers: int = 1,
    token_capture: bool = False,
    gym_settings: dict[str, Any] | None = None,
) -> Deployment:
    """The demo deployment: every server wrapped (a participant), own process groups, logs in ``work_dir``.

    ``num_workers`` > 1 runs the model, resources and environment servers with that many uvicorn
    workers each (the agent stays single-worker: Gym's rule for agent sessions).

    ``token_capture`` turns Gym's training-token capture on for every agent: its local file store in
    ``capture_dir(work_dir)``, the model asked for token ids (``return_token_id_information``) and
    ``rebuild_response: false`` (the collection leaves the rows to the trainer, which rebuilds them with
    ``trajectories_for_rollout``).

    ``port_base`` None picks free ports; ``model`` adds keys to the policy model's config block;
    ``storage`` is the ``checkpoint.storage`` block (``{"backend": "fsspec"}`` for an object store);
    ``extra_env`` reaches every server (an object store's standard variables, e.g. ``AWS_*``);
    ``gym_settings`` are top-level Gym settings (e.g. ``token_id_capture``).
    """
    block: dict[str, Any] = {**DEFAULT_CHECKPOINT_BLOCK, "step_mode": step_mode}
    if storage:
        block["storage"] = dict(storage)
    workers = {"num_workers": num_workers} if num_workers > 1 else {}
    # uvicorn kills a worker that has not answered its health ping within this many seconds, and a
    # spawned worker answers only once it imported Gym: a dozen of them starting on two cores need more
    # than Gym's default 30 s.
    settings: dict[str, Any] = {"uvicorn_timeout_worker_healthcheck": WORKER_HEALTHCHECK_SECONDS} if workers else {}
    if token_capture:
        capture = {"enabled": True, "all_agents": True, "dir": str(capture_dir(work_dir)), "rebuild_response": False}
        settings["token_id_capture"] = capture
        model = {**(model or {}), "return_token_id_information": True}
    settings.update(gym_settings or {})
    deployment = Deployment(
        free_port_base() if port_base is None else port_base,
        work_dir,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=work_dir / "logs",
        extra_env={**(extra_env or {}), TOKEN_ENV: token},
        checkpoint=block,
        model={**(model or {}), **workers} or None,
        resources=workers or None,
        environment=workers or None,
        gym_settings=settings or None,
    )
    deployment.start_timeout = start_timeout(num_workers)
    return deployment


def capture_dir(work_dir: Path) -> Path:
    """Gym's capture directory of a ``new_deployment(work_dir, ..., token_capture=True)``."""
    return Path(work_dir) / "captures"


def run_body(rollout_id: str, attempt: int = 0, *, restart: bool = False) -> dict[str, Any]:
    body = rollout_body(rollout_id, attempt=attempt)
    if restart:
        body["task"]["task_input"]["task_data"] = dict(RESTART_TASK_DATA)
    return body


@dataclass
class ScenarioResult:
    """What happened, as counted by the servers; ``summary()`` is the demo's JSON line."""

    rollouts: list[str]
    continued: list[str]
    restarted: list[str]
    replies: dict[str, dict[str, Any]]
    checkpoint_dir: str
    prepare: dict[str, Any]
    blocked_before_release: int
    commit_boundaries: dict[str, int]
    seeds_before: dict[str, int]
    seeds_after: dict[str, int]
    completed_before: dict[str, dict[str, int]]
    calls_after: dict[str, dict[str, int]]
    completed_after: dict[str, dict[str, int]]
    restored: list[str]
    details: dict[str, Any] = field(default_factory=dict)

    def conversation(self, rollout_id: str) -> str:
        return rollout_body(rollout_id)["task"]["task_input"]["responses_create_params"]["input"][1]["content"]

    def repeated_steps(self) -> int:
        """Steps of continued rollouts that ran again after the crash, counted at the servers."""
        repeated = 0
        for rollout in self.continued:
            repeated += self.seeds_after.get(rollout, 0)
            before = self.completed_before.get(self.conversation(rollout), {})
            after = self.completed_after.get(self.conversation(rollout), {})
            repeated += sum(min(n, before.get(step, 0)) for step, n in after.items())
        return repeated

    def finished(self) -> list[str]:
        return [r for r, reply in self.replies.items() if reply.get("failure") is None and reply.get("result")]

    def summary(self) -> dict[str, Any]:
        finished = self.finished()
        return {
            "rollouts": len(self.rollouts),
            "finished": len(finished),
            "reward_1": sum(1 for r in finished if self.replies[r]["result"].get("reward") == 1.0),
            "continued": len(self.continued),
            "restarted": len(self.restarted),
            "lost": len(self.rollouts) - len(finished),
            "repeated_steps": self.repeated_steps(),
            "checkpoint_dir": self.checkpoint_dir,
        }


async def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(_POLL)  # wait-ok: poll interval of a bounded wait on a condition


async def run_scenario(
    deployment: Deployment,
    checkpoint_dir: Path,
    token: str,
    continued: list[str],
    restarts: list[str],
    *,
    say: Callable[[str], None] = lambda _m: None,
    timeout: float = 120.0,
    step_mode: str = "wait",
    incremental: bool = False,
) -> ScenarioResult:
    """Run the scenario of the module docstring on a started ``deployment``; the deployment is left running.

    ``step_mode`` must be the deployment's; the scenario is the same in both (the agent step
    is captured by the agent mid-turn, so it blocks neither). ``incremental``: the checkpoint is
    resumed and a second one taken into ``<checkpoint_dir>-2`` (a sibling, nothing changed in
    between: it refers to the first one's records), and the restore reads that second one.
    """
    from ..coordination import commit, discover, prepare, restore, resume, retire

    urls = deployment.urls
    env, backend, resources = urls[ENVIRONMENT], urls[BACKEND], urls[RESOURCES]
    rollouts = [*continued, *restarts]
    auth = {"Authorization": f"Bearer {token}"}
    # aiohttp (a runtime dependency, Gym's own client), never through a proxy (trust_env stays False);
    # each connect and each wait for bytes is bounded by ``timeout``; a whole request is not.
    limits = aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)
    async with aiohttp.ClientSession(timeout=limits, raise_for_status=True) as http:

        async def call(method: str, url: str, **kwargs: Any) -> Any:
            async with http.request(method, url, **kwargs) as reply:
                return await reply.json()

        async def status(url: str) -> dict[str, Any]:
            return await call("GET", url + _STATUS, headers=auth)

        async def stats() -> dict[str, Any]:
            return await call("GET", backend + "/_fake/stats")

        async def run(rollout_id: str, attempt: int) -> dict[str, Any]:
            return await call("POST", env + "/run", json=run_body(rollout_id, attempt, restart=rollout_id in restarts))

        hold = {"match": "", "count": len(rollouts), "step": 1}
        await call("POST", backend + "/_fake/hold", json=hold)
        first = {r: asyncio.ensure_future(run(r, 0)) for r in rollouts}
        say(f"sent {len(rollouts)} rollouts; holding each one's last model call at the fake backend")
        await _wait(lambda: _held(stats, len(rollouts)), timeout, "every rollout's model call held")

        coordinator = await discover(deployment.config, token)
        async with coordinator:
            prepared = await prepare(coordinator, "demo-checkpoint", timeout=timeout)
            if not prepared.ready:
                raise RuntimeError(f"prepare did not become ready: {prepared.to_json()}")
            blocked = int(prepared.reports[ENVIRONMENT].get("blocker_count") or 0)
            held = (await stats())["held"]
            say(
                f"prepared ({step_mode} mode) while {held} model calls are still held at the backend: "
                f"agents park mid-turn, nothing waits for a generation ({len(restarts)} restarts never block)"
            )
            scope = prepared.continued(f"{r}" for r in rollouts)
            committed = await commit(coordinator, "demo-checkpoint", str(checkpoint_dir), scope, timeout=timeout)
            env_reply = committed.replies[ENVIRONMENT]
            say(
                f"committed {len(env_reply['episode_ids'])} episodes to {checkpoint_dir} "
                f"(boundaries {env_reply.get('boundaries')}); restarts {prepared.restarts()}"
            )
            if incremental:
                await resume(coordinator, "demo-checkpoint", timeout=timeout)
                checkpoint_dir = checkpoint_dir.with_name(checkpoint_dir.name + "-2")
                again = await prepare(coordinator, "demo-checkpoint-2", timeout=timeout)
                if not again.ready:
                    raise RuntimeError(f"the second prepare did not become ready: {again.to_json()}")
                await commit(coordinator, "demo-checkpoint-2", str(checkpoint_dir), scope, timeout=timeout)
                say(f"committed the same episodes again to {checkpoint_dir}, referring to the first checkpoint")
            seeds_before = (await status(resources))["seed_sessions_by_rollout"]
            completed_before = (await stats())["completed"]

        killed = deployment.process_groups
        deployment.kill()
        # Their replies are lost with the servers. A killed process resets its connections, but a host that
        # vanished (the multi-host test deletes its network namespace) never does: waiting for those calls
        # would wait out the whole read timeout. Stop them instead.
        for lost in first.values():
            lost.cancel()
        await asyncio.gather(*first.values(), return_exceptions=True)
        say(f"SIGKILLed {len(killed)} process groups ({', '.join(sorted(killed))}); starting fresh processes")
        await asyncio.to_thread(deployment.start)

        coordinator = await discover(deployment.config, token)
        async with coordinator:
            restored = await restore(coordinator, "demo-restore", str(checkpoint_dir), scope, timeout=timeout)
            await resume(coordinator, "demo-restore", timeout=timeout)
            restored_keys = list(restored.replies[ENVIRONMENT].get("restored") or [])
            back = {key.rsplit("-a", 1)[0] for key in restored_keys}
            restarted = [r for r in rollouts if r not in back]
            say(f"restored {len(restored_keys)} episodes as their next attempt; {len(restarted)} start over")
            if restarted:
                await retire(
                    coordinator, "demo-retire", [{"rollout_id": r, "attempt": 0} for r in restarted], timeout=timeout
                )
        second = await asyncio.gather(*(run(r, 1) for r in rollouts))
        replies = dict(zip(rollouts, second, strict=True))
        after = await stats()
        seeds_after = (await status(resources))["seed_sessions_by_rollout"]

    result = ScenarioResult(
        rollouts=rollouts,
        continued=[r for r in rollouts if r not in restarted],
        restarted=restarted,
        replies=replies,
        checkpoint_dir=str(checkpoint_dir),
        prepare=prepared.to_json(),
        blocked_before_release=blocked,
        commit_boundaries=dict(env_reply.get("boundaries") or {}),
        seeds_before=seeds_before,
        seeds_after=seeds_after,
        completed_before=completed_before,
        calls_after=after["calls"],
        completed_after=after["completed"],
        restored=restored_keys,
    )
    say(f"finished {len(result.finished())}/{len(rollouts)} rollouts")
    return result


async def _held(stats: Callable[[], Any], count: int) -> bool:
    return (await stats())["held"] >= count
