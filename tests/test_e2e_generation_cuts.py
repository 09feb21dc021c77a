"""A generation in flight survives a crash of real processes: continued from the tokens already generated.

A real Gym deployment (every server wrapped), the policy model with
``checkpoint_generation_cuts: {tool_call_parser: hermes}`` and ``return_token_id_information``;
the fake backend generates 200 tokens/s and serves vLLM's dev-mode pause. A rollout's turn makes
a tool call, then a 2,000-token answer. About half way through the answer the checkpoint is
prepared (the worker frozen in place) and committed, and every Gym server is SIGKILLed while it
is open; the inference worker lives on, as a real one does. Fresh processes restore and resume,
and the rollout is sent again as attempt 1. Its answer equals an uninterrupted run's token for
token (text, token ids, logprobs), and the backend generated only the remainder after the restore.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nemo_gym_checkpoint_plugin.testing.deployment import (
    BACKEND,
    DEFAULT_CHECKPOINT_BLOCK,
    ENVIRONMENT,
    GYM_SERVERS,
    MODEL,
    TOKEN_ENV,
    Deployment,
    free_port_base,
    rollout_body,
)
from nemo_gym_checkpoint_plugin.testing.gym_config import wrapped_entrypoints
from nemo_gym_checkpoint_plugin.testing.harness import FakeBackend

pytestmark = pytest.mark.slow

TOKEN = "e2e-generation-cuts-token"
ANSWER_TOKENS = 2000
WORDS = ANSWER_TOKENS - 8  # the sentence's 7 words and the end token make up the rest
RATE = 200.0
_BOUND = 120.0


def prompt(rollout: str) -> str:
    return f"weather please ({rollout}) [answer_words={WORDS}]"


def answer_of(reply: dict[str, Any]) -> dict[str, Any]:
    """The turn's last model answer as the rollout returns it: its text, token ids and logprobs."""
    assert reply["failure"] is None, reply["failure"]
    message = [item for item in reply["result"]["response"]["output"] if item["type"] == "message"][-1]
    return {
        "text": "".join(part.get("text", "") for part in message["content"]),
        "generation_token_ids": message["generation_token_ids"],
        "generation_log_probs": message["generation_log_probs"],
    }


async def _scenario(tmp_path: Path) -> dict[str, Any]:
    from nemo_gym_checkpoint_plugin.coordination import commit, discover, prepare, restore, resume

    deployment = Deployment(
        free_port_base(),
        tmp_path,
        entrypoints=wrapped_entrypoints(),
        own_process_groups=True,
        log_dir=tmp_path / "logs",
        extra_env={TOKEN_ENV: TOKEN},
        checkpoint=DEFAULT_CHECKPOINT_BLOCK,
        model={"return_token_id_information": True, "checkpoint_generation_cuts": {"tool_call_parser": "hermes"}},
    )
    deployment.start()
    urls = deployment.urls
    fake = FakeBackend(urls[BACKEND])
    limits = aiohttp.ClientTimeout(total=None, connect=_BOUND, sock_read=_BOUND)
    try:
        async with aiohttp.ClientSession(timeout=limits, raise_for_status=True) as http:

            async def run(rollout: str, attempt: int, conversation: str) -> dict[str, Any]:
                body = rollout_body(rollout, attempt=attempt, prompt=conversation)
                async with http.post(urls[ENVIRONMENT] + "/run", json=body) as reply:
                    return await reply.json()

            await fake.rate(RATE)
            uninterrupted = await run("ref", 0, prompt("cut-0"))
            tool_call_tokens = (await fake.generated())["generated_total"] - ANSWER_TOKENS
            await fake.reset()
            await fake.rate(RATE)

            conversation = prompt("cut-0")
            # Half way through the answer the worker stands still (as paused): the checkpoint catches it there.
            await fake.pause_at("(cut-0)", tool_call_tokens + ANSWER_TOKENS // 2)
            first = asyncio.ensure_future(run("cut-0", 0, conversation))
            await fake.wait_for(lambda s: s["paused"], _BOUND, "half the answer generated")
            coordinator = await discover(deployment.config, TOKEN)
            async with coordinator:
                prepared = await prepare(coordinator, "cuts", timeout=60)
                scope = prepared.continued(["cut-0"])
                committed = await commit(coordinator, "cuts", str(tmp_path / "ckpt"), scope, timeout=60)
            before_crash = await fake.generated()
            cut = before_crash["generated"][conversation] - tool_call_tokens

            deployment.kill(only=GYM_SERVERS)  # the crash, while the checkpoint is open: the worker lives on
            await asyncio.gather(first, return_exceptions=True)
            await fake.wait_for(lambda s: s["abandoned_total"] >= 1, _BOUND, "the backend to see the stream dropped")
            await asyncio.to_thread(deployment.start)

            coordinator = await discover(deployment.config, TOKEN)
            async with coordinator:
                await restore(coordinator, "cuts-restore", str(tmp_path / "ckpt"), scope, timeout=60)
                await resume(coordinator, "cuts-restore", timeout=60)
            restored = await fake.generated()
            continued = await run("cut-0", 1, conversation)
            after = await fake.generated()
            status_reply = await http.get(
                urls[MODEL] + "/ng-control/v1/checkpoint/status", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            status = await status_reply.json()
    finally:
        deployment.stop()
    return {
        "uninterrupted": uninterrupted,
        "continued": continued,
        "prepared": prepared,
        "committed": committed,
        "cut": cut,
        "frozen": before_crash["paused"],
        "paused_after_restore": restored["paused"],
        "generated_after_restore": after["generated"][conversation] - restored["generated"][conversation],
        "status": status,
    }


def test_a_2000_token_generation_killed_half_way_continues_with_only_the_remainder(tmp_path: Path) -> None:
    result = asyncio.run(_scenario(tmp_path))
    assert result["prepared"].ready and result["prepared"].restarts() == []
    assert result["committed"].replies[MODEL]["episode_ids"] == ["cut-0"]
    assert result["frozen"] and not result["paused_after_restore"]
    cut, after = result["cut"], result["generated_after_restore"]
    print(f"generation cut at {cut} of {ANSWER_TOKENS} tokens; generated after the restore: {after}")
    assert cut == ANSWER_TOKENS // 2
    assert after == ANSWER_TOKENS - cut, (cut, after)  # only the remainder: the prefix was not generated again
    continued, uninterrupted = result["continued"], result["uninterrupted"]
    assert continued["episode_id"] == {"rollout_id": "cut-0", "attempt": 1}
    assert continued["result"]["reward"] == uninterrupted["result"]["reward"] == 1.0
    assert answer_of(continued) == answer_of(uninterrupted)  # text, token ids and logprobs, token for token
    assert len(answer_of(continued)["generation_token_ids"]) == ANSWER_TOKENS
    cuts = result["status"]["generation_cuts"]
    assert cuts["continued_total"] == 1 and cuts["tokens_continued_total"] == cut


@pytest.mark.parametrize(
    ("value", "said"),
    [("sometimes", "must be true, false or a mapping"), ({"tool_call_parser": "pythonic"}, "tool_call_parser")],
)
def test_a_bad_setting_makes_the_wrapped_model_server_refuse_to_start(tmp_path: Path, value: Any, said: str) -> None:
    import importlib.util
    import os
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from nemo_gym_checkpoint_plugin.testing.gym_config import WRAP_ENTRYPOINT, build_gym_config, server_location

    config = build_gym_config(
        free_port_base(), tmp_path, checkpoint=DEFAULT_CHECKPOINT_BLOCK, model={"checkpoint_generation_cuts": value}
    )
    server_location(config, MODEL)[2]["entrypoint"] = WRAP_ENTRYPOINT
    spec = importlib.util.find_spec("responses_api_models.vllm_model.app")
    assert spec is not None and spec.origin is not None
    model_dir = Path(spec.origin).parent
    done = subprocess.run(
        [sys.executable, "-m", WRAP_ENTRYPOINT],
        cwd=model_dir,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            TOKEN_ENV: TOKEN,
            "NEMO_GYM_CONFIG_DICT": OmegaConf.to_yaml(config),
            "NEMO_GYM_CONFIG_PATH": MODEL,
            "RAY_USAGE_STATS_ENABLED": "0",
        },
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to start" in done.stderr and "checkpoint_generation_cuts" in done.stderr, done.stderr[-2000:]
    assert said in done.stderr and f"server {MODEL!r}" in done.stderr and "Traceback" not in done.stderr
