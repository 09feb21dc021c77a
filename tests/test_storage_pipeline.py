"""The reading worker reads about a batch at a time and splits it at newlines: lines that straddle reads,
the line-length bound to the byte, truncation, count and digest all come out as line-by-line reading gives them."""

from __future__ import annotations

import hashlib
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_gym_checkpoint_plugin._storage import pipeline
from nemo_gym_checkpoint_plugin._storage.pipeline import HashingWriter, hashed_lines


def read_all(data: bytes, max_line: int) -> tuple[list[bytes], object]:
    items = list(hashed_lines(io.BytesIO(data), max_line))
    lines = [line for item in items[:-1] for line in item]
    return lines, items[-1]


def line_by_line(data: bytes, max_line: int) -> tuple[list[bytes], int, bool, bool]:
    """The reference: (complete lines read, their count, too_long, truncated) reading one line at a time."""
    lines = []
    handle = io.BytesIO(data)
    while line := handle.readline(max_line + 1):
        if len(line) > max_line:
            return lines, len(lines), True, False
        if not line.endswith(b"\n"):
            return lines, len(lines), False, True
        lines.append(line[:-1])
    return lines, len(lines), False, False


@settings(max_examples=300)
@given(
    st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"x")), max_size=12),
    st.booleans(),
    st.integers(min_value=1, max_value=9),
    st.integers(min_value=1, max_value=14),
)
def test_batched_reading_gives_what_line_by_line_reading_gives(
    lines: list[bytes], truncated: bool, batch: int, max_line: int
) -> None:
    data = b"".join(line + b"\n" for line in lines) + (b"tail" if truncated else b"")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "BATCH_BYTES", batch)  # reads split lines anywhere
        got, end = read_all(data, max_line)
    want, count, too_long, cut = line_by_line(data, max_line)
    assert (end.too_long, end.truncated, end.count) == (too_long, cut, count)
    if too_long:
        assert got == want[: len(got)]  # what came before the long line, never the line itself
    else:
        assert got == want
        assert end.digest == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("size", "refused"), [(9, False), (10, False), (11, True)])
def test_the_bound_counts_the_newline(size: int, refused: bool) -> None:
    data = b"ok\n" + b"7" * (size - 1) + b"\nnext\n"
    for batch in (1, 4, 1 << 20):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline, "BATCH_BYTES", batch)
            _, end = read_all(data, 10)
        assert end.too_long is refused and (end.count == 1 if refused else end.count == 3)


def test_the_writer_hashes_and_writes_whole_batches(tmp_path) -> None:  # noqa: ANN001
    lines = [b"%d" % i * (i % 50) + b"\n" for i in range(3000)]
    with pytest.MonkeyPatch.context() as patch, open(tmp_path / "out", "wb") as out:
        patch.setattr(pipeline, "BATCH_BYTES", 1000)
        sink = HashingWriter(out)
        for line in lines:
            sink.write(line)
        digest = sink.finish()
    data = (tmp_path / "out").read_bytes()
    assert data == b"".join(lines) and digest == hashlib.sha256(data).hexdigest()
