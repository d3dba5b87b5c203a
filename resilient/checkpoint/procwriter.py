"""The writer in a separate process: persist, commit and retention off the training process's GIL.

A writer *thread* makes dozens of syscalls per save (open, write, fsync, rename, stat, listdir),
and every return from one re-acquires the GIL: a training loop that dispatches small ops from
Python pays a GIL hand-off each time (``benchmarks/checkpoint_gil.py``: the step after a small
save takes 6.8 ms instead of 2.5; 3.8 ms with this writer, whose child competes for the cores
instead). With ``writer="process"`` the staged bytes live in a file in ``/dev/shm`` that the child
maps, and the training process only sends a job description down a socket and blocks (in a
background thread, on one ``recv``) for the reply.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from resilient.errors import CheckpointError


class _MappedArena:
    """The child's read-only view of the staged bytes (``persist_rank`` only calls ``bytes_of``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._size = -1

    def bytes_of(self, slot: Any) -> memoryview:
        size = os.path.getsize(self.path)
        if self._mm is None or size != self._size:  # the parent grew the arena
            if self._mm is not None:
                self._mm.close()
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            self._size = size
        return memoryview(self._mm)[slot.offset : slot.offset + slot.nbytes]


def child_main(
    conn: Any, arena_path: str, root: str, rank: int, world_size: int, token: str, keep: int
) -> None:
    from resilient.checkpoint.writer import commit, discard, persist_rank, report_failure, retain

    arena = _MappedArena(arena_path)
    root_p = Path(root)
    while True:
        job = conn.recv()
        if job is None:
            return
        step = job["step"]
        try:
            entry = persist_rank(root_p, step, token, rank, arena, job["slots"], job["skeleton"],  # type: ignore[arg-type]
                                 incremental=job["incremental"], sharded_files=job["dcp_files"])  # fmt: skip
        except Exception as e:
            discard(root_p, step, token, None if rank == 0 else rank)
            if rank != 0:
                report_failure(root_p, step, token, rank, e)
            conn.send({"error": f"{type(e).__name__}: {e}"})
            continue
        if rank != 0:
            conn.send({"manifest": None})
            continue
        try:
            manifest = commit(
                root_p, step, token, world_size, timeout=job["timeout"], extra=job["extra"], own=entry
            )
            deleted = retain(root_p, keep, token, job["pinned"])
        except Exception as e:
            discard(root_p, step, token, None)
            conn.send({"error": f"{type(e).__name__}: {e}"})
            continue
        conn.send({"manifest": manifest.model_dump_json(), "deleted": deleted})


class ProcessWriter:
    """One child process that persists the jobs it is sent, one at a time.

    Started with ``python -m resilient.checkpoint._writer_child`` and a socket pair, not with
    ``multiprocessing``'s spawn: spawn re-imports the user's ``__main__``, which runs a training
    script without an ``if __name__ == "__main__"`` guard a second time.
    """

    def __init__(
        self, arena_path: Path, root: Path, rank: int, world_size: int, token: str, keep: int
    ) -> None:
        ours, theirs = socket.socketpair()
        args = [str(arena_path), str(root), str(rank), str(world_size), token, str(keep)]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "resilient.checkpoint._writer_child", str(theirs.fileno()), *args],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._conn = Connection(ours.detach())

    def run(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one job and wait for its reply; raises CheckpointError if the child died or timed out."""
        try:
            self._conn.send(job)
            if not self._conn.poll(timeout):
                raise CheckpointError(f"checkpoint writer process gave no answer within {timeout:.0f} s")
            reply: dict[str, Any] = self._conn.recv()
        except (EOFError, OSError) as e:
            raise CheckpointError(f"checkpoint writer process died (exit code {self._proc.poll()})") from e
        if "error" in reply:
            raise CheckpointError(reply["error"])
        return reply

    def close(self, timeout: float = 30.0) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._conn.close()
