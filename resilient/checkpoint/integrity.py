"""The checksums of a checkpoint's bytes: xxh3-128 of a buffer and of a file, and a file's check.

The writer records them, the loader and ``resilient checkpoints --verify`` check them: one
definition, so the two sides cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from resilient.checkpoint.manifest import FileEntry
from resilient.errors import CheckpointError


def digest(data: memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def file_digest(path: Path, chunk: int = 16 << 20) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def verify_file(root: Path, f: FileEntry) -> None:
    """Size and whole-file xxh3 of one file (DCP files: their bytes are read by DCP itself)."""
    path = root / f.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing") from None
    if size != f.size:
        raise CheckpointError(f"{path}: {size} bytes, the manifest says {f.size} (truncated?)")
    if file_digest(path) != f.xxh3:
        raise CheckpointError(f"{path}: checksum mismatch (corrupt)")
