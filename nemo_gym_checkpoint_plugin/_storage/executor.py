"""The storage executor: a few named threads that run every checkpoint read and write.

A filesystem call can hang (a FIFO someone left, a dead NFS server). Run on the loop's
default executor, a few such calls would take every thread that ``asyncio.to_thread``
and Gym's own work share. Storage work gets its own bounded pool instead: a stuck call
can at worst hold these threads, and later storage work waits for them, while the rest
of the server keeps its default pool.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["STORAGE_THREADS", "run_storage", "storage_executor"]

STORAGE_THREADS = 4
THREAD_PREFIX = "checkpoint-storage"

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def storage_executor() -> ThreadPoolExecutor:
    """The process's storage pool (``STORAGE_THREADS`` threads named ``checkpoint-storage_<n>``)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=STORAGE_THREADS, thread_name_prefix=THREAD_PREFIX)
        return _executor


async def run_storage[T](function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``function(*args, **kwargs)`` on the storage pool and await its result (context carried, like
    ``asyncio.to_thread``)."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    return await loop.run_in_executor(storage_executor(), functools.partial(context.run, function, *args, **kwargs))
