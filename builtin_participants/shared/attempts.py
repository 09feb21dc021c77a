"""The attempts a retire names, over episode ids and capture keys alike, without building ``EpisodeId``s.

A retire names each listed attempt and every earlier attempt of its rollout (docs/protocol.md
"Retire, forget, restore marks"). The participants hold thousands of episodes by capture key
(``r`` / ``r-aN``); parsing a key back into a validated ``EpisodeId`` costs microseconds each, so
the rule is applied to the key's two parts directly.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from nemo_gym_checkpoint_plugin._identity import EpisodeId

__all__ = ["RETIRE_CONCURRENCY", "RetiredBy", "split_key", "stop_bounded", "stopping_until_done"]

# How many retired attempts a participant stops at once: each cancelled one runs its cleanup (closing
# sessions over HTTP, answering its caller), and a retire may name thousands.
RETIRE_CONCURRENCY = 256


async def stop_bounded[T](
    victims: Iterable[T], stop: Callable[[T], bool], ended: Callable[[T], Awaitable[Any]], bound: int
) -> None:
    """Stop ``victims`` concurrently, at most ``bound`` at a time, in order; return once all ``stop`` began ended.

    ``stop(victim)`` starts stopping it (a cancel) and says whether it did (False: nothing to stop, or
    an earlier retire stopped it already); ``ended(victim)`` waits until it ended. No task per victim:
    the window is a queue, the oldest awaited before the next is stopped.
    """
    window: deque[T] = deque()
    for victim in victims:
        while len(window) >= bound:
            await ended(window.popleft())
        if stop(victim):
            window.append(victim)
    while window:
        await ended(window.popleft())


def stopping_until_done(stopping: dict[str, asyncio.Task[Any]], key: str, task: asyncio.Task[Any]) -> None:
    """Keep ``task`` (cancelled by a retire) in ``stopping`` under ``key`` until it has ended."""
    stopping[key] = task
    task.add_done_callback(lambda _done: stopping.pop(key, None))


def split_key(key: str) -> tuple[str, int]:
    """``(rollout_id, attempt)`` of a capture key: ``r`` is attempt 0 of ``r``, ``r-aN`` attempt N (N >= 1)."""
    prefix, sep, digits = key.rpartition("-a")
    # The suffix Gym reserves: -a followed by a number without a leading zero (-a0 and -a01 are plain ids).
    if sep and prefix and digits.isdigit() and digits.isascii() and digits[0] != "0":
        return prefix, int(digits)
    return key, 0


class RetiredBy:
    """The attempts named by a retire of ``episode_ids``: per rollout, every attempt up to the highest named."""

    __slots__ = ("limits",)

    def __init__(self, episode_ids: Iterable[EpisodeId]) -> None:
        self.limits: dict[str, int] = {}
        for episode_id in episode_ids:
            rollout, attempt = episode_id.rollout_id, episode_id.attempt
            if attempt > self.limits.get(rollout, -1):
                self.limits[rollout] = attempt

    def __call__(self, episode_id: EpisodeId) -> bool:
        return episode_id.attempt <= self.limits.get(episode_id.rollout_id, -1)

    def key(self, key: str) -> bool:
        rollout, attempt = split_key(key)
        return attempt <= self.limits.get(rollout, -1)
