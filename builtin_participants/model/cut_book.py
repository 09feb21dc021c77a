"""One model server's generation cuts: the calls it streams, the cuts it exports, the restored cuts it continues.

docs/protocol.md, "Generation cuts"; the model participant (``calls.py``) keeps one ``CutBook``
when its block says ``checkpoint_generation_cuts`` (``cut_settings.py``).

- **Streaming**: the book replaces the server's ``_resolve_client`` (``vllm_model``'s choice of a
  worker client per session) with one that returns the chosen client wrapped: its
  ``create_chat_completion`` streams a cuttable call (``cut_stream.py``) into the model call's
  ``Generation`` and returns the whole answer; a call never cut (``never_cut_reason``) goes to
  the worker as before. Gym's own code is not touched.
- **Export**: one cut per in-scope episode whose call is generating here (the worker gave its
  prompt's token ids), and every restored cut not yet continued (an episode restored earlier and
  not started). A snapshot costs list lengths in the event loop; the record is built in the writer,
  only when the cut's ``version`` changed since the last checkpoint (``model_records.py``).
- **Continue**: the first call of a restored attempt whose request digest and sampling match its
  cut continues it (``cut_continue.py``); a call whose digest differs is generated from scratch
  (the cut waits for its own call); a continuation that fails is generated from scratch.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_continue import ContinuationFailed, continue_chat
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_freeze import WorkerFreeze
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_settings import (
    NEVER_CUT,
    CutSettings,
    never_cut_reason,
    sampling,
    unknown_fields,
)
from nemo_gym_checkpoint_plugin.builtin_participants.model.cut_stream import (
    Generation,
    Snapshot,
    cut_digest,
    request_sha256,
    stream_chat,
)
from nemo_gym_checkpoint_plugin.builtin_participants.shared.attempts import RetiredBy
from nemo_gym_checkpoint_plugin.builtin_participants.shared.versions import Same

from nemo_gym_checkpoint_plugin._errors import InvalidCheckpointState
from nemo_gym_checkpoint_plugin._identity import EpisodeId

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin.builtin_participants.model.calls import ModelCall

__all__ = ["CUT_FIELD", "CutBook", "Snapshot", "request_sha256"]

logger = logging.getLogger(__name__)

# The field of a model record that holds its episode's cut.
CUT_FIELD = "generation_cut"
_HEX64 = re.compile(r"[0-9a-f]{64}").fullmatch


class _CutClient:
    """A worker client whose chat calls go through the book (everything else is the client's own)."""

    def __init__(self, inner: Any, book: CutBook) -> None:
        self._inner = inner
        self._book = book

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def create_chat_completion(self, **body: Any) -> Any:
        return await self._book.generate(self._inner, body)


class CutBook:
    """Generation cuts of one model server (used from its event loop; ``export``'s records from any thread)."""

    def __init__(self, settings: CutSettings, server: Any, current_call: Callable[[], ModelCall | None]) -> None:
        self.settings = settings
        self._current = current_call
        config = getattr(server, "config", None)
        self.reasoning = bool(getattr(config, "uses_reasoning_parser", False))
        self.restored: dict[str, dict[str, Any]] = {}  # replacement capture key -> its cut
        has_clients = bool(getattr(server, "_clients", None))
        self.freeze = WorkerFreeze(lambda: server._clients) if settings.freeze_worker and has_clients else None
        self.never_cut: Counter[str] = Counter()
        self.streamed_total = 0
        self.continued_total = 0
        self.tokens_continued_total = 0  # prefix tokens a continuation did not generate again
        self.mismatched_total = 0
        self.continuation_failed_total = 0
        self.exported_total = 0
        self._warned_fields: set[str] = set()
        if server is not None and hasattr(server, "_resolve_client"):
            resolve = server._resolve_client
            # vllm_model picks a worker client per session here; the instance attribute wraps its choice.
            server._resolve_client = lambda request: _CutClient(resolve(request), self)

    # -- the calls ---------------------------------------------------------------------------------

    async def generate(self, client: Any, body: dict[str, Any]) -> Any:
        call = self._current()
        key = call.key if call is not None else None
        reason = never_cut_reason(body, self.settings)
        if reason is not None or call is None or key is None or call.body is None:
            if reason is not None:
                self.never_cut[reason] += 1
                if reason == "unknown_field":
                    self._warn_fields(body)
            return await client.create_chat_completion(**body)
        asked = sampling(body)
        request = bytes(call.body)
        generation = Generation(request, asked)
        call.generation = generation
        cut = self._claim(key, generation, asked) if key in self.restored else None
        if cut is not None:
            try:
                answer = await continue_chat(
                    client, body, cut, generation, reasoning=self.reasoning, tool_parser=self.settings.tool_call_parser
                )
            except ContinuationFailed as exc:
                self.continuation_failed_total += 1
                logger.warning("generation cuts: could not continue the cut of %s (%s); generating it again", key, exc)
                generation = Generation(request, asked)
                call.generation = generation
            else:
                self.continued_total += 1
                self.tokens_continued_total += generation.continued_from
                return answer
        self.streamed_total += 1
        return await stream_chat(client, body, generation)

    def _claim(self, key: str, generation: Generation, asked: Mapping[str, Any]) -> dict[str, Any] | None:
        cut = self.restored.get(key)
        if cut is None:
            return None
        if cut["request_sha256"] != generation.request_sha256:
            self.mismatched_total += 1  # another call of the attempt: generated from scratch, the cut waits
            return None
        del self.restored[key]
        if cut["sampling"] != dict(asked):
            self.mismatched_total += 1
            logger.warning("generation cuts: %s is sent again with other sampling parameters; generating it again", key)
            return None
        return cut

    def _warn_fields(self, body: Mapping[str, Any]) -> None:
        fields = [f for f in unknown_fields(body) if f not in self._warned_fields]
        if fields:
            self._warned_fields.update(fields)
            logger.warning(
                "generation cuts: calls with the request fields %s are never cut (unknown to the cuts)", fields
            )

    # -- checkpoints -------------------------------------------------------------------------------

    def cuttable(self, calls: Iterable[ModelCall]) -> list[str]:
        """Keys of ``calls`` generating a cuttable generation here now."""
        return sorted(
            {c.key for c in calls if c.key is not None and c.generation is not None and c.generation.cuttable}
        )

    def snapshot(self, calls: Iterable[ModelCall], scope: frozenset[str] | None) -> dict[str, Any]:
        """``{capture key: cut source}`` of the episodes in ``scope`` (None: all): live generations, restored cuts.

        Taken in the event loop; ``record`` makes each one's record field in any thread.
        """
        found: dict[str, Any] = {key: cut for key, cut in self.restored.items() if scope is None or key in scope}
        for call in calls:
            key, generation = call.key, call.generation
            if key is None or generation is None or not generation.cuttable or (scope is not None and key not in scope):
                continue
            found[key] = (generation, generation.snapshot())
        self.exported_total += len(found)
        return found

    @staticmethod
    def version(source: Any) -> Any:
        """The version of one ``snapshot`` entry's record (``api.Versioned``), taken with the snapshot.

        A restored cut is a dict never changed: itself. A generation's cut is made of its lists (only
        ever grown, or replaced by a continuation) up to the snapshot's lengths and the snapshot's
        small fields: the generation, its lists and those.
        """
        if not isinstance(source, tuple):
            return Same(source)
        generation, snapshot = source
        return (
            Same(generation),
            Same(generation.prompt_token_ids),
            Same(generation.token_ids),
            Same(generation.logprobs),
            snapshot.tokens,
            Same(snapshot.content),
            snapshot.content_parts,
            Same(snapshot.reasoning),
            snapshot.reasoning_parts,
            snapshot.tool_calls,
            snapshot.finish_reason,
            snapshot.stop_reason,
            snapshot.response,
            snapshot.reasoning_field,
        )

    @staticmethod
    def record(source: Any) -> dict[str, Any] | None:
        """The record field of one ``snapshot`` entry (None: the call gives no cut)."""
        if isinstance(source, tuple):
            generation, snapshot = source
            return generation.cut_record(snapshot)
        return source

    # -- restore -----------------------------------------------------------------------------------

    @staticmethod
    def checked(cuts: Mapping[str, tuple[str, Any]]) -> dict[str, dict[str, Any]]:
        """``{replacement key: cut}`` of ``{replacement key: (checkpointed key, cut)}``; ``InvalidCheckpointState``."""
        return {replacement: _checked(checkpointed, cut) for replacement, (checkpointed, cut) in cuts.items()}

    def keep(self, cuts: Mapping[str, dict[str, Any]]) -> None:
        """Keep checked restored cuts until their call continues them (or their episode goes)."""
        self.restored.update(cuts)

    def pending(self) -> list[str]:
        return sorted(self.restored)

    def drop(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.restored.pop(key, None)

    def retired(self, episode_ids: list[EpisodeId]) -> None:
        retired = RetiredBy(episode_ids)
        for key in [k for k in self.restored if retired.key(k)]:
            del self.restored[key]

    def status(self, calls: Iterable[ModelCall]) -> dict[str, Any]:
        freeze = self.freeze
        return {
            "enabled": True,
            "tool_call_parser": self.settings.tool_call_parser,
            "reasoning_parser": self.reasoning,
            "never_cut": dict(NEVER_CUT),
            "generating": len(self.cuttable(calls)),
            "restored_pending": len(self.restored),
            "streamed_total": self.streamed_total,
            "continued_total": self.continued_total,
            "tokens_continued_total": self.tokens_continued_total,
            "mismatched_total": self.mismatched_total,
            "continuation_failed_total": self.continuation_failed_total,
            "exported_total": self.exported_total,
            "never_cut_total": dict(self.never_cut),
            "freeze_worker": None
            if freeze is None
            else {
                "workers": dict(freeze.supported),
                "frozen": freeze.frozen,
                "last_seconds": freeze.last_seconds,
                "timeouts_total": freeze.timeouts_total,
                "failures_total": freeze.failures_total,
            },
        }


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _checked(key: str, cut: Any) -> dict[str, Any]:
    """A restored cut after its shape and digest checks; ``InvalidCheckpointState`` naming the episode."""

    def refuse(what: str) -> InvalidCheckpointState:
        return InvalidCheckpointState(f"episode {key}: its generation cut {what}", episode=key)

    if not isinstance(cut, dict):
        raise refuse("is not an object")
    for field in ("request_sha256", "prefix_sha256"):
        if not isinstance(cut.get(field), str) or not _HEX64(cut[field]):
            raise refuse(f"has no {field} (64 hex digits)")
    if not _ints(cut.get("prompt_token_ids")) or not cut["prompt_token_ids"] or not _ints(cut.get("token_ids")):
        raise refuse("has no prompt_token_ids or token_ids (lists of ints)")
    logprobs = cut.get("logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(cut["token_ids"]):
        raise refuse("has logprobs that are not one per token id")
    if not isinstance(cut.get("sampling"), dict) or not isinstance(cut.get("response"), dict):
        raise refuse("has no sampling or response object")
    if not isinstance(cut.get("tool_calls", []), list):
        raise refuse("has tool_calls that are not a list")
    if cut_digest(cut) != cut["prefix_sha256"]:
        raise refuse("does not match its prefix_sha256")
    return cut
