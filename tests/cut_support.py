"""In-process ``vllm_model`` servers with generation cuts, in front of the fake backend over real HTTP.

``CutServers`` is ``model_support.ModelServers`` with ``checkpoint_generation_cuts`` written into
the policy model's block (the setting lives in the Gym config, as a deployment writes it) and
the control routes at hand. A "crash" here is a fresh server built on the same config (what a
restarted process is) after the old one's call was abandoned (its connection to the backend dropped).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from model_support import AUTH, WEATHER_TOOL, ModelServers
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL

__all__ = ["CONTROL", "CutServers", "control", "final_request", "first_request", "path_of"]

CONTROL = "/ng-control/v1/checkpoint"


def path_of(key: str) -> str:
    return f"/ng-rollout/{key}/v1/responses"


def first_request(conversation: str) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": conversation}], "tools": [WEATHER_TOOL]}


def final_request(conversation: str, call_id: str = "call_0") -> dict[str, Any]:
    """The turn's second model call: after one get_weather call and its result (the answer is text)."""
    body = first_request(conversation)
    body["input"] += [
        {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": '{"city": "San Francisco"}'},
        {"type": "function_call_output", "call_id": call_id, "output": '{"weather": "cold"}'},
    ]
    return body


async def control(http: httpx.AsyncClient, route: str, seconds: float = 30.0, **body: Any) -> httpx.Response:
    return await http.post(f"{CONTROL}/{route}", json={"deadline_ts": time.time() + seconds, **body}, headers=AUTH)


class CutServers(ModelServers):
    """Model servers with ``checkpoint_generation_cuts: cuts`` (None: the key left out)."""

    def __init__(
        self,
        tmp_path: Path,
        monkeypatch: Any,
        cuts: Any = None,
        extra_config: Mapping[str, Any] | None = None,
        model: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(tmp_path, monkeypatch, extra_config)
        block = self.config[MODEL]["responses_api_models"]["vllm_model"]
        for key, value in {
            **({"checkpoint_generation_cuts": cuts} if cuts is not None else {}),
            **(model or {}),
        }.items():
            block[key] = OmegaConf.create(value) if isinstance(value, Mapping) else value
