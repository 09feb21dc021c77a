"""Generation cuts piece by piece: the setting, what is never cut, the parsers, the streamed answer, a cut's checks."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_book import CutBook
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_parse import parse_message
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_settings import (
    NEVER_CUT,
    CutSettings,
    cut_settings,
    never_cut_reason,
    sampling,
)
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_stream import Generation, cut_digest
from omegaconf import OmegaConf

from nemo_gym_checkpoint_plugin._attach import refuse_unsupported
from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._settings import CheckpointSettings, SettingsError
from nemo_gym_checkpoint_plugin.testing.fake_answers import answer_for
from nemo_gym_checkpoint_plugin.testing.fake_tokens import Vocabulary
from nemo_gym_checkpoint_plugin.testing.gym_config import MODEL, build_gym_config

ON = CutSettings(enabled=True, tool_call_parser="hermes")


def config_with(tmp_path: Path, value: Any, **model: Any) -> Any:
    config = build_gym_config(
        20000,
        tmp_path,
        checkpoint={"enabled": True, "control_auth_token_env": "X"},
        model={**({"checkpoint_generation_cuts": value} if value is not None else {}), **model},
    )
    return config


class ServerConfig:
    def __init__(self, **fields: Any) -> None:
        self.name = MODEL
        self.base_url = ["http://127.0.0.1:1/v1"]
        self.__dict__.update(fields)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, CutSettings()),
        (False, CutSettings()),
        (True, CutSettings(enabled=True)),
        ({}, CutSettings(enabled=True)),
        (
            {"tool_call_parser": "hermes", "freeze_worker": False},
            CutSettings(enabled=True, tool_call_parser="hermes", freeze_worker=False),
        ),
    ],
)
def test_the_setting_is_off_by_default_and_per_server(tmp_path: Path, value: Any, expected: CutSettings) -> None:
    assert cut_settings(config_with(tmp_path, value), MODEL) == expected


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("yes", "must be true, false or a mapping"),
        (1, "must be true, false or a mapping"),
        ({"tool_parser": "hermes"}, "unknown keys ['tool_parser']"),
        ({"tool_call_parser": "mistral"}, "tool_call_parser must be one of ['hermes']"),
        ({"freeze_worker": "sometimes"}, "freeze_worker must be true or false"),
    ],
)
def test_a_bad_value_refuses_the_server_at_startup_naming_the_key(tmp_path: Path, value: Any, named: str) -> None:
    config = config_with(tmp_path, value)
    with pytest.raises(SettingsError, match="checkpoint_generation_cuts") as refused:
        refuse_unsupported(ServerConfig(), CheckpointSettings(enabled=True), config)
    assert named in str(refused.value)


@pytest.mark.parametrize(
    ("model", "named"),
    [({"use_completions_api": True}, "use_completions_api"), ({"is_responses_native": True}, "is_responses_native")],
)
def test_a_server_the_cuts_cannot_serve_refuses_to_start(tmp_path: Path, model: dict[str, Any], named: str) -> None:
    config = config_with(tmp_path, True)
    with pytest.raises(SettingsError, match=named):
        refuse_unsupported(ServerConfig(**model), CheckpointSettings(enabled=True), config)


def test_external_token_staging_refuses_the_cuts(tmp_path: Path) -> None:
    config = config_with(tmp_path, True)
    config["token_id_capture"] = OmegaConf.create({"enabled": True, "external_staging": True})
    with pytest.raises(SettingsError, match="external_staging"):
        refuse_unsupported(ServerConfig(), CheckpointSettings(enabled=True), config)


def test_with_checkpointing_disabled_the_key_changes_nothing(tmp_path: Path) -> None:
    refuse_unsupported(ServerConfig(), CheckpointSettings(enabled=False), config_with(tmp_path, "yes"))


BASE = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function"}],
    "logprobs": True,
    "top_logprobs": 0,
    "return_tokens_as_token_ids": True,
    "temperature": 1.0,
}


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({}, None),
        ({"tool_choice": "auto", "seed": None, "n": 1, "stop": [], "presence_penalty": 0.0, "min_tokens": 0}, None),
        ({"tool_choice": "none"}, None),
        ({"tool_choice": "required"}, "constrained_tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "constrained_tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": {"type": "object"}}, "guided_decoding"),
        ({"structured_outputs": {"regex": "a+"}}, "guided_decoding"),
        ({"stop": ["\n\n"]}, "stop_strings"),
        ({"bad_words": ["no"]}, "bad_words"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"frequency_penalty": 0.5}, "penalties"),
        ({"repetition_penalty": 1.1}, None),  # over prompt and output alike: the prefix stays covered
        ({"seed": 7}, "seed"),
        ({"seed": 0}, "seed"),
        ({"n": 2}, "several_choices"),
        ({"use_beam_search": True}, "several_choices"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"continue_final_message": True}, "not_a_fresh_turn"),
        ({"add_generation_prompt": False}, "not_a_fresh_turn"),
        ({"truncate_prompt_tokens": 100}, "prompt_truncation"),
        ({"some_vendor_flag": 1}, "unknown_field"),
    ],
)
def test_what_a_continuation_cannot_honour_is_never_cut(extra: dict[str, Any], reason: str | None) -> None:
    assert never_cut_reason({**BASE, **extra}, ON) == reason
    if reason is not None:
        assert reason in NEVER_CUT


def test_a_call_offering_tools_is_cut_only_with_a_tool_parser() -> None:
    assert never_cut_reason(BASE, CutSettings(enabled=True)) == "tools_without_parser"
    assert never_cut_reason({**BASE, "tools": []}, CutSettings(enabled=True)) is None
    assert never_cut_reason({**BASE, "tool_choice": "none"}, CutSettings(enabled=True)) is None


def test_sampling_is_what_the_continuation_copies() -> None:
    assert sampling({**BASE, "max_tokens": 50, "top_k": 20}) == {
        "temperature": 1.0,
        "top_k": 20,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        "max_tokens": 50,
    }


@pytest.mark.parametrize(
    ("text", "reasoning", "tools", "message"),
    [
        ("plain text", False, True, {"role": "assistant", "content": "plain text"}),
        ("", False, False, {"role": "assistant", "content": None}),
        (
            '<tool_call> {"name": "f", "arguments": {"a": 1}} </tool_call>',
            False,
            True,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "K0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
        ),
        (
            'say <tool_call>{"id": "own", "name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}',
            False,
            True,
            {
                "role": "assistant",
                "content": "say ",
                "tool_calls": [
                    {"id": "own", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "K1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
        ),
        (
            "<tool_call> not json </tool_call>",
            False,
            True,
            {"role": "assistant", "content": "<tool_call> not json </tool_call>"},
        ),
        (
            '<tool_call> {"name": "f"} </tool_call>',
            False,
            False,
            {"role": "assistant", "content": '<tool_call> {"name": "f"} </tool_call>'},
        ),
        ("<think> why </think> so", True, False, {"role": "assistant", "content": " so", "reasoning": " why "}),
        ("<think> still thinking", True, False, {"role": "assistant", "content": None, "reasoning": " still thinking"}),
        ("no tags at all", True, False, {"role": "assistant", "content": "no tags at all"}),
        ("why</think>answer", True, False, {"role": "assistant", "content": "answer", "reasoning": "why"}),
    ],
)
def test_the_whole_text_is_parsed_as_the_worker_parses_it(
    text: str, reasoning: bool, tools: bool, message: dict[str, Any]
) -> None:
    assert parse_message(text, reasoning=reasoning, tools=tools, known_ids=["K0", "K1"]) == message


def test_without_a_known_id_a_tool_call_gets_a_new_one() -> None:
    (call,) = parse_message('<tool_call>{"name": "f", "arguments": {}}</tool_call>', reasoning=False, tools=True)[
        "tool_calls"
    ]
    assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) > 20


@pytest.mark.parametrize("conversation", ["parse me", "parse me [answer_words=4]", "parse me [reasoning_words=3]"])
def test_the_fake_models_raw_text_parses_to_the_fake_workers_message(conversation: str) -> None:
    """The plugin's parsers and the fake worker's agree, so a continued fake answer equals an uninterrupted one."""
    from nemo_gym_checkpoint_plugin.testing.fake_answers import Deltas, message_of

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    for tool_result in (False, True):
        messages = [{"role": "user", "content": conversation}]
        if tool_result:
            messages += [{"role": "assistant", "content": None}, {"role": "tool", "content": "cold"}]
        answer = answer_for(Vocabulary(), messages, tools, conversation, len(messages) // 2)
        deltas = Deltas(answer, reasoning_parser=True)
        worker = message_of([deltas.delta(i) for i in range(len(answer))])
        ours = parse_message("".join(answer.pieces), reasoning=True, tools=True)
        assert ours == worker


def chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None, **top: Any) -> dict[str, Any]:
    entries = [{"token": f"token_id:{t}", "logprob": -0.1 * t, "bytes": [], "top_logprobs": []} for t in ids]
    return {
        "id": "chatcmpl-1",
        "created": 5,
        "model": "m",
        **top,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": {"content": entries}, "finish_reason": finish, "token_ids": ids}
        ],
    }


def test_the_streamed_chunks_assemble_into_the_whole_answer_carrying_what_was_asked() -> None:
    generation = Generation(None, {}, digest="0" * 64)
    generation.add_chat_chunk(chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1, 2, 3]))
    generation.add_chat_chunk(chunk({"content": "Hi"}, [7]))
    generation.add_chat_chunk(
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
                ]
            },
            [8],
        )
    )
    more = {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    generation.add_chat_chunk(chunk(more, [9], "tool_calls"))
    generation.add_chat_chunk(
        {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    )
    assert generation.cuttable and generation.snapshot().tokens == 3
    plain = generation.assemble({})
    assert plain == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "logprobs": None,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
                },
            }
        ],
    }
    asked = generation.assemble({"logprobs": True, "return_token_ids": True})
    assert asked["prompt_token_ids"] == [1, 2, 3] and asked["choices"][0]["token_ids"] == [7, 8, 9]
    assert [e["token"] for e in asked["choices"][0]["logprobs"]["content"]] == [
        "token_id:7",
        "token_id:8",
        "token_id:9",
    ]


def a_cut() -> dict[str, Any]:
    generation = Generation(None, {"temperature": 1.0}, digest="a" * 64)
    generation.add_chat_chunk(chunk({"content": "x"}, [4, 5], prompt_token_ids=[1, 2]))
    record = generation.cut_record(generation.snapshot())
    assert record is not None
    return record


def test_a_cut_is_the_prefix_at_its_snapshot_and_its_digest_covers_it() -> None:
    generation = Generation(None, {}, digest="a" * 64)
    generation.add_chat_chunk(chunk({"content": "x"}, [4, 5], prompt_token_ids=[1, 2]))
    snapshot = generation.snapshot()
    generation.add_chat_chunk(chunk({"content": "y"}, [6], "stop"))  # arrives after the snapshot
    record = generation.cut_record(snapshot)
    assert record is not None and record["token_ids"] == [4, 5] and len(record["logprobs"]) == 2
    assert record["text"] == "x" and record["finish_reason"] is None
    assert record["prefix_sha256"] == cut_digest(record)
    finished = generation.cut_record(generation.snapshot())
    assert finished is not None and finished["finish_reason"] == "stop" and finished["text"] == "xy"


def test_the_request_digest_is_of_the_sorted_json_the_caller_sent_and_none_without_json() -> None:
    import hashlib

    one = Generation(b'{"b": 1, "a": [2, {"d": 3, "c": 4}]}', {})
    other = Generation(b'{"a":[2,{"c":4,"d":3}],"b":1}', {})
    sorted_json = b'{"a":[2,{"c":4,"d":3}],"b":1}'
    assert one.request_sha256 == other.request_sha256 == hashlib.sha256(sorted_json).hexdigest()
    broken = Generation(b"{not json", {})
    assert broken.request_sha256 is None and broken.cut_record(broken.snapshot()) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda c: c.update(token_ids=[4, 6]), "prefix_sha256"),
        (lambda c: c.update(logprobs=c["logprobs"][:1]), "one per token id"),
        (lambda c: c.update(prompt_token_ids=[]), "prompt_token_ids"),
        (lambda c: c.update(request_sha256="nope"), "request_sha256"),
        (lambda c: c.pop("sampling"), "sampling"),
    ],
)
def test_a_restored_cut_that_fails_its_checks_is_refused_naming_its_episode(change: Any, why: str) -> None:
    cut = a_cut()
    change(cut)
    book = CutBook(ON, None, lambda: None)
    with pytest.raises(InvalidCheckpointState, match=why) as refused:
        book.checked({"r-a1": ("r", cut)})
    assert "episode r" in str(refused.value) and book.pending() == []
    book.keep(book.checked({"r-a1": ("r", copy.deepcopy(a_cut()))}))
    assert book.pending() == ["r-a1"]


def test_cut_records_keep_json_types() -> None:
    record = a_cut()
    assert json.loads(json.dumps(record)) == record
