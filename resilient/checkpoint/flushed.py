"""Flush on death: a dead worker's newest shared-memory snapshots, written to durable storage by
its agent, so that a later loss of its node (or of the whole job) loses nothing more.

A worker whose configuration asks for it (``checkpoint.flush_on_death``) leaves a note in its
shared-memory directory naming where its snapshots go (``<checkpoint.dir>/flushed``). When the
worker dies, its agent copies the complete slots there in a background thread, and when the agent
itself gives up (restarts spent, a fault that repeats, its node excluded) it copies every local
rank's before the shared memory goes. The copy is the slot as it was, the same files
(:class:`~resilient.checkpoint.shm.ShmSnapshot` reads it, checking every tensor's byte sum), under
the global rank that wrote it: ``flushed/rank<R>/slot<K>.{bin,json}``, made in a temporary
directory, fsynced, then renamed into place.

A slot is copied like a seqlock is read: its description before the bytes and after them must be
the same, since a writer (the replacement, mirroring its first snapshot) removes the description
of the slot it overwrites first. A restore takes a flushed copy only for a rank no node holds in
memory (:mod:`resilient.runtime.keeping.resume`), and only at a step no older than the newest committed
checkpoint; rank 0 removes the copies a newer commit made obsolete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilient.checkpoint.manifest import fsync_dir, write_json_durable
from resilient.checkpoint.shm import ShmSnapshot
from resilient.errors import CheckpointError

FLUSHED = "flushed"  # under checkpoint.dir
NOTE = "flush.json"  # in a worker's shared-memory directory: where its agent flushes it


def root(checkpoint_dir: Path) -> Path:
    return Path(checkpoint_dir) / FLUSHED


def rank_dir(top: Path, rank: int) -> Path:
    return top / f"rank{rank:05d}"


def copy_of(top: Path, rank: int) -> ShmSnapshot:
    """The flushed copy of global rank ``rank``'s snapshots (read like its shared memory)."""
    return ShmSnapshot.at(rank_dir(top, rank))


def offer(shm: ShmSnapshot, top: Path) -> None:
    """The worker side: ask this rank's agent to flush its snapshots to ``top`` when it dies."""
    shm.dir.mkdir(parents=True, exist_ok=True)
    write_json_durable(shm.dir / NOTE, {"dir": str(Path(top).resolve())}, durable=False)


def target(shm_dir: Path) -> Path | None:
    """The agent side: where the worker of ``shm_dir`` asked its snapshots to go, if it did."""
    try:
        note = json.loads((shm_dir / NOTE).read_text())
    except (OSError, ValueError):
        return None
    where = note.get("dir") if isinstance(note, dict) else None
    return Path(where) if isinstance(where, str) and where else None


@dataclass(frozen=True)
class Flushed:
    rank: int  # the global rank that wrote the snapshots
    world: int
    steps: tuple[int, ...]  # newest first
    nbytes: int
    seconds: float
    path: Path


def flush(shm_dir: Path, top: Path, *, durable: bool = True) -> Flushed | None:
    """Copy the complete snapshots in ``shm_dir`` to ``top``; None when it holds none. The slots
    copied are those of the newest one's writer (global rank, world size): after a renumbering the
    other slot may be another rank's."""
    t0 = time.monotonic()
    snap = ShmSnapshot.at(shm_dir)
    held = snap.slots()
    if not held:
        return None
    rank, world = held[0]["rank"], held[0]["world"]
    if rank is None or world is None:
        return None  # (an unlabelled snapshot: not any rank's to restore)
    dest = rank_dir(top, int(rank))
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    steps, nbytes = [], 0
    try:
        for slot in (0, 1):
            meta_path = shm_dir / f"slot{slot}.json"
            try:
                before = meta_path.read_bytes()
            except FileNotFoundError:
                continue
            meta = _meta(before)
            if meta is None or (meta.get("rank"), meta.get("world")) != (rank, world):
                continue
            size = int(meta["size"])
            if not _copy(shm_dir / f"slot{slot}.bin", tmp / f"slot{slot}.bin", size, durable):
                continue
            try:
                after = meta_path.read_bytes()
            except FileNotFoundError:
                after = b""
            if after != before:  # rewritten while it was read: the copy may hold both
                (tmp / f"slot{slot}.bin").unlink(missing_ok=True)
                continue
            write_json_durable(tmp / f"slot{slot}.json", before, durable=durable)
            steps.append(int(meta["step"]))
            nbytes += size
        if not steps:
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        if durable:
            fsync_dir(tmp)
        old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
        if durable:
            fsync_dir(top)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Flushed(
        int(rank), int(world), tuple(sorted(steps, reverse=True)), nbytes, time.monotonic() - t0, dest
    )


def _meta(raw: bytes) -> dict[str, Any] | None:
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    ok = isinstance(meta, dict) and type(meta.get("step")) is int and type(meta.get("size")) is int
    return meta if ok and meta["size"] >= 0 else None


def _copy(src: Path, dst: Path, size: int, durable: bool) -> bool:
    """The first ``size`` bytes of ``src`` into a new ``dst``, in the kernel (sendfile); False when
    ``src`` is gone or shorter."""
    try:
        fin = os.open(src, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fin).st_size < size:
            return False
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < size:
                n = os.sendfile(fout, fin, done, min(size - done, 1 << 30))
                if n == 0:
                    return False
                done += n
            if durable:
                os.fsync(fout)
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    return True


def prune(top: Path, below: int) -> list[int]:
    """Remove the flushed copies of ranks whose every step is older than ``below`` (a committed
    checkpoint: a restore never takes them again); the ranks removed."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for d in sorted(top.iterdir()):
            if not d.is_dir() or not d.name.startswith("rank"):
                continue
            if ".tmp-" in d.name or ".old-" in d.name:
                continue
            try:
                steps = ShmSnapshot.at(d).steps()
            except CheckpointError:
                steps = []
            if all(s < below for s in steps):
                shutil.rmtree(d, ignore_errors=True)
                with contextlib.suppress(ValueError):
                    removed.append(int(d.name[4:]))
    return removed
