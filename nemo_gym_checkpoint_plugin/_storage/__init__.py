"""Checkpoint storage: the on-disk format (shared) and the built-in backend (server runtime).

The format, which the controller side reads too (offline ``verify``, the participants index),
is ``codec``, ``layout``, ``files``, ``pipeline``, ``reader`` and ``index``. The writer, the
``local`` backend plugin and the storage executor are the server runtime's: importing this
package does not load them (they are imported on first use of their names below).
"""

from __future__ import annotations

import importlib
from typing import Any

from .codec import NotJSON, decode_line, encode_line
from .layout import MANIFEST_NAME, SCHEMA_VERSION, participant_dir
from .reader import RestoredCheckpoint, capture_key_of, load_manifest, read_checkpoint

__all__ = [
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "CheckpointWriter",
    "LocalStorage",
    "LocalStoragePlugin",
    "NotJSON",
    "RestoredCheckpoint",
    "WriteStopped",
    "capture_key_of",
    "decode_line",
    "encode_line",
    "load_manifest",
    "participant_dir",
    "read_checkpoint",
]

# Server-runtime names, loaded lazily so that the controller side never imports the writer.
_RUNTIME = {
    "CheckpointWriter": ".writer",
    "WriteStopped": ".writer",
    "LocalStorage": ".local",
    "LocalStoragePlugin": ".local",
}


def __getattr__(name: str) -> Any:
    module = _RUNTIME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
