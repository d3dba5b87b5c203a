"""The manifest of a committed checkpoint and the directory layout around it.

::

    <root>/step-00000100/manifest.json        written last, before the directory is renamed
    <root>/step-00000100/rank00000.bin         tensors that changed since the previous checkpoint
    <root>/step-00000100.<token>.tmp/          a save in progress (or left by a crashed writer)

A checkpoint is committed iff its directory has its final name: the rename is atomic and happens
after every file and the manifest are fsynced. The manifest lists every file the checkpoint needs
(including files of earlier checkpoints that unchanged tensors still point to) with its size and
xxh3-128 checksum, so it verifies on its own. Paths are relative to the root and may not escape it.

A manifest is parsed into strict models before anything it describes is allocated or read: known
dtypes only, non-negative sizes and offsets, each tensor's bytes equal to its shape times its
dtype's size, one entry per rank of its world size. It carries the xxh3-128 of its own content
(``digest``), so an edited or corrupted manifest is refused as such (it is not a signature: whoever
can write the directory can recompute it; see docs/trust.md). Manifests written before the digest
existed have none and are read as before.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from resilient.errors import CheckpointError

FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^step-(\d{8,})\.(.+)\.tmp$")
_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_name(step: int, token: str) -> str:
    if not _SAFE.match(token):
        raise CheckpointError(f"checkpoint token {token!r} may only use letters, digits, '.', '_', '-'")
    return f"{step_name(step)}.{token}.tmp"


def check_path(path: str) -> str:
    """A manifest path must name a file inside a step directory of the root: nothing else is read."""
    parts = path.split("/")
    if (
        len(parts) < 2
        or not _STEP_DIR.match(parts[0])
        or any(p in ("", ".", "..") or not _SAFE.match(p) for p in parts[1:])
    ):
        raise CheckpointError(f"manifest path {path!r} escapes the checkpoint directory; refusing to read it")
    return path


def _field_path(path: str) -> str:
    try:
        return check_path(path)
    except CheckpointError as e:  # (as a ValueError, pydantic names the field)
        raise ValueError(str(e)) from None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_XXH3 = r"^[0-9a-f]{32}$"


class FileEntry(_Model):
    path: str
    size: int = Field(ge=0)
    xxh3: str = Field(pattern=_XXH3)

    _check = field_validator("path")(classmethod(lambda cls, v: _field_path(v)))


class TensorEntry(_Model):
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    xxh3: str = Field(pattern=_XXH3)

    _check = field_validator("file")(classmethod(lambda cls, v: _field_path(v)))

    @model_validator(mode="after")
    def _size(self) -> TensorEntry:
        from resilient.checkpoint.codec import itemsize  # (torch: only where tensors are read)

        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.key}: negative dimension in shape {list(self.shape)}")
        want = math.prod(self.shape) * itemsize(self.dtype)
        if want != self.nbytes:
            raise ValueError(
                f"tensor {self.key}: shape {list(self.shape)} of {self.dtype} is {want} bytes, "
                f"nbytes says {self.nbytes}"
            )
        return self


class RankEntry(_Model):
    rank: int = Field(ge=0)
    skeleton: Any
    tensors: list[TensorEntry]
    files: list[FileEntry]  # every file this rank's tensors live in, written now or earlier
    sharded: list[str] = []  # of those, the DCP files (DTensor/FSDP2 state) this rank wrote


class Manifest(_Model):
    format: int = FORMAT
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    created: float
    ranks: list[RankEntry]
    extra: dict[str, Any] = {}
    digest: str = ""  # xxh3-128 of the rest (see content_digest); "" in manifests older than it

    @model_validator(mode="after")
    def _one_entry_per_rank(self) -> Manifest:
        got = sorted(r.rank for r in self.ranks)
        if len(got) != self.world_size or got != list(range(len(got))):  # (never a list of world_size)
            raise ValueError(
                f"ranks {got[:8]}{'...' if len(got) > 8 else ''} for world size {self.world_size}"
            )
        return self

    def content_digest(self) -> str:
        return manifest_digest(json.loads(self.model_dump_json()))

    def sealed(self) -> Manifest:
        """This manifest with its own digest, as it is written."""
        return self.model_copy(update={"digest": self.content_digest()})

    def files(self) -> list[FileEntry]:
        seen: dict[str, FileEntry] = {}
        for r in self.ranks:
            for f in r.files:
                seen.setdefault(f.path, f)
        return list(seen.values())

    def sharded_files(self) -> list[FileEntry]:
        """Every rank's DCP files: a resharding load may read any of them."""
        out = []
        for r in self.ranks:
            mine = set(r.sharded)
            out += [f for f in r.files if f.path in mine]
        return out

    def rank(self, rank: int) -> RankEntry:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise CheckpointError(f"checkpoint {step_name(self.step)} has no entry for rank {rank}")


def manifest_digest(obj: dict[str, Any]) -> str:
    """xxh3-128 of a manifest's JSON object without its digest, keys sorted: checked on the raw
    JSON, before any field is trusted."""
    body = {k: v for k, v in obj.items() if k != "digest"}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


_CACHE: dict[Path, tuple[int, int, Manifest]] = {}


def read_manifest(path: Path) -> Manifest:
    """Parse and validate a manifest. Committed manifests never change, so a parsed one is reused
    while the file's (mtime, size) is unchanged: retention and incremental saves read the same few
    manifests at every save."""
    try:
        st = path.stat()
        hit = _CACHE.get(path)
        if hit is not None and hit[:2] == (st.st_mtime_ns, st.st_size):
            return hit[2]
        obj = json.loads(path.read_bytes())
        if isinstance(obj, dict) and obj.get("digest") and obj["digest"] != manifest_digest(obj):
            raise CheckpointError(
                f"{path}: manifest edited or corrupt: its content does not match its digest"
            )
        m = Manifest.model_validate(obj)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: manifest missing") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "(top level)"
        raise CheckpointError(f"{path}: manifest field {where}: {err['msg']}") from None
    except (OSError, ValueError, RecursionError) as e:  # (ValueError: not JSON, or not UTF-8)
        raise CheckpointError(f"{path}: manifest unreadable: {type(e).__name__}: {e}") from None
    if m.format != FORMAT:
        raise CheckpointError(f"{path}: manifest format {m.format}, this version reads {FORMAT}")
    if len(_CACHE) >= 64:
        _CACHE.clear()
    _CACHE[path] = (st.st_mtime_ns, st.st_size, m)
    return m


def write_json_durable(path: Path, data: Any, *, durable: bool = True) -> None:
    """Write ``data`` (an object, or JSON text already) to ``path`` through a temporary name,
    fsynced, then renamed. ``json.dumps`` (C encoder), not ``json.dump`` (pure-Python streaming)."""
    text = data if isinstance(data, str | bytes) else json.dumps(data, separators=(",", ":"))
    raw = text.encode() if isinstance(text, str) else text
    tmp = path.with_name(path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a directory's new entries durable, not only the files' contents."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed directory, newest first."""
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps, reverse=True)


def quarantine(root: Path, step: int) -> Path | None:
    """Move a committed checkpoint that failed verification out of the committed set: renamed to
    ``step-N.rejected-<unix time>`` (kept for inspection). Retention no longer counts it as one of
    the ``keep`` newest, and a later save of the same step (the run replays it) commits afresh
    instead of keeping the bad copy. Returns the new path, or None if it is gone already."""
    src = root / step_name(step)
    dst = root / f"{step_name(step)}.rejected-{int(time.time())}"
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return None
    fsync_dir(root)
    return dst


def tmp_dirs(root: Path) -> list[tuple[int, str, Path]]:
    if not root.is_dir():
        return []
    return [(int(m.group(1)), m.group(2), p) for p in root.iterdir() if (m := _TMP_DIR.match(p.name))]
