"""Generation cuts of one model server: its ``checkpoint_generation_cuts`` setting and what is never cut.

docs/protocol.md, "Generation cuts". Per model server (off by default), in its own block::

    policy_model:
      responses_api_models:
        vllm_model:
          checkpoint_generation_cuts: true          # or a mapping:
          # checkpoint_generation_cuts: {tool_call_parser: hermes, freeze_worker: true}

``true`` is ``{}``: cuts on, no tool-call parser (calls offering tools are then never cut),
``freeze_worker: true``. The value is checked when the server starts (with the checkpoint block
enabled): anything but a bool or a mapping of those keys, an unknown parser, or a server the
cuts cannot serve (``use_completions_api``, ``is_responses_native``, Gym's external token staging,
a server without ``vllm_model``'s worker clients) refuses to start naming the key.

A call is cut only when a continuation can honour its request exactly (``never_cut_reason``);
every other call is generated as before and, after a crash, regenerated. ``sampling`` is what a
continuation copies from the request and a cut records, so a continued call proves it is sent
with the same sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_gym_checkpoint_plugin._settings import SettingsError

__all__ = [
    "CUTS_KEY",
    "NEVER_CUT",
    "TOOL_CALL_PARSERS",
    "CutSettings",
    "cut_settings",
    "never_cut_reason",
    "refuse_bad_cuts",
    "sampling",
    "unknown_fields",
]

CUTS_KEY = "checkpoint_generation_cuts"
TOOL_CALL_PARSERS = ("hermes",)
_OPTIONS = ("tool_call_parser", "freeze_worker")

# What is never cut, by reason: said in ``status`` (``generation_cuts.never_cut``) and counted per reason.
NEVER_CUT: dict[str, str] = {
    "constrained_tool_choice": "tool_choice other than auto or none (a required or named tool call is guided decoding)",
    "response_format": "a response_format other than text (guided decoding)",
    "guided_decoding": "guided decoding: guided_json, guided_regex, guided_choice, guided_grammar, structural_tag, "
    "structured_outputs, logits_processors",
    "stop_strings": "stop strings (one could span the cut)",
    "bad_words": "bad_words (a banned sequence could span the cut)",
    "min_tokens": "min_tokens",
    "penalties": "presence_penalty or frequency_penalty (they count the prefix as output; a continuation sees it as "
    "prompt)",
    "seed": "a per-request seed (a continuation cannot resume its random stream)",
    "several_choices": "n above 1, best_of, use_beam_search",
    "top_logprobs": "top_logprobs above 0",
    "not_a_fresh_turn": "continue_final_message, add_generation_prompt: false or echo (the prompt is not a new "
    "assistant turn)",
    "tools_without_parser": "a call offering tools when no tool_call_parser is configured",
    "prompt_truncation": "truncate_prompt_tokens (the continued prompt is longer)",
    "unknown_field": "a request field generation cuts do not know (named in the log once)",
}

# Copied from the chat request into the continuation as they are (vLLM's sampling parameters).
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "logprobs",
    "top_logprobs",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "max_tokens",
    "max_completion_tokens",
)
# Chat-only fields: the prompt's token ids already hold what they did; a continuation drops them.
_CHAT_ONLY = (
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "reasoning_effort",
    "include_reasoning",
    "metadata",
    "user",
    "request_id",
    "add_special_tokens",
    "stream",
    "stream_options",
    "cache_salt",
    "store",
    "service_tier",
)
_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structural_tag",
    "structured_outputs",
    "logits_processors",
)
# Fields that block a cut whenever they hold anything but their neutral values.
_NEUTRAL: dict[str, tuple[str, tuple[Any, ...]]] = {
    "stop": ("stop_strings", (None, "", [])),
    "bad_words": ("bad_words", (None, [])),
    "min_tokens": ("min_tokens", (None, 0)),
    "presence_penalty": ("penalties", (None, 0)),
    "frequency_penalty": ("penalties", (None, 0)),
    "seed": ("seed", (None,)),
    "n": ("several_choices", (None, 1)),
    "best_of": ("several_choices", (None, 1)),
    "use_beam_search": ("several_choices", (None, False)),
    "echo": ("not_a_fresh_turn", (None, False)),
    "truncate_prompt_tokens": ("prompt_truncation", (None,)),
}
_KNOWN = frozenset({*_SAMPLING, *_CHAT_ONLY, *_GUIDED, *_NEUTRAL, "response_format"})


@dataclass(frozen=True)
class CutSettings:
    """One model server's generation cuts (``enabled`` False: the key is absent or false)."""

    enabled: bool = False
    tool_call_parser: str | None = None
    freeze_worker: bool = True


def _model_block(global_config: Any, server_name: str) -> Mapping[str, Any] | None:
    # Gym's config: OmegaConf containers or plain dicts, read by what they answer (``get``, ``values``).
    block: Any = global_config.get(server_name) if hasattr(global_config, "get") else None
    models: Any = block.get("responses_api_models") if hasattr(block, "get") else None
    if not hasattr(models, "values"):
        return None
    inner = next(iter(models.values()), None)
    return inner if hasattr(inner, "get") else None


def cut_settings(global_config: Any, server_name: str) -> CutSettings:
    """The validated setting of model server ``server_name``; ``SettingsError`` naming the key for a bad value."""
    inner = _model_block(global_config, server_name)
    value = inner.get(CUTS_KEY) if inner is not None else None
    if value is None or value is False:
        return CutSettings()
    if value is True:
        return CutSettings(enabled=True)
    if not hasattr(value, "keys"):
        raise SettingsError(f"{CUTS_KEY} must be true, false or a mapping of {list(_OPTIONS)}; got {value!r}")
    unknown = sorted(str(k) for k in value.keys() if k not in _OPTIONS)
    if unknown:
        raise SettingsError(f"{CUTS_KEY}: unknown keys {unknown} (known: {list(_OPTIONS)})")
    parser = value.get("tool_call_parser")
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise SettingsError(
            f"{CUTS_KEY}.tool_call_parser must be one of {list(TOOL_CALL_PARSERS)} or null; got {parser!r}"
        )
    freeze = value.get("freeze_worker", True)
    if not isinstance(freeze, bool):
        raise SettingsError(f"{CUTS_KEY}.freeze_worker must be true or false; got {freeze!r}")
    return CutSettings(enabled=True, tool_call_parser=parser, freeze_worker=freeze)


def refuse_bad_cuts(server_config: Any, global_config: Any) -> CutSettings:
    """Check the setting and the server it is set on (at startup); its settings, ``SettingsError`` when refused."""
    name = str(getattr(server_config, "name", "") or "")
    settings = cut_settings(global_config, name)
    if not settings.enabled:
        return settings
    for flag in ("use_completions_api", "is_responses_native"):
        if getattr(server_config, flag, False):
            raise SettingsError(f"{CUTS_KEY}: true is not supported with {flag}: true (cuts continue chat generations)")
    if not hasattr(server_config, "base_url"):
        raise SettingsError(
            f"{CUTS_KEY}: true needs a vllm_model server (its worker clients); {type(server_config).__name__} has none"
        )
    capture: Any = global_config.get("token_id_capture") if hasattr(global_config, "get") else None
    if hasattr(capture, "get") and capture.get("enabled") and capture.get("external_staging"):
        raise SettingsError(
            f"{CUTS_KEY}: true is not supported with token_id_capture.external_staging (staged calls are not streamed)"
        )
    return settings


def never_cut_reason(body: Mapping[str, Any], settings: CutSettings) -> str | None:
    """Why the chat request ``body`` (as the model server sends it to the worker) is never cut; None: it may be."""
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        return "constrained_tool_choice"
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, Mapping) or response_format.get("type") not in (None, "text")
    ):
        return "response_format"
    for field in _GUIDED:
        if body.get(field) is not None:
            return "guided_decoding"
    for field, (reason, neutral) in _NEUTRAL.items():
        if not _is_neutral(body.get(field), neutral):
            return reason
    if body.get("continue_final_message") or body.get("add_generation_prompt", True) is False:
        return "not_a_fresh_turn"
    top = body.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > 0:
        return "top_logprobs"
    if body.get("tools") and tool_choice != "none" and settings.tool_call_parser is None:
        return "tools_without_parser"
    if any(field not in _KNOWN for field in body):
        return "unknown_field"
    return None


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    # A bool is an int to Python: True never stands for 1 here, nor False for 0.
    if isinstance(value, bool):
        return any(isinstance(n, bool) and value == n for n in neutral)
    return any(not isinstance(n, bool) and n is not None and value == n for n in neutral)


def unknown_fields(body: Mapping[str, Any]) -> list[str]:
    """The fields of ``body`` generation cuts do not know (a call carrying any is never cut)."""
    return sorted(field for field in body if field not in _KNOWN)


def sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a continuation copies from ``body`` (and a cut records): its sampling parameters and what it asked back."""
    return {field: body[field] for field in _SAMPLING if field in body}
