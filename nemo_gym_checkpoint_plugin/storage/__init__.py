"""Checkpoint storage: the record codec, the on-disk layout, the streaming writer and reader."""

from __future__ import annotations

from .codec import NotJSON, decode_line, encode_line
from .layout import MANIFEST_NAME, SCHEMA_VERSION, participant_dir
from .local import LocalStorage, LocalStoragePlugin
from .reader import RestoredCheckpoint, capture_key_of, load_manifest, read_checkpoint
from .writer import CheckpointWriter, WriteStopped

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
