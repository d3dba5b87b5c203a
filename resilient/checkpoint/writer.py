"""Persisting one rank's staged tensors, committing a step, and retention; the thread writer.

Every rank writes ``rank<R>.bin`` (only the tensors whose bytes changed since the newest committed
checkpoint) and a small part file into the step's temporary directory. Rank 0 waits for every
part, writes the manifest, fsyncs, and renames the directory to its final name: the commit is the
last thing written. Retention then keeps the newest ``keep`` checkpoints plus every older one that a
kept checkpoint still points to.

:func:`persist` is that sequence for one save; :class:`ThreadWriter` runs it on the
``Checkpointer``'s background thread and the writer process (``procwriter.py``) runs it in a child.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from loguru import logger

from resilient import points
from resilient.checkpoint.integrity import digest, file_digest
from resilient.checkpoint.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    RankEntry,
    TensorEntry,
    committed_steps,
    fsync_dir,
    read_manifest,
    step_name,
    tmp_dirs,
    tmp_name,
    write_json_durable,
)
from resilient.checkpoint.staging import Arena, Slot, StagedBytes, aligned
from resilient.errors import CheckpointError

_ZEROS = bytes(64)
# Smaller tensors are always rewritten: referencing them would pin a whole older checkpoint
# directory on disk for the sake of a few kilobytes (an RNG state that did not move, a counter).
DEDUPE_MIN_BYTES = 64 << 10


def part_name(rank: int) -> str:
    return f"rank{rank:05d}.part.json"


def error_name(rank: int) -> str:
    return f"rank{rank:05d}.error.json"


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def newest_base(root: Path, rank: int) -> RankEntry | None:
    """This rank's entry in the newest committed checkpoint, the base of an incremental save."""
    for step in committed_steps(root):
        try:
            return read_manifest(root / step_name(step) / MANIFEST).rank(rank)
        except CheckpointError:
            continue
    return None


def persist_rank(
    root: Path,
    step: int,
    token: str,
    rank: int,
    staged: StagedBytes,
    slots: list[Slot],
    skeleton: Any,
    *,
    incremental: bool = True,
    sharded_files: Sequence[str] = (),
) -> RankEntry:
    """Write this rank's tensors and its part file into the step's temporary directory.

    ``sharded_files`` (relative to the temporary directory) were written there already by DCP;
    they are checksummed into this rank's entry.
    """
    tmp = root / tmp_name(step, token)
    tmp.mkdir(parents=True, exist_ok=True)
    base = newest_base(root, rank) if incremental else None
    base_tensors = {t.key: t for t in base.tensors} if base else {}
    base_files = {f.path: f for f in base.files} if base else {}
    own = f"{step_name(step)}/rank{rank:05d}.bin"
    entries: list[TensorEntry] = []
    files: dict[str, FileEntry] = {}
    with _Shard(tmp / f"rank{rank:05d}.bin") as shard:
        for slot in slots:
            data = staged.bytes_of(slot)
            h = digest(data)
            prev = base_tensors.get(slot.key)
            if prev is not None and prev.file in base_files and _unchanged(prev, slot, h):
                entries.append(prev)  # unchanged since the last checkpoint: point at its bytes
                files[prev.file] = base_files[prev.file]
                continue
            offset = shard.append(data)
            entries.append(
                TensorEntry.model_construct(
                    key=slot.key,
                    dtype=slot.dtype,
                    shape=slot.shape,
                    file=own,
                    offset=offset,
                    nbytes=slot.nbytes,
                    xxh3=h,
                )
            )
        if shard.written():
            files[own] = shard.finish(own)
    sharded = []
    for rel in sharded_files:
        path = f"{step_name(step)}/{rel}"
        files[path] = FileEntry(path=path, size=(tmp / rel).stat().st_size, xxh3=file_digest(tmp / rel))
        sharded.append(path)
    # built from our own values: validation happens where entries are read back (commit, load)
    entry = RankEntry.model_construct(
        rank=rank, skeleton=skeleton, tensors=entries, files=list(files.values()), sharded=sharded
    )
    # no fsync: a part only matters until rank 0 folds it into the (fsynced) manifest
    write_json_durable(tmp / part_name(rank), entry.model_dump_json(), durable=False)
    return entry


def _unchanged(prev: TensorEntry, slot: Slot, h: str) -> bool:
    """The base checkpoint's tensor has ``slot``'s bytes (digest ``h``), and is large enough that
    pointing at it is worth pinning its directory."""
    return (
        slot.nbytes >= DEDUPE_MIN_BYTES
        and prev.xxh3 == h
        and prev.dtype == slot.dtype
        and prev.shape == slot.shape
    )


class _Shard:
    """This rank's ``.bin`` of one save: tensors appended at aligned offsets and hashed as they are
    written; the file is created by the first append (a save whose tensors all stayed writes none)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        self.size = 0
        self.hasher = xxhash.xxh3_128()

    def __enter__(self) -> _Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)

    def written(self) -> bool:
        return self.fd >= 0

    def append(self, data: memoryview) -> int:
        """Write ``data`` at the next aligned offset (zeros before it, hashed too); return that offset."""
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pad = aligned(self.size) - self.size
        if pad:
            _write_all(self.fd, memoryview(_ZEROS[:pad]))
            self.hasher.update(_ZEROS[:pad])
            self.size += pad
        offset = self.size
        _write_all(self.fd, data)
        self.hasher.update(data)
        self.size += data.nbytes
        return offset

    def finish(self, path: str) -> FileEntry:
        """fsync the file; its entry under ``path`` (relative to the checkpoint root)."""
        os.fsync(self.fd)
        return FileEntry(path=path, size=self.size, xxh3=self.hasher.hexdigest())


def report_failure(root: Path, step: int, token: str, rank: int, error: BaseException) -> None:
    """Tell the committing rank that this rank's part will never come (best effort)."""
    try:
        tmp = root / tmp_name(step, token)
        tmp.mkdir(parents=True, exist_ok=True)
        write_json_durable(
            tmp / error_name(rank), {"rank": rank, "error": f"{type(error).__name__}: {error}"}
        )
    except OSError:
        pass


def discard(root: Path, step: int, token: str, rank: int | None) -> None:
    """Remove a failed save's bytes: this rank's shard, or (``rank=None``) the whole temporary dir."""
    tmp = root / tmp_name(step, token)
    if rank is None:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            (tmp / f"rank{rank:05d}.bin").unlink()


def commit(
    root: Path,
    step: int,
    token: str,
    world_size: int,
    *,
    timeout: float,
    extra: dict[str, Any] | None = None,
    clock: Any = time.monotonic,
    own: RankEntry | None = None,
) -> Manifest:
    """Rank 0: wait for every rank's part, write the manifest, atomically rename the directory."""
    tmp = root / tmp_name(step, token)
    deadline = clock() + timeout
    delay = 0.001
    missing = list(range(world_size))
    while True:
        for r in list(missing):
            err = tmp / error_name(r)
            if err.exists():
                raise CheckpointError(
                    f"{step_name(step)}: rank {r} failed to write its shard: {err.read_text()}"
                )
            if (tmp / part_name(r)).exists():
                missing.remove(r)
        if not missing:
            break
        if clock() > deadline:
            raise CheckpointError(
                f"{step_name(step)}: ranks {missing} did not write their shards within {timeout:.0f} s"
            )
        time.sleep(delay)  # waiting on other processes' files; bounded by the deadline above
        delay = min(delay * 2, 0.005)
    parts = [
        own if r == 0 and own else RankEntry.model_validate_json((tmp / part_name(r)).read_bytes())
        for r in range(world_size)
    ]
    _files_there(root, tmp, step, parts)
    points.reached("commit", step)  # (a harness's fault mid-commit: every part written, none renamed)
    manifest = Manifest(
        step=step, world_size=world_size, created=time.time(), ranks=parts, extra=extra or {}
    ).sealed()
    write_json_durable(tmp / MANIFEST, manifest.model_dump_json())
    for r in range(world_size):
        (tmp / part_name(r)).unlink()
    fsync_dir(tmp)
    final = root / step_name(step)
    if final.exists():  # a replayed step after a restart: the committed copy stays, this one goes
        logger.info(f"checkpoint {final.name} is already committed; keeping it")
        shutil.rmtree(tmp, ignore_errors=True)
        return read_manifest(final / MANIFEST)
    os.rename(tmp, final)
    fsync_dir(root)
    return manifest


def _files_there(root: Path, tmp: Path, step: int, parts: list[RankEntry]) -> None:
    """Every file each rank's part points at is there, at its size (one written earlier too)."""
    for part in parts:
        for f in part.files:
            top, _, rel = f.path.partition("/")
            where = tmp / rel if top == step_name(step) else root / f.path
            if not where.is_file() or where.stat().st_size != f.size:
                raise CheckpointError(
                    f"{step_name(step)}: rank {part.rank} points at {f.path}, which is gone"
                )


def referenced_dirs(manifest: Manifest) -> set[str]:
    return {f.path.split("/", 1)[0] for f in manifest.files()}


def retain(root: Path, keep: int, live_token: str, pinned: Iterable[str] = ()) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep`` that nothing kept points to, and
    temporary directories of other (dead) writers older than the newest commit. Returns deleted steps."""
    steps = committed_steps(root)
    needed: set[str] = set(pinned)  # e.g. read by an upload still queued
    for s in steps[:keep]:
        try:
            needed |= referenced_dirs(read_manifest(root / step_name(s) / MANIFEST))
        except CheckpointError:
            needed.add(step_name(s))
    for _, token, path in tmp_dirs(root):  # saves in flight may point at older checkpoints too
        if token == live_token:
            for part in path.glob("rank*.part.json"):
                try:
                    entry = RankEntry.model_validate_json(part.read_bytes())
                    needed |= {f.path.split("/", 1)[0] for f in entry.files}
                except (OSError, ValueError):
                    continue
    deleted = []
    for s in steps[keep:]:
        if step_name(s) not in needed:
            shutil.rmtree(root / step_name(s), ignore_errors=True)
            deleted.append(s)
    newest = steps[0] if steps else -1
    for s, token, path in tmp_dirs(root):
        if token != live_token and s <= newest:
            shutil.rmtree(path, ignore_errors=True)
    return deleted


def remove_stale(root: Path, live_token: str) -> list[Path]:
    """Temporary directories left by writers of an earlier run (a crash mid-save)."""
    gone = []
    for _, token, path in tmp_dirs(root):
        if token != live_token:
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


@dataclass(frozen=True)
class WriterSpec:
    """Where and how one rank's saves are written: all a writer (thread or process) is told."""

    root: Path
    rank: int
    world_size: int
    token: str
    keep: int
    incremental: bool = True
    commit_timeout: float = 600.0


@dataclass(frozen=True)
class SaveJob:
    """One save handed to a writer, its tensors staged into the writer's arena."""

    step: int
    slots: list[Slot]
    skeleton: Any
    extra: dict[str, Any] | None = None
    dcp_files: list[str] = field(default_factory=list)  # written by DCP into the temporary directory
    pinned: frozenset[str] = frozenset()  # step directories a queued upload still reads: kept


def persist(spec: WriterSpec, job: SaveJob, staged: StagedBytes) -> tuple[Manifest | None, list[int]]:
    """This rank's shard, then (rank 0) the commit and retention: the committed manifest (None on
    other ranks) and the steps retention deleted. A failure removes the bytes this save wrote and,
    on a rank other than 0, tells rank 0 that this rank's part will never come."""
    root, step, token, rank = spec.root, job.step, spec.token, spec.rank
    try:
        entry = persist_rank(
            root,
            step,
            token,
            rank,
            staged,
            job.slots,
            job.skeleton,
            incremental=spec.incremental,
            sharded_files=job.dcp_files,
        )
    except Exception as e:
        # give the space back (a full disk); rank 0 will not commit, so the whole directory goes
        discard(root, step, token, None if rank == 0 else rank)
        if rank != 0:
            report_failure(root, step, token, rank, e)
        raise
    if rank != 0:
        return None, []
    try:
        manifest = commit(
            root, step, token, spec.world_size, timeout=spec.commit_timeout, extra=job.extra, own=entry
        )
    except Exception:
        discard(root, step, token, None)
        raise
    return manifest, retain(root, spec.keep, token, job.pinned)


class ThreadWriter:
    """The default writer: :func:`persist` in the thread that calls :meth:`write` (the
    ``Checkpointer``'s background thread), the tensors staged in anonymous host memory.

    Writing and hashing release the GIL (``os.write``, xxhash), so this costs the training thread
    little; ``writer="process"`` moves even the syscalls' GIL hand-offs out of the process.
    """

    def __init__(self, spec: WriterSpec) -> None:
        self.spec = spec
        self.arena = Arena()

    def write(self, job: SaveJob) -> Manifest | None:
        manifest, deleted = persist(self.spec, job, self.arena)
        for s in deleted:
            logger.debug(f"retention: deleted {step_name(s)}")
        return manifest

    def close(self) -> None:
        self.arena.release()
