"""Session state without code: per-session dict attributes checkpointed by the built-in resources participant.

The wheel's real servers are built in process (``test_attach_inprocess``'s helpers: wrapped
class, generated Gym config with the ``checkpoint:`` block enabled) and driven over HTTP with
``httpx.ASGITransport``, keeping Gym's session cookie between calls as a real caller does.
Checkpoint and restore go through the real control routes and the local storage: a second
server built from the same config stands for the process that restores after a crash.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from nemo_gym_checkpoint_plugin.builtin_participants.resources import checkpoint_modes
from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_bindings import ResourcesSessions
from nemo_gym_checkpoint_plugin.builtin_participants.resources.session_state import (
    SessionState,
    UnsupportedSessionValue,
    decode,
    encode,
)
from pydantic import BaseModel, Field
from test_attach_inprocess import _app, _build, _server_class

from nemo_gym_checkpoint_plugin._attach import ATTACHMENT_STATE
from nemo_gym_checkpoint_plugin._identity import EpisodeId, from_capture_key
from nemo_gym_checkpoint_plugin._settings import SettingsError
from nemo_gym_checkpoint_plugin.testing.gym_config import RESOURCES, TOKEN_ENV, build_gym_config
from nemo_gym_checkpoint_plugin.wrap import derive_checkpointable

TOKEN = "session-state-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONTROL = "/ng-control/v1/checkpoint"
COUNTER = "example_session_state_mgmt"
BLACKJACK = "blackjack"


class Built:
    def __init__(self, server: Any, app: Any) -> None:
        self.server = server
        self.app = app
        self.control = getattr(app.state, ATTACHMENT_STATE).control
        [self.participant] = [p for p in self.control.pm.get_plugins() if isinstance(p, ResourcesSessions)]

    def client(self, cookies: httpx.Cookies | None = None) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10.0, cookies=cookies)

    async def control_call(self, route: str, **body: Any) -> httpx.Response:
        async with self.client() as http:
            return await http.post(f"{CONTROL}/{route}", headers=AUTH, json={"deadline_ts": time.time() + 30, **body})

    async def checkpoint(self, checkpoint_dir: Path, scope: list[str]) -> httpx.Response:
        prepared = await self.control_call("prepare", checkpoint_id="ck-1")
        assert prepared.status_code == 200 and prepared.json()["phase"] == "prepared", prepared.text
        return await self.control_call(
            "commit", checkpoint_id="ck-1", checkpoint_dir=str(checkpoint_dir), episode_ids=_wire(scope)
        )

    async def restore(self, checkpoint_dir: Path, scope: list[str]) -> dict[str, Any]:
        restored = await self.control_call(
            "restore", checkpoint_id="rs-1", checkpoint_dir=str(checkpoint_dir), episode_ids=_wire(scope)
        )
        assert restored.status_code == 200, restored.text
        resumed = await self.control_call("resume", checkpoint_id="rs-1")
        assert resumed.status_code == 200, resumed.text
        return restored.json()


def _wire(keys: list[str]) -> list[dict[str, Any]]:
    return [{"rollout_id": e.rollout_id, "attempt": e.attempt} for e in map(from_capture_key, keys)]


class Servers:
    def __init__(self, tmp_path: Path, implementation: str, **block: Any) -> None:
        self.config = build_gym_config(
            20000,
            tmp_path,
            checkpoint={"enabled": True, "control_auth_token_env": TOKEN_ENV},
            resources={"implementation": implementation, **block},
        )
        self.server_class = derive_checkpointable(_server_class(self.config, RESOURCES))
        self.built: list[Built] = []

    def build(self) -> Built:
        server = _build(self.server_class, self.config, RESOURCES)
        built = Built(server, _app(server))
        self.built.append(built)
        return built


@pytest.fixture
async def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    made: list[Servers] = []

    def factory(implementation: str, **block: Any) -> Servers:
        made.append(Servers(tmp_path / f"cfg{len(made)}", implementation, **block))
        return made[-1]

    yield factory
    for servers in made:
        for built in servers.built:
            await built.control.aclose()


# -- example_session_state_mgmt (built-in table) --------------------------------------------------


async def _counter_episode(built: Built, rollout: str, initial: int, increments: list[int]) -> httpx.Cookies:
    async with built.client() as http:
        seeded = await http.post(f"/ng-rollout/{rollout}/seed_session", json={"initial_count": initial})
        assert seeded.status_code == 200, seeded.text
        for count in increments:
            reply = await http.post(f"/ng-rollout/{rollout}/increment_counter", json={"count": count})
            assert reply.status_code == 200, reply.text
        return http.cookies


async def _counter_value(built: Built, key: str, cookies: httpx.Cookies) -> int:
    async with built.client(cookies) as http:
        reply = await http.post(f"/ng-rollout/{key}/get_counter_value")
        assert reply.status_code == 200, reply.text
        return reply.json()["count"]


async def test_the_counter_is_restored_per_session_with_no_config(make: Any, tmp_path: Path) -> None:
    servers = make(COUNTER)
    first = servers.build()
    status = await _status(first)
    assert status["checkpoint_mode"] == "export_restore" and status["session_state"] == ["session_id_to_counter"]
    kept = await _counter_episode(first, "cnt-1", 3, [2, 5])
    other = await _counter_episode(first, "cnt-2", 100, [1])
    committed = await first.checkpoint(tmp_path / "ckpt", ["cnt-1"])
    assert committed.status_code == 200, committed.text
    assert committed.json()["episode_ids"] == ["cnt-1"]

    second = servers.build()  # the process after the crash: empty
    restored = await second.restore(tmp_path / "ckpt", ["cnt-1"])
    assert restored["restored"] == ["cnt-1-a1"]
    # The restored attempt, with the cookie it always had, finds its counter where it left it.
    assert await _counter_value(second, "cnt-1-a1", kept) == 10
    async with second.client(kept) as http:
        verify = await http.post("/ng-rollout/cnt-1-a1/verify", json={**_verify_body(), "expected_count": 10})
    assert verify.status_code == 200 and verify.json()["reward"] == 1.0, verify.text
    # Only the episode in scope was written: the other session is not there.
    assert second.server.session_id_to_counter.keys() == {_session_id(second, "cnt-1")}
    assert await _counter_value(second, "cnt-2-a1", other) == 0


async def test_a_value_that_is_not_json_fails_the_commit_naming_the_episode(make: Any, tmp_path: Path) -> None:
    built = make(COUNTER).build()
    await _counter_episode(built, "odd-1", 1, [])
    built.server.session_id_to_counter[_session_id(built, "odd-1")] = {1, 2}  # a set: not JSON
    committed = await built.checkpoint(tmp_path / "ckpt", ["odd-1"])
    assert committed.status_code >= 400
    error = committed.json()["error"]
    assert error["code"] == "export_failed"
    assert "episode odd-1" in error["detail"] and "session_id_to_counter" in error["detail"]
    assert "builtins.set" in error["detail"]
    assert not (tmp_path / "ckpt" / "gym" / "resources").exists() or not any(
        (tmp_path / "ckpt" / "gym" / "resources").rglob("manifest.json")
    )


# -- configured session state ---------------------------------------------------------------------


async def test_a_configured_attribute_is_checkpointed(
    make: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not in the built-in table: only the config key makes the server export_restore.
    monkeypatch.setattr(checkpoint_modes, "BUILTIN_SESSION_STATE", {})
    assert (await _status(make(COUNTER).build()))["checkpoint_mode"] is None
    servers = make(COUNTER, checkpoint_session_state=["session_id_to_counter"])
    first = servers.build()
    cookies = await _counter_episode(first, "cfg-1", 7, [1])
    assert (await first.checkpoint(tmp_path / "ckpt", ["cfg-1"])).status_code == 200
    second = servers.build()
    await second.restore(tmp_path / "ckpt", ["cfg-1"])
    assert await _counter_value(second, "cfg-1-a1", cookies) == 8


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("session_id_to_counter", "is not a list of attribute names"),
        ([], "the list is empty"),
        (["no_such_attr"], "no such attribute"),
        (["config"], "is not a dict keyed by session id"),
        (["session_id_to_counter", "session_id_to_counter"], "names an attribute twice"),
        ([3], "is not an attribute name"),
    ],
)
def test_a_bad_value_stops_the_server_naming_the_key(make: Any, value: Any, why: str) -> None:
    servers = make(COUNTER, checkpoint_session_state=value)
    with pytest.raises(SettingsError, match=rf"server '{RESOURCES}': checkpoint_session_state: .*{why}"):
        servers.build()


@pytest.mark.parametrize("mode", ["stateless", "restart_only"])
def test_a_configured_mode_that_contradicts_configured_state_is_refused(make: Any, mode: str) -> None:
    servers = make(COUNTER, checkpoint_session_state=["session_id_to_counter"], checkpoint_mode=mode)
    with pytest.raises(SettingsError, match=rf"checkpoint_mode: '{mode}' contradicts checkpoint_session_state"):
        servers.build()


async def test_a_configured_mode_overrules_the_built_in_table(make: Any) -> None:
    status = await _status(make(COUNTER, checkpoint_mode="restart_only").build())
    assert status["checkpoint_mode"] == "restart_only" and status["session_state"] == []


# -- blackjack: the deck's random-number state ----------------------------------------------------


def _action(text: str) -> dict[str, Any]:
    return {
        "id": "r",
        "created_at": 0.0,
        "model": "m",
        "object": "response",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": [
            {
                "id": "msg",
                "role": "assistant",
                "status": "completed",
                "type": "message",
                "content": [{"annotations": [], "text": text, "type": "output_text"}],
            }
        ],
    }


_PARAMS = {"input": [{"role": "user", "content": "play"}]}


async def _blackjack_steps(built: Built, key: str, cookies: httpx.Cookies, actions: list[str]) -> list[Any]:
    out = []
    async with built.client(cookies) as http:
        for action in actions:
            reply = await http.post(
                f"/ng-rollout/{key}/step",
                json={"responses_create_params": _PARAMS, "response": _action(f"<action>{action}</action>")},
            )
            assert reply.status_code == 200, reply.text
            out.append(reply.json())
    return out


async def _blackjack_reset(built: Built, key: str) -> tuple[Any, httpx.Cookies]:
    async with built.client() as http:
        reply = await http.post(f"/ng-rollout/{key}/reset", json={"responses_create_params": _PARAMS})
        assert reply.status_code == 200, reply.text
        return reply.json(), http.cookies


@pytest.fixture
def seeded_blackjack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blackjack draws from ``random.Random()``: give every new game the same seed."""
    import resources_servers.blackjack.app as blackjack

    class Seeded:
        @staticmethod
        def Random() -> random.Random:  # noqa: N802 - the name blackjack calls
            return random.Random(1234)

    monkeypatch.setattr(blackjack, "random", Seeded)


async def test_a_restored_blackjack_game_deals_the_same_next_cards(
    make: Any, tmp_path: Path, seeded_blackjack: None
) -> None:
    servers = make(BLACKJACK)
    actions = ["hit", "hit", "hit", "stand"]

    uninterrupted = servers.build()
    reset_u, cookies_u = await _blackjack_reset(uninterrupted, "bj-u")
    steps_u = await _blackjack_steps(uninterrupted, "bj-u", cookies_u, actions[:1])
    steps_u += await _blackjack_steps(uninterrupted, "bj-u", cookies_u, actions[1:])

    first = servers.build()
    reset_c, cookies_c = await _blackjack_reset(first, "bj-c")
    steps_c = await _blackjack_steps(first, "bj-c", cookies_c, actions[:1])
    assert (reset_c, steps_c) == (reset_u, steps_u[:1])
    committed = await first.checkpoint(tmp_path / "ckpt", ["bj-c"])
    assert committed.status_code == 200, committed.text
    second = servers.build()
    await second.restore(tmp_path / "ckpt", ["bj-c"])
    # The same hands, and the deck continues where it was: the same next cards, the same outcome.
    after = await _blackjack_steps(second, "bj-c-a1", cookies_c, actions[1:])
    assert after == steps_u[1:]
    assert after[-1]["terminated"] is True


# -- the value codec ------------------------------------------------------------------------------


class Hand(BaseModel):
    cards: list[str]
    bet: float


def test_the_codec_restores_json_models_and_random_state() -> None:
    rng = random.Random(7)
    rng.random()
    value = {
        "hand": Hand(cards=["A", "K"], bet=2.5),
        "$ng": "a user key that looks like ours",
        "nested": [{"deep": Hand(cards=[], bet=0.0)}, None, True, 1, 2.0, "s"],
        "rng": rng,
    }
    decoded = decode(encode(value))
    assert type(decoded["hand"]) is Hand and decoded["hand"] == value["hand"]
    assert decoded["$ng"] == value["$ng"] and decoded["nested"] == value["nested"]
    assert decoded["rng"].random() == rng.random()


@pytest.mark.parametrize(
    ("value", "named"),
    [({1, 2}, "builtins.set"), ((1, 2), "builtins.tuple"), ({1: "x"}, "key 1"), ([object()], "value[0]")],
)
def test_the_codec_refuses_what_it_cannot_restore(value: Any, named: str) -> None:
    with pytest.raises(UnsupportedSessionValue, match=named.replace("[", r"\[").replace("]", r"\]")):
        encode(value)


class Secretive(BaseModel):
    shown: int
    hidden: int = Field(default=0, exclude=True)


def test_a_model_that_would_not_come_back_equal_is_refused() -> None:
    encode(Secretive(shown=1))  # the excluded field at its default: nothing lost
    with pytest.raises(UnsupportedSessionValue, match=r"value\['s'\]: Secretive does not survive"):
        encode({"s": Secretive(shown=1, hidden=5)})


def test_a_model_class_not_loaded_in_the_server_is_refused() -> None:
    with pytest.raises(ValueError, match="not a pydantic model loaded"):
        decode({"$ng": "model", "class": "some_module_never_imported:Thing", "data": {}})


# -- helpers --------------------------------------------------------------------------------------


def _verify_body() -> Mapping[str, Any]:
    return {"responses_create_params": _PARAMS, "response": _action("done")}


def _session_id(built: Built, rollout: str) -> str:
    """The Gym session id the binder saw for ``rollout`` (it is inside the signed cookie)."""
    [session_id] = [s for s, e in built.participant.session_state.bindings.items() if e.rollout_id == rollout]
    return session_id


async def _status(built: Built) -> dict[str, Any]:
    async with built.client() as http:
        reply = await http.get(f"{CONTROL}/status", headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_close_unbinds_its_own_sessions_only_after_takeovers_restores_and_drops() -> None:
    from types import SimpleNamespace

    state = SessionState(SimpleNamespace(counts={}), ["counts"])
    r0, r1, q0 = EpisodeId(rollout_id="r"), EpisodeId(rollout_id="r", attempt=1), EpisodeId(rollout_id="q")
    for session_id, episode in (("s1", r0), ("s2", r0), ("s3", q0)):
        state.bind(session_id, episode)
    state.bind("s1", r1)  # a restored attempt reusing its cookie takes the session over
    state.unbind(r0)  # the close of attempt 0: its other session goes, the taken-over one stays
    assert state.bindings == {"s1": r1, "s3": q0}
    state.apply(r1, [("s4", {"counts": 1})])
    state.drop(lambda episode: episode == q0)
    assert state.bindings == {"s1": r1, "s4": r1}
    state.unbind(q0)  # nothing left of it: nothing happens
    state.unbind(r1)
    assert state.bindings == {} and state.tables["counts"] == {"s4": 1}
