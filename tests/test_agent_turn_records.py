"""A turn's journal keeps each model answer as its exact bytes (base64 text), replays those bytes, and
still restores the records of earlier releases, which kept the answer as parsed JSON."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from nemo_gym_checkpoint_plugin.builtin_participants.agent.turn_journal import Recorded, Turn, TurnBook, TurnRun

DIGEST = "a" * 64
# Bytes no JSON re-encoding gives back: spacing, key order, a float's spelling, an escaped character.
ANSWER = b'{"output": [ {"type":"message","z":1,"a":2}], "logprob": -0.50, "text": "caf\\u00e9"}'


class _Answer:
    ok = True
    status = 200
    cookies: dict[str, Any] = {}

    async def read(self) -> bytes:
        return ANSWER


def _wire(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "activation": 1,
        "request_sha256": DIGEST,
        "cookies_before": {},
        "observations_before": None,
        "calls": [call],
    }


async def test_a_model_answer_is_journaled_and_replayed_byte_for_byte() -> None:
    turn = Turn(activation=1, request_sha256=DIGEST, cookies_before={}, observations_before=None)
    run = TurnRun(TurnBook("policy_model"), "r1", turn)

    async def send() -> _Answer:
        return _Answer()

    await run.model_call(send, {"input": "hi"})
    (entry,) = turn.to_wire()["calls"]
    assert entry["call"] == "model" and "response" not in entry
    assert base64.b64decode(entry["body"]) == ANSWER
    restored = Turn.from_wire(json.loads(json.dumps(turn.to_wire())))  # as a restore decodes it
    replay = TurnRun(TurnBook("policy_model"), "r1-a1", restored)
    answer = await replay.model_call(send, {"input": "hi"})
    assert isinstance(answer, Recorded) and await answer.read() == ANSWER


async def test_a_record_of_an_earlier_release_still_replays_its_answer() -> None:
    response = {"output": [{"type": "message", "text": "cold"}]}
    restored = Turn.from_wire(_wire({"call": "model", "sha256": DIGEST, "response": response, "cookies": {}}))
    assert json.loads(await Recorded.of(restored.calls[0]).read()) == response


@pytest.mark.parametrize(
    "call",
    [
        {"call": "model", "sha256": DIGEST},  # neither body nor response
        {"call": "model", "sha256": DIGEST, "body": 7},
        {"call": "model", "sha256": 7, "body": ""},
        {"call": "tool", "sha256": DIGEST, "status": "200", "body": ""},
        ["model"],
    ],
)
def test_a_malformed_call_is_refused_naming_it(call: Any) -> None:
    with pytest.raises(ValueError, match=r"turn\.calls\[0\]"):
        Turn.from_wire(_wire(call))


async def test_wait_change_wakes_for_a_change_made_before_it_first_runs() -> None:
    """The agent's ``wait_ready`` answer: the control plane awaits it as a task, which first runs on a later
    turn of the loop; the last blocker clearing in between (the turn's callback ran first) must still wake
    it. It waited for a change after that one, which never came: the prepare stayed not ready, with no
    blocker, until its deadline (a collector's checkpoint paused the deployment 60 s, make fuzz seed 7027)."""
    book = TurnBook("policy_model")
    book.close()
    busy = book.busy("r0-a0")
    busy.__enter__()
    assert book.blockers() == ["r0-a0"]
    waiting = asyncio.ensure_future(book.wait_change())
    busy.__exit__(None, None, None)
    assert book.blockers() == []
    await asyncio.wait_for(waiting, 1.0)
