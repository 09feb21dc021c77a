"""The model participant's records are versioned: a later checkpoint writes only the episodes whose record changed.

Here: the fingerprints of the capture files a record is read from (``CaptureDir.fingerprint``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_a_capture_file_s_fingerprint_changes_with_every_change_of_its_rows(tmp_path: Path) -> None:
    from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_files import TOKEN_ROWS, CaptureDir

    files = CaptureDir(tmp_path)
    assert files.fingerprint("r", TOKEN_ROWS) is None and files.read_lines("r", TOKEN_ROWS) == ([], None)
    files.append("r", TOKEN_ROWS, [("c1", b'{"model_call_id":"c1"}\n')])
    before = files.fingerprint("r", TOKEN_ROWS)
    lines, read = files.read_lines("r", TOKEN_ROWS)
    assert lines == [b'{"model_call_id":"c1"}'] and read == before == files.fingerprint("r", TOKEN_ROWS)
    # Replaced by rows of the same size (a row dropped, another written): another file, another fingerprint.
    files.replace("r", TOKEN_ROWS, [b'{"model_call_id":"c2"}\n'])
    assert files.fingerprint("r", TOKEN_ROWS) != before
    replaced = files.fingerprint("r", TOKEN_ROWS)
    files.append("r", TOKEN_ROWS, [("c3", b'{"model_call_id":"c3"}\n')])
    assert files.fingerprint("r", TOKEN_ROWS) not in (before, replaced)
    os.unlink(files.path("r", TOKEN_ROWS))
    assert files.fingerprint("r", TOKEN_ROWS) is None


def test_a_file_that_changed_while_it_was_read_gets_a_fingerprint_nothing_equals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nemo_gym_checkpoint_plugin.builtin_participants.model.capture_files import TOKEN_ROWS, CaptureDir

    files = CaptureDir(tmp_path)
    files.append("r", TOKEN_ROWS, [("c1", b'{"model_call_id":"c1"}\n')])
    real, seen = os.fstat, []

    def appended_meanwhile(descriptor: int) -> os.stat_result:
        status = real(descriptor)
        seen.append(status)
        if len(seen) == 1:  # read_lines' first look, before its read: a row is appended right after it
            with open(files.path("r", TOKEN_ROWS), "ab") as handle:
                handle.write(b'{"model_call_id":"c2"}\n')
        return status

    monkeypatch.setattr(os, "fstat", appended_meanwhile)
    lines, read = files.read_lines("r", TOKEN_ROWS)
    monkeypatch.setattr(os, "fstat", real)
    assert len(lines) == 2 and len(seen) == 2
    # The bytes read are neither the file as first looked at nor (in general) as it is: no fingerprint of
    # either may stand for them, else a later file equal to the first look would refer to these rows.
    first_look = (seen[0].st_dev, seen[0].st_ino, seen[0].st_size, seen[0].st_mtime_ns, seen[0].st_ctime_ns)
    now = files.fingerprint("r", TOKEN_ROWS)
    assert read not in (first_look, now) and files.read_lines("r", TOKEN_ROWS)[1] == now
