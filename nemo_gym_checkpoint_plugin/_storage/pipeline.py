"""Overlap encoding with hashing and I/O on two cores.

Encoding and decoding records hold the GIL; sha256 over large buffers, file reads,
writes and fsync release it. So the records file is hashed and written (or read and
hashed) by one worker thread while the caller's thread encodes (or decodes) the next
records. Lines travel in batches of about ``BATCH_BYTES`` through a bounded queue, so
memory stays at a few batches whatever the file size. The worker hashes and writes (or
reads, hashes and splits) a whole batch at a time: sha256 releases the GIL for each call, and
taking it back costs a switch interval while the other thread encodes, so once per batch,
never once per line. The worker also flushes written
data to disk as it goes (``sync_file_range`` where Linux offers it: the disk writes while
this process encodes, without waiting), so the final fsync has little left to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO

__all__ = ["HashingWriter", "hashed_lines"]

BATCH_BYTES = 1 << 20
SYNC_BYTES = 8 << 20
_DEPTH = 4
_IOV_MAX = 1024
_DONE = object()


def _start_writeback_function() -> Callable[[int, int, int], None]:
    """``start_writeback(fd, offset, length)``: ask the kernel to begin writing that range, without waiting.

    Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` through libc; elsewhere a no-op (the
    final fsync then does all the work). Never a correctness matter: fsync comes after.
    """
    if sys.platform != "linux":
        return lambda fd, offset, length: None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return lambda fd, offset, length: None
    call.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    call.restype = ctypes.c_int
    sync_file_range_write = 2

    def start_writeback(fd: int, offset: int, length: int) -> None:
        call(fd, offset, length, sync_file_range_write)

    return start_writeback


_start_writeback = _start_writeback_function()


class HashingWriter:
    """Append lines to ``out`` and hash them in a worker thread; ``finish()`` makes them durable.

    ``write`` raises the worker's error (disk full, ...) as soon as it is known. After an
    error or ``abort()`` the writer is unusable; the caller removes the file.
    """

    def __init__(self, out: BinaryIO, *, durable: bool = True) -> None:
        # durable=False: a spool file, uploaded and removed afterwards; no writeback, no fsync.
        self._out = out
        self._durable = durable
        self._sha = hashlib.sha256()
        self._queue: queue.Queue[object] = queue.Queue(maxsize=_DEPTH)
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._error: BaseException | None = None
        self._abort = threading.Event()
        self._worker = threading.Thread(target=self._run, name="checkpoint-records-writer", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        fd = self._out.fileno()
        unsynced = 0
        synced_to = 0
        try:
            while True:
                batch = self._queue.get()
                if batch is _DONE or self._abort.is_set():
                    return
                assert isinstance(batch, list)
                size = self._write_batch(fd, batch)
                unsynced += size
                if self._durable and unsynced >= SYNC_BYTES:
                    self._out.flush()
                    _start_writeback(fd, synced_to, unsynced)
                    synced_to += unsynced
                    unsynced = 0
        except BaseException as exc:  # handed to the caller's thread
            self._error = exc

    def _write_batch(self, fd: int, batch: list[bytes]) -> int:
        """Hash and write one batch without joining it (no copy of its bytes): one ``writev`` as a rule."""
        update = self._sha.update
        for line in batch:
            update(line)
        size = 0
        views: list[bytes | memoryview] = list(batch)
        first = 0
        while first < len(views):
            written = os.writev(fd, views[first : first + _IOV_MAX])
            if not written:
                raise OSError(errno.EIO, "the records file took no byte of a write", None)
            size += written
            # A short write (a signal, a full disk's last bytes): continue from the first byte not written.
            while first < len(views) and written >= len(views[first]):
                written -= len(views[first])
                first += 1
            if written:
                views[first] = memoryview(views[first])[written:]
        return size

    def _send(self, item: object) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def write(self, line: bytes) -> None:
        self._batch.append(line)
        self._batch_bytes += len(line)
        if self._batch_bytes >= BATCH_BYTES:
            self._send(self._batch)
            self._batch, self._batch_bytes = [], 0

    def finish(self) -> str:
        """Write what is left, wait for the worker, fsync; return the hex digest of everything written."""
        if self._batch:
            self._send(self._batch)
            self._batch = []
        self._send(_DONE)
        self._worker.join()
        if self._error is not None:
            raise self._error
        self._out.flush()
        if self._durable:
            os.fsync(self._out.fileno())
        return self._sha.hexdigest()

    def abort(self) -> None:
        """Stop the worker without finishing (the caller removes the file)."""
        self._abort.set()
        try:
            self._queue.put_nowait(_DONE)
        except queue.Full:
            pass
        self._worker.join()


class _ReadEnd:
    """What the reading worker found at the end: the digest and count, or the problem."""

    def __init__(
        self, digest: str, count: int, truncated: bool, error: BaseException | None, too_long: bool = False
    ) -> None:
        self.digest, self.count, self.truncated, self.error = digest, count, truncated, error
        self.too_long = too_long


def _split_lines(carry: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of ``carry + chunk`` (without their newline), and what follows the last newline.

    ``bytes.find`` of one byte is a memchr; ``bytes.split`` of one byte is several times slower on
    long lines (CPython's split and count do not use memchr), and holds the GIL the decoding thread
    needs. Only the line that straddles the previous chunk is joined: nothing else is copied twice.
    """
    lines: list[bytes] = []
    find, append = chunk.find, lines.append
    end = find(b"\n")
    if end == -1:
        return lines, carry + chunk
    append(carry + chunk[:end] if carry else chunk[:end])
    start = end + 1
    while (end := find(b"\n", start)) != -1:
        append(chunk[start:end])
        start = end + 1
    return lines, chunk[start:]


def hashed_lines(handle: BinaryIO, max_line: int) -> Iterator[list[bytes] | _ReadEnd]:
    """Yield batches of lines (without their newline) read and hashed by a worker thread, then one ``_ReadEnd``.

    The worker reads about ``BATCH_BYTES`` at a time, hashes it in one call and splits it at
    newlines. A line longer than ``max_line`` bytes (newline included) ends the read with
    ``too_long`` after at most ``max_line + 1`` of its bytes were read: a file of one
    endless line never sits in memory whole. Closing the generator early stops the worker.
    """
    batches: queue.Queue[list[bytes] | _ReadEnd] = queue.Queue(maxsize=_DEPTH)
    stop = threading.Event()

    def put(item: list[bytes] | _ReadEnd) -> bool:
        while not stop.is_set():
            try:
                batches.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        sha = hashlib.sha256()
        count = 0
        read = handle.read
        limit = max_line + 1
        carry = b""  # the start of a line whose newline is not read yet
        try:
            while True:
                # Never more than ``limit`` bytes of one unfinished line: an endless line is refused early.
                chunk = read(min(BATCH_BYTES, limit - len(carry)))
                if not chunk:
                    break
                sha.update(chunk)
                lines, carry = _split_lines(carry, chunk)
                # Every complete line (plus its newline) within the bound; else the first one beyond it.
                if lines and max(map(len, lines)) >= max_line:
                    long = next(index for index, line in enumerate(lines) if len(line) >= max_line)
                    put(_ReadEnd("", count + long, False, None, too_long=True))
                    return
                if len(carry) >= limit:
                    put(_ReadEnd("", count + len(lines), False, None, too_long=True))
                    return
                if lines:
                    count += len(lines)
                    if not put(lines):
                        return
            put(_ReadEnd(sha.hexdigest(), count, bool(carry), None))
        except BaseException as exc:  # handed to the consumer
            put(_ReadEnd("", count, bool(carry), exc))

    worker = threading.Thread(target=run, name="checkpoint-records-reader", daemon=True)
    worker.start()
    try:
        while True:
            item = batches.get()
            yield item
            if isinstance(item, _ReadEnd):
                return
    finally:
        stop.set()
        worker.join()
