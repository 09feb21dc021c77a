"""Random sequences of operations and crashes over a whole deployment of real participant processes.

A hypothesis rule-based state machine drives the demo deployment (``testing.crash_scenario``'s: the fake
backend and four Gym servers, every one a participant, uvicorn on 127.0.0.1, forked from the session's
zygote) through the public coordination library, and sends rollouts to the environment as Gym does.
``tests/test_control_stateful.py`` models one control plane's replies in process; this machine models
what a controller sees of a deployment: rollouts in flight (some held at the backend in their last model
call, some held in their verify step so a prepare is not ready by its deadline, some restarts), prepare,
commit (the in-flight scope, a scope naming a restart, retried with the same or other arguments), resume,
the lease expiring, renew, retire, forget, SIGKILL of one server or of all of them, restore (good, from a
corrupted copy, from a partial copy) into fresh processes, and a stale controller's late calls.

Invariants after every step (``check``): on every participant phase and admission agree (``status`` and
the ``gym_checkpoint_admission_closed`` gauge of its metrics); its retired marks are the model's; no
manifest appears in a directory after the resume of its checkpoint returned; every published checkpoint
verifies; no reply anywhere was a 500. At the end (``finish``) every rollout is driven to its end (a lost
attempt retired and sent again as the next one, a restored one continued): each finished exactly once,
and a rollout continued from a checkpoint that held it in its last model call ran neither its first
model call nor its seed again (counted at the backend and the resources server).

One sequence is one example; ``run_sequences`` (``tests/fuzz_processes.py``, ``make fuzz``) runs many
with their seeds, ``tests/test_deployment_stateful.py`` a few derandomized ones.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin.cli._offline import verify_checkpoint
from nemo_gym_checkpoint_plugin.coordination import (
    CoordinationError,
    commit,
    discover,
    forget,
    prepare,
    renew,
    restore,
    resume,
    retire,
)
from nemo_gym_checkpoint_plugin.testing.crash_scenario import run_body
from nemo_gym_checkpoint_plugin.testing.deployment import (
    BACKEND,
    ENVIRONMENT,
    GYM_SERVERS,
    RESOURCES,
    Deployment,
    free_port_base,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import DEFAULT_CHECKPOINT_BLOCK, TOKEN_ENV, wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import FakeBackend, wait_until_async

TOKEN = "deployment-machine-token"
VERIFY_SERVER = Path(__file__).with_name("fuzz_verify_server")
MAX_ROLLOUTS = 5
# Every control call's bound; with the grace below a checkpoint's lease ends at most 3 s after the last call.
CALL_SECONDS = 4.0
LEASE_GRACE = 1.5
SHORT_PREPARE = 0.4
_STATUS = "/ng-control/v1/checkpoint/status"
_METRICS = "/ng-control/v1/checkpoint/metrics"


def new_machine_deployment(work: Path) -> Deployment:
    """The demo deployment with a resources server whose verify steps a test can hold, a short lease grace."""
    return Deployment(
        free_port_base(),
        work,
        entrypoints=wrapped_entrypoints(),
        log_dir=work / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint={**DEFAULT_CHECKPOINT_BLOCK, "lease_grace_seconds": LEASE_GRACE},
        resources={"implementation": "fuzz_verify"},
        server_dirs={RESOURCES: VERIFY_SERVER},
    )


def _settled_files(directory: Path) -> list[tuple[str, int, int, int]] | None:
    """Every entry under ``directory``: its path, inode, size and modification time; None while one was
    written in the last second. A file's time comes from a coarse clock (a few ms): one written again in
    the same tick keeps it, but not one written a second after it last changed, so a settled listing
    changes with any later write."""
    found, newest = [], 0
    for root, dirs, files in os.walk(directory):
        for name in [*dirs, *files]:
            stat = os.lstat(os.path.join(root, name))
            found.append((os.path.join(root, name), stat.st_ino, stat.st_size, stat.st_mtime_ns))
            newest = max(newest, stat.st_mtime_ns)
    return sorted(found) if newest < time.time_ns() - 1_000_000_000 else None


def conversation(rollout_id: str) -> str:
    return f"what's it like in sf? (rollout {rollout_id})"


def key(rollout_id: str, attempt: int) -> str:
    return EpisodeId(rollout_id=rollout_id, attempt=attempt).capture_key


@dataclass
class Rollout:
    rollout_id: str
    restart: bool
    attempt: int = 0
    task: asyncio.Task[tuple[int | str, Any]] | None = None
    continues: str | None = None  # the checkpoint directory the current attempt continues from
    restored: int | None = None  # a replacement attempt a restore installed, not sent yet
    successes: list[int] = field(default_factory=list)
    outcomes: list[tuple[int, int | str]] = field(default_factory=list)
    held: str | None = None  # "model" or "verify" while the current attempt is held there
    # The resources server holds this rollout's verify steps (its hold outlives the attempt that asked for it).
    verify_hold: bool = False

    @property
    def done(self) -> bool:
        return bool(self.successes)


@dataclass
class Published:
    checkpoint_id: str
    written: list[str]  # the environment's capture keys
    held_in_step_1: set[str]  # rollouts whose attempt sat in its last model call (step 0 completed)


class DeploymentMachine(RuleBasedStateMachine):
    """One sequence on ``DeploymentMachine.deployment`` (a started ``Deployment``, set by the caller)."""

    deployment: Deployment
    work: Path
    sequence = 0
    # For seeded sequences (``seeded_machines``): crashes are likelier to meet a checkpoint worth restoring.
    WEIGHTS = {
        "start_rollout": 3.0,
        "commit_in_flight": 4.0,
        "restore_after_the_crash": 6.0,
        "send_next_attempt": 2.0,
        "kill_one_server": 0.6,
        "kill_every_server": 0.8,
        "lease_expires": 0.4,
    }

    def __init__(self) -> None:
        super().__init__()
        DeploymentMachine.sequence += 1
        self.dir = self.work / f"seq{DeploymentMachine.sequence}"
        self.dir.mkdir(parents=True)
        self.loop = asyncio.new_event_loop()
        self.rollouts: dict[str, Rollout] = {}
        self.published: dict[str, Published] = {}
        self.resumed: list[str] = []  # checkpoint ids resumed (by the controller or a lease)
        # The resumed ids every running server process saw resumed: a server remembers them in memory only
        # (PROTOCOL: the last 64), so one started since has forgotten the older ones and cannot fence them.
        self.fenced: list[str] = []
        self.unpublished: list[Path] = []  # directories of resumed checkpoints without a manifest
        self.open: str | None = None  # the checkpoint or restore id open on the deployment
        self.not_reached: set[str] = set()  # participants the open checkpoint's prepare never called
        self.prepared: Any = None  # the open checkpoint's PrepareResult once ready
        self.commits: dict[str, tuple[str, list[Any], dict[str, Any]]] = {}
        self.marks: dict[str, dict[str, int]] = {name: {} for name in GYM_SERVERS}
        self.fresh = True  # no server has served a data request since it started
        self.ids = 0
        self.errors_500: list[str] = []
        # When the last lease any call extended can end at the latest (time.time()): the call's reply plus
        # its timeout (the coordinator moves a deadline forward between stages, never past that) and the grace.
        self.lease_ends = 0.0
        # Each published checkpoint's files (path, inode, size, mtime) when it last verified: unchanged files
        # verify the same, so only a checkpoint whose files changed since is read again (``_settled_files``).
        self.verified: dict[str, list[tuple[str, int, int, int]]] = {}
        self.fake = FakeBackend(self.deployment.urls[BACKEND])
        self.run(self.fresh_servers())

    # -- plumbing ------------------------------------------------------------------------------------

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def new_id(self, prefix: str) -> str:
        self.ids += 1
        return f"{prefix}{self.ids}"

    async def fresh_servers(self, only: tuple[str, ...] = GYM_SERVERS) -> None:
        self.deployment.kill(only=only)
        await asyncio.to_thread(self.deployment.start, 60)
        self.http = getattr(self, "http", None) or aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None)
        )
        if only == GYM_SERVERS and not self.rollouts:
            await self.fake.reset()
        if hasattr(self, "coordinator"):
            await self.coordinator.close()
        self.coordinator = await discover(self.deployment.config, TOKEN)

    def teardown(self) -> None:
        try:
            self.run(self.release_verifies())
            self.run(self.fake.release())
            self.run(self.coordinator.close())
        finally:
            # Every task still on the loop (a /run of any attempt, not only each rollout's latest) is
            # cancelled and run to its end before the session closes, as asyncio.run does: a task left
            # pending would keep its connection acquired, and its garbage collection later (during
            # another test) warns of an unclosed connection.
            pending = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.run(asyncio.gather(*pending, return_exceptions=True))
            self.run(self.http.close())
            self.run(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def verify_route(self, action: str, body: dict[str, Any]) -> None:
        """``/health/test/<action>`` of the resources server that holds verify steps; a refusal raises.

        ``async with``: the reply is read and its connection released (an awaited ``post`` alone keeps it
        acquired until garbage collection, which warns of an unclosed connection in a later test).
        """
        async with self.http.post(self.deployment.urls[RESOURCES] + f"/health/test/{action}", json=body) as reply:
            await reply.read()
            assert reply.status == 200, f"/health/test/{action}: {reply.status}"

    async def release_verifies(self) -> None:
        await self.verify_route("release", {})
        for rollout in self.rollouts.values():
            rollout.verify_hold = False

    async def control(self, operation: Any, *args: Any, **kwargs: Any) -> tuple[Any, CoordinationError | None]:
        """One coordination call; a refusal is returned (and any 500 in it recorded), never raised."""
        kwargs.setdefault("timeout", CALL_SECONDS)
        try:
            return await operation(self.coordinator, *args, **kwargs), None
        except CoordinationError as exc:
            for failure in [*exc.failures, *exc.cleanup_failures]:
                if failure.status is not None and failure.status >= 500:
                    self.errors_500.append(failure.describe())
            return None, exc
        finally:
            self.lease_ends = max(self.lease_ends, time.time() + kwargs["timeout"] + LEASE_GRACE)

    def ok(self, outcome: tuple[Any, CoordinationError | None], what: str) -> Any:
        result, error = outcome
        assert error is None, f"{what}: {error}"
        return result

    def refused(self, outcome: tuple[Any, CoordinationError | None], code: str, what: str) -> None:
        _, error = outcome
        assert error is not None, f"{what}: expected {code}, it succeeded"
        assert set(error.codes.values()) == {code}, f"{what}: expected {code}: {error}"

    async def post_run(self, rollout: Rollout, attempt: int) -> tuple[int | str, Any]:
        # Any data request counts as served, a refused one too (docs/protocol.md): no restore after it
        # (seed 859512253: a retired attempt's /run, refused stale_attempt, then a restore).
        self.fresh = False
        try:
            async with self.http.post(
                self.deployment.urls[ENVIRONMENT] + "/run",
                json=run_body(rollout.rollout_id, attempt, restart=rollout.restart),
            ) as reply:
                body = await reply.json(content_type=None)
                if reply.status >= 500:
                    self.errors_500.append(f"/run {key(rollout.rollout_id, attempt)}: {reply.status} {body}")
                return reply.status, body
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return type(exc).__name__, str(exc)

    def send(self, rollout: Rollout, attempt: int, continues: str | None) -> None:
        rollout.attempt, rollout.continues, rollout.restored = attempt, continues, None
        rollout.task = self.loop.create_task(self.post_run(rollout, attempt))
        self.fresh = False  # already now: the task's request may not have started yet

    async def settle(self, rollout: Rollout, timeout: float = 30.0) -> None:
        """Await the current attempt's reply (it must come within ``timeout``); record it."""
        task = rollout.task
        if task is None:
            return
        try:
            status, body = await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise AssertionError(f"{key(rollout.rollout_id, rollout.attempt)}: no reply within {timeout}s") from None
        rollout.task = None
        rollout.held = None
        rollout.outcomes.append((rollout.attempt, status))
        if status == 200 and isinstance(body, dict) and body.get("failure") is None and body.get("result"):
            assert body["result"]["reward"] == 1.0, body
            rollout.successes.append(rollout.attempt)

    async def reap(self) -> None:
        """Record every reply that came already."""
        for rollout in self.rollouts.values():
            if rollout.task is not None and rollout.task.done():
                await self.settle(rollout)

    async def statuses(self) -> dict[str, dict[str, Any]]:
        replies, failures = await self.coordinator.status(timeout=CALL_SECONDS)
        assert not failures, failures
        return replies

    async def keep_alive(self) -> None:
        """A controller renews the open checkpoint's lease while it works (so only ``lease_expires`` ends it)."""
        if self.open is None:
            return
        _, error = await self.control(renew, self.open)
        if error is not None:
            # After a prepare that stopped at a stage not ready, the later stages were never called: idle.
            unreached = {f.server for f in error.failures if f.code == "invalid_phase"}
            assert set(error.codes) == unreached <= self.not_reached, f"renew: {error}"

    def pick(self, data: st.DataObject, which: Any) -> Rollout:
        chosen = sorted(r.rollout_id for r in self.rollouts.values() if which(r))
        return self.rollouts[data.draw(st.sampled_from(chosen), label="rollout")]

    def live(self) -> list[Rollout]:
        return [r for r in self.rollouts.values() if r.task is not None]

    def next_attempt(self, rollout: Rollout) -> int:
        return max([rollout.attempt, *(marks.get(rollout.rollout_id, -1) for marks in self.marks.values())]) + 1

    def mark(self, rollout_id: str, attempt: int, servers: tuple[str, ...] = GYM_SERVERS) -> None:
        for name in servers:
            self.marks[name][rollout_id] = max(self.marks[name].get(rollout_id, -1), attempt)

    # -- rollouts ------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.rollouts) < MAX_ROLLOUTS)
    @rule(hold=st.sampled_from(["none", "model", "model", "verify"]), restart=st.booleans())
    def start_rollout(self, hold: str, restart: bool) -> None:
        rollout = Rollout(f"r{len(self.rollouts)}", restart=restart and hold != "verify")
        self.rollouts[rollout.rollout_id] = rollout
        self.run(self.start(rollout, 0, hold, continues=None))

    async def start(self, rollout: Rollout, attempt: int, hold: str, continues: str | None) -> None:
        await self.keep_alive()
        if hold != "verify" and rollout.verify_hold:
            # The hold is per rollout: left from a retired attempt held at verify, it would hold this one too
            # (seeds 309263278 and 309263298 of the 1,000 run: a prepare not ready on an attempt sent "none").
            await self.verify_route("release", {"rollout_id": rollout.rollout_id})
            rollout.verify_hold = False
        if hold == "model":
            await self.fake.hold(f"(rollout {rollout.rollout_id})", 1, step=1)
        elif hold == "verify":
            await self.verify_route("hold", {"rollout_id": rollout.rollout_id})
            rollout.verify_hold = True
        self.send(rollout, attempt, continues)
        rollout.held = None if hold == "none" else hold
        if hold != "none" and self.open is None:
            await self.wait_held(rollout)  # parked at closed admission, it reaches its hold after the resume

    async def wait_held(self, rollout: Rollout) -> None:
        conv, capture = conversation(rollout.rollout_id), key(rollout.rollout_id, rollout.attempt)

        async def there() -> bool:
            if rollout.task is not None and rollout.task.done():
                return True  # it ended (a restored one may not reach the hold): settled below
            if rollout.held == "model":
                return any(
                    c["conversation"].endswith(conv) or conv in c["conversation"]
                    for c in (await self.fake.stats())["held_calls"]
                )
            async with self.http.get(self.deployment.urls[RESOURCES] + "/health/test/verify_calls") as reply:
                return (await reply.json()).get(capture, 0) > 0

        await wait_until_async(there, 30, f"{capture} held at its {rollout.held} step")
        if rollout.task is not None and rollout.task.done():
            await self.settle(rollout)

    @precondition(lambda self: any(r.held for r in self.rollouts.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        rollout = self.pick(data, lambda r: r.held)
        self.run(self.release_one(rollout))

    async def release_one(self, rollout: Rollout) -> None:
        await self.keep_alive()
        await self.fake.release(f"(rollout {rollout.rollout_id})")
        await self.verify_route("release", {"rollout_id": rollout.rollout_id})
        rollout.held, rollout.verify_hold = None, False
        if self.open is None:
            await self.settle(rollout)  # nothing parks it: its reply comes

    @precondition(lambda self: any(r.task is not None and r.held and self.open is None for r in self.rollouts.values()))
    @rule(data=st.data())
    def a_second_run_of_a_running_attempt(self, data: st.DataObject) -> None:
        """Sent twice (a retrying client, another controller): refused attempt_running, the first runs on."""
        rollout = self.pick(data, lambda r: r.task is not None and r.held)
        status, body = self.run(self.post_run(rollout, rollout.attempt))
        assert status == 409 and body["error"]["code"] == "attempt_running", (status, body)

    @precondition(lambda self: self.open is None and any(not r.done and r.task is None for r in self.rollouts.values()))
    @rule(data=st.data(), hold=st.sampled_from(["none", "model"]))
    def send_next_attempt(self, data: st.DataObject, hold: str) -> None:
        """A lost attempt is retired and sent again as the next one; a restored one is continued."""
        rollout = self.pick(data, lambda r: not r.done and r.task is None)
        self.run(self.next_of(rollout, hold))

    async def next_of(self, rollout: Rollout, hold: str) -> None:
        if rollout.restored is not None:
            await self.start(rollout, rollout.restored, hold, continues=rollout.continues)
            return
        if self.marks[ENVIRONMENT].get(rollout.rollout_id, -1) < rollout.attempt:
            self.ok(
                await self.control(retire, self.new_id("ret"), [key(rollout.rollout_id, rollout.attempt)]), "retire"
            )
            self.mark(rollout.rollout_id, rollout.attempt)
        await self.start(rollout, self.next_attempt(rollout), hold, continues=None)

    # -- the checkpoint path -------------------------------------------------------------------------

    @precondition(lambda self: self.open is None)
    @rule(short=st.booleans())
    def prepare_checkpoint(self, short: bool) -> None:
        self.do_prepare(self.new_id("ck"), short)

    @precondition(lambda self: self.open is not None and self.prepared is None and self.open.startswith("ck"))
    @rule(short=st.booleans())
    def prepare_again(self, short: bool) -> None:
        """A prepare not ready by its deadline, called again (its blockers may have cleared meanwhile)."""
        self.do_prepare(self.open, short)

    def do_prepare(self, checkpoint_id: str, short: bool) -> None:
        self.run(self.reap())
        result, error = self.run(self.control(prepare, checkpoint_id, timeout=SHORT_PREPARE if short else CALL_SECONDS))
        assert error is None, error
        # A reply that came while the prepare ran is recorded first: its rollout had ended before the prepare
        # reached the environment, so no participant reports it (seed 7032: a restart sent the step before).
        self.run(self.reap())
        self.open, self.prepared = checkpoint_id, result if result.ready else None
        self.not_reached = set(result.not_reached)
        blocked = {from_capture_key(k).rollout_id for k in result.blockers()}
        held_in_verify = {r.rollout_id for r in self.rollouts.values() if r.held == "verify" and r.task is not None}
        if not result.ready:
            # Only a verify step in flight keeps this deployment from being ready.
            assert blocked and blocked <= held_in_verify, result.to_json()
        else:
            # Every live restart is reported; a server may also still hold a restart's attempt that was lost
            # with another server (its /run failed, not yet retired): never a rollout that is not a restart.
            restarts = {from_capture_key(k).rollout_id for k in result.restarts()}
            assert {r.rollout_id for r in self.live() if r.restart} <= restarts, result.to_json()
            assert all(self.rollouts[r].restart for r in restarts if r in self.rollouts), result.to_json()

    def scope(self) -> list[str]:
        keys = [key(r.rollout_id, r.attempt) for r in self.live()]
        keys += [key(r.rollout_id, r.restored) for r in self.rollouts.values() if r.restored is not None]
        return keys

    @precondition(lambda self: self.prepared is not None and self.open not in self.commits)
    @rule()
    def commit_in_flight(self) -> None:
        self.run(self.reap())
        checkpoint_id = self.open
        directory = str(self.dir / checkpoint_id)
        scope = self.prepared.continued(self.scope())
        stats = self.run(self.fake.stats())
        result = self.ok(self.run(self.control(commit, checkpoint_id, directory, scope)), "commit")
        self.commits[checkpoint_id] = (directory, scope, result.manifests)
        held = {c["conversation"] for c in stats["held_calls"] if c["step"] == 1}
        written = list(result.replies[ENVIRONMENT]["episode_ids"])
        assert set(written) <= {k if isinstance(k, str) else key(k["rollout_id"], k["attempt"]) for k in self.scope()}
        self.published[directory] = Published(
            checkpoint_id,
            written,
            {
                from_capture_key(k).rollout_id
                for k in written
                if any(conversation(from_capture_key(k).rollout_id) in c for c in held)
            },
        )

    @precondition(
        lambda self: self.prepared is not None and self.open not in self.commits and bool(self.prepared.restarts())
    )
    @rule()
    def commit_naming_a_restart(self) -> None:
        scope = [*self.prepared.continued(self.scope()), *self.prepared.restarts()[:1]]
        directory = str(self.dir / f"{self.open}-restart")
        _, error = self.run(self.control(commit, self.open, directory, scope))
        # Refused where the restart was reported; a participant that never reported it (the model, the agent)
        # completed this commit, so the id is spent (any other scope is checkpoint_conflict there): resume.
        assert error is not None and "restart_in_scope" in error.codes.values(), error
        assert set(error.codes.values()) <= {"restart_in_scope"}, error
        self.ok(self.run(self.control(resume, self.open)), "resume")
        self.closed(self.open)

    @precondition(lambda self: self.open in self.commits)
    @rule(same=st.booleans())
    def commit_again(self, same: bool) -> None:
        directory, scope, manifests = self.commits[self.open]
        if same:
            result = self.ok(self.run(self.control(commit, self.open, directory, scope)), "retried commit")
            assert result.manifests == manifests, "a retried commit replied another manifest"
        else:
            other = str(self.dir / f"{self.open}-other")
            self.refused(self.run(self.control(commit, self.open, other, scope)), "checkpoint_conflict", "commit")

    @precondition(lambda self: self.open is not None)
    @rule()
    def resume_checkpoint(self) -> None:
        self.ok(self.run(self.control(resume, self.open)), "resume")
        self.closed(self.open)

    def closed(self, checkpoint_id: str, everywhere: bool = True) -> None:
        self.resumed.append(checkpoint_id)
        if everywhere:  # every running server saw it resumed (a controller's resume reaches them all)
            self.fenced.append(checkpoint_id)
        directory = self.dir / checkpoint_id
        if not any(directory.rglob("manifest.json")) if directory.exists() else True:
            self.unpublished.append(directory)
        self.open, self.prepared, self.not_reached = None, None, set()

    @precondition(lambda self: self.open is not None)
    @rule()
    def lease_expires(self) -> None:
        """The controller stops calling: every participant resumes on its own once its lease ends."""

        async def expired() -> None:
            async def idle() -> bool:
                return all(s["phase"] == "idle" for s in (await self.statuses()).values())

            bound = time.monotonic() + CALL_SECONDS + LEASE_GRACE + 5
            # Every lease ends by ``lease_ends``, hardly earlier: asking every participant every 50 ms until
            # then is CPU taken from the other lanes for nothing.
            await asyncio.sleep(max(0.0, self.lease_ends - time.time() - 0.2))  # wait-ok: a known point in time
            await wait_until_async(idle, max(0.0, bound - time.monotonic()), "every participant resumed by its lease")

        self.run(expired())
        # A lease resumes only the servers the prepare reached; one it never reached never saw the id
        # (seed 5057: the environment fenced it, the model, agent and resources did not know it).
        self.closed(self.open, everywhere=not self.not_reached)

    @precondition(lambda self: bool(self.resumed))
    @rule(data=st.data(), operation=st.sampled_from(["prepare", "renew", "commit", "resume"]))
    def a_stale_controllers_late_call(self, data: st.DataObject, operation: str) -> None:
        # Only an id every running server saw resumed is fenced everywhere (fence() checks it first, before
        # any active checkpoint); a server restarted since forgot it (seeds 5002-5016 of the first long run).
        # A late resume is idempotent on every server while idle, whether it remembers the id or not.
        pool = self.resumed if operation == "resume" and self.open is None else self.fenced
        if not pool:
            return
        checkpoint_id = data.draw(st.sampled_from(pool))
        if operation == "resume":
            replies = self.ok(self.run(self.control(resume, checkpoint_id)), "late resume")
            assert all(r["idempotent"] for r in replies.values()), replies
            return
        call = {"prepare": (prepare, checkpoint_id), "renew": (renew, checkpoint_id)}.get(
            operation, (commit, checkpoint_id, str(self.dir / f"{checkpoint_id}-late"), None)
        )
        self.refused(self.run(self.control(*call)), "stale_checkpoint", f"late {operation}")

    # -- retire and forget ---------------------------------------------------------------------------

    @precondition(lambda self: self.open is None and any(not r.done for r in self.rollouts.values()))
    @rule(data=st.data())
    def retire_rollout(self, data: st.DataObject) -> None:
        rollout = self.pick(data, lambda r: not r.done)
        self.run(self.retire_one(rollout))

    async def retire_one(self, rollout: Rollout) -> None:
        attempt = rollout.restored if rollout.restored is not None else rollout.attempt
        self.ok(await self.control(retire, self.new_id("ret"), [key(rollout.rollout_id, attempt)]), "retire")
        self.mark(rollout.rollout_id, attempt)
        rollout.restored = None
        await self.settle(rollout, timeout=10)  # its work stopped: the reply came (a success only if it ended first)
        # It never runs again until forgotten: the same attempt is refused at once.
        status, body = await self.post_run(rollout, attempt)
        assert status == 409 and body["error"]["code"] == "stale_attempt", (status, body)

    @precondition(lambda self: self.open is None and any(self.marks[ENVIRONMENT]))
    @rule(data=st.data())
    def forget_rollout(self, data: st.DataObject) -> None:
        rollout_id = data.draw(st.sampled_from(sorted(self.marks[ENVIRONMENT])))
        self.ok(self.run(self.control(forget, self.new_id("fgt"), [rollout_id])), "forget")
        for marks in self.marks.values():
            marks.pop(rollout_id, None)

    # -- crashes and restores ------------------------------------------------------------------------

    @rule(name=st.sampled_from(GYM_SERVERS))
    def kill_one_server(self, name: str) -> None:
        """SIGKILL one server and start it again; the controller resumes what was open."""
        self.run(self.kill_and_restart((name,)))

    @rule()
    def kill_every_server(self) -> None:
        self.run(self.kill_and_restart(GYM_SERVERS))
        self.fresh = True

    async def kill_and_restart(self, names: tuple[str, ...]) -> None:
        await self.fresh_servers(names)
        self.fenced.clear()  # the restarted processes remember no resumed id
        for name in names:
            self.marks[name] = {}
        if len(names) < len(GYM_SERVERS):
            self.fresh = False
        if self.open is not None:
            self.ok(await self.control(resume, self.open), "resume after a crash")
            self.closed(self.open)
        # Whatever an attempt was waiting on may have died with the server: each one still running ends.
        await self.release_all()
        for rollout in self.live():
            await self.settle(rollout)
        if names == GYM_SERVERS:
            for rollout in self.rollouts.values():
                rollout.restored = None  # installed in processes that are gone

    async def release_all(self) -> None:
        await self.fake.release()
        await self.release_verifies()
        for rollout in self.rollouts.values():
            rollout.held = None

    def restorable(self) -> list[str]:
        return sorted(directory for directory, published in self.published.items() if self.scope_of(published))

    def scope_of(self, published: Published) -> list[str]:
        """The keys of ``published`` a controller restores: each rollout's current attempt, not finished."""
        scope = []
        for capture in published.written:
            episode = from_capture_key(capture)
            rollout = self.rollouts[episode.rollout_id]
            if (
                not rollout.done
                and rollout.task is None
                and rollout.restored is None
                and episode.attempt == rollout.attempt
            ):
                scope.append(capture)
        return scope

    @precondition(lambda self: self.fresh and self.open is None and bool(self.restorable()))
    @rule(data=st.data(), damage=st.sampled_from(["none", "none", "corrupted", "partial"]))
    def restore_after_the_crash(self, data: st.DataObject, damage: str) -> None:
        directory = data.draw(st.sampled_from(self.restorable()))
        self.run(self.restore_from(directory, damage))

    async def restore_from(self, directory: str, damage: str) -> None:
        published = self.published[directory]
        scope = self.scope_of(published)
        restore_id = self.new_id("rs")
        source = Path(directory)
        if damage != "none":
            source = self.dir / f"{restore_id}-{damage}"
            shutil.copytree(directory, source)
            if damage == "corrupted":
                records = sorted(p for p in source.rglob("records-*") if p.stat().st_size > 0)
                data = bytearray(records[0].read_bytes())
                data[len(data) // 2] ^= 0x01
                records[0].write_bytes(bytes(data))
            else:
                (manifest,) = (source / "gym" / "environment").rglob("manifest.json")
                manifest.unlink()
        result, error = await self.control(restore, restore_id, str(source), scope)
        if damage == "partial":
            # A participant its index lists is missing: refused before any participant is asked
            # (Coordinator.restore), so nothing marks the scope (seed 309263148 of the 1,000 run) and no
            # server saw the restore's id: a late call naming it is not fenced (seed 309263324).
            assert error is not None and error.codes == {"(checkpoint)": "invalid_checkpoint_state"}, error
            statuses = await self.statuses()
            assert all(status["phase"] == "idle" for status in statuses.values()), statuses
            return
        else:
            for capture in scope:
                episode = from_capture_key(capture)
                self.mark(episode.rollout_id, episode.attempt)
        if damage != "none":
            assert error is not None and "invalid_checkpoint_state" in error.codes.values(), error
            statuses = await self.statuses()
            for name, status in statuses.items():
                assert status["phase"] == "idle", (name, status)
                # The clean-up may retire the replacement attempts a participant installed.
                for rollout_id, attempt in status.get("retired_marks", {}).items():
                    mark = self.marks[name].get(rollout_id, -1)
                    assert mark <= attempt <= mark + 1, (name, rollout_id, attempt, mark)
                    self.marks[name][rollout_id] = attempt
            self.resumed.append(restore_id)
            self.fenced.append(restore_id)
            return
        assert error is None, f"restore: {error}"
        assert result.source_checkpoint_id == published.checkpoint_id
        restored = result.restored()
        assert restored == sorted(
            key(from_capture_key(k).rollout_id, from_capture_key(k).attempt + 1) for k in scope
        ), (
            restored,
            scope,
        )
        self.ok(await self.control(resume, restore_id), "resume after restore")
        self.resumed.append(restore_id)
        self.fenced.append(restore_id)
        for capture in restored:
            episode = from_capture_key(capture)
            rollout = self.rollouts[episode.rollout_id]
            rollout.restored, rollout.continues = episode.attempt, directory

    # -- invariants ----------------------------------------------------------------------------------

    @invariant()
    def check(self) -> None:
        self.run(self.check_now())

    async def check_now(self) -> None:
        await self.reap()
        await self.keep_alive()
        statuses = await self.statuses()
        for name, status in statuses.items():
            async with self.http.get(
                self.coordinator_url(name) + _METRICS, headers={"Authorization": f"Bearer {TOKEN}"}
            ) as reply:
                text = await reply.text()
            closed = [
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("gym_checkpoint_admission_closed ")
            ]
            assert closed in ([0.0], [1.0]), (name, closed)
            # Read twice around the gauge: a phase that moved meanwhile is read again.
            assert (status["phase"] == "idle") == (closed == [0.0]), (name, status["phase"], closed)
            marks = status.get("retired_marks", {})
            assert marks == self.marks[name], (name, marks, self.marks[name])
        for directory in self.unpublished:
            assert not directory.exists() or not any(directory.rglob("manifest.json")), (
                f"a manifest in {directory} after its resume"
            )
        for directory in self.published:
            files = await asyncio.to_thread(_settled_files, Path(directory))
            if files is not None and self.verified.get(directory) == files:
                continue
            checks = await asyncio.to_thread(verify_checkpoint, Path(directory))
            assert checks and all(c.ok for c in checks), [c.to_json() for c in checks]
            if files is not None:
                self.verified[directory] = files
        assert not self.errors_500, self.errors_500
        for rollout in self.rollouts.values():
            assert len(rollout.successes) <= 1, (rollout.rollout_id, rollout.successes)

    def coordinator_url(self, name: str) -> str:
        return next(p.url for p in self.coordinator.participants if p.name == name)

    # -- the end -------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Every rollout to its end: each finished exactly once; a continued one repeated no completed step."""
        self.run(self.finish_now())

    async def finish_now(self) -> None:
        if self.open is not None:
            self.ok(await self.control(resume, self.open), "resume")
            self.closed(self.open)
        await self.fake.release()
        await self.verify_route("release", {})
        for rollout in self.live():
            await self.settle(rollout)
        for _ in range(3):
            pending = [r for r in self.rollouts.values() if not r.done]
            if not pending:
                break
            for rollout in pending:
                before = await self.fake.stats()
                async with self.http.get(
                    self.deployment.urls[RESOURCES] + _STATUS, headers={"Authorization": f"Bearer {TOKEN}"}
                ) as reply:
                    seeds_before = (await reply.json()).get("seed_sessions_by_rollout", {})
                continued = (
                    rollout.restored is not None
                    and rollout.rollout_id in self.published[rollout.continues].held_in_step_1
                )
                await self.next_of(rollout, "none")
                await self.settle(rollout)
                if continued and rollout.done:
                    after = await self.fake.stats()
                    conv = conversation(rollout.rollout_id)
                    assert after["completed"].get(conv, {}).get("0") == before["completed"].get(conv, {}).get("0"), (
                        f"{rollout.rollout_id} ran its first model call again after a restore"
                    )
                    async with self.http.get(
                        self.deployment.urls[RESOURCES] + _STATUS, headers={"Authorization": f"Bearer {TOKEN}"}
                    ) as reply:
                        seeds = (await reply.json()).get("seed_sessions_by_rollout", {})
                    capture = key(rollout.rollout_id, rollout.attempt)
                    assert seeds.get(capture, 0) == seeds_before.get(capture, 0), f"{capture} seeded again"
        for rollout in self.rollouts.values():
            assert len(rollout.successes) == 1, (rollout.rollout_id, rollout.outcomes)
        await self.check_now()
