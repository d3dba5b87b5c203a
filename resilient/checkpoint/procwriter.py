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

from loguru import logger

from resilient.checkpoint.manifest import Manifest, step_name
from resilient.checkpoint.shm import SHM
from resilient.checkpoint.staging import Arena, Slot
from resilient.checkpoint.writer import SaveJob, WriterSpec, persist
from resilient.errors import CheckpointError


class _MappedArena:
    """The child's read-only view of the staged bytes (``persist`` only calls ``bytes_of``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._size = -1

    def bytes_of(self, slot: Slot) -> memoryview:
        size = os.path.getsize(self.path)
        if self._mm is None or size != self._size:  # the parent grew the arena
            if self._mm is not None:
                self._mm.close()
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            self._size = size
        return memoryview(self._mm)[slot.offset : slot.offset + slot.nbytes]


def child_main(conn: Connection, arena_path: str) -> None:
    """The child's loop: the writer's spec first, then one job after another until None."""
    spec: WriterSpec = conn.recv()
    staged = _MappedArena(arena_path)
    while (job := conn.recv()) is not None:
        try:
            manifest, deleted = persist(spec, job, staged)
        except Exception as e:
            conn.send({"error": f"{type(e).__name__}: {e}"})
            continue
        conn.send({"manifest": None if manifest is None else manifest.model_dump_json(), "deleted": deleted})


class ProcessWriter:
    """One child process that persists the jobs it is sent, one at a time; the tensors are staged
    in a file in ``/dev/shm`` that the child maps.

    Started with ``python -m resilient.checkpoint._writer_child`` and a socket pair, not with
    ``multiprocessing``'s spawn: spawn re-imports the user's ``__main__``, which runs a training
    script without an ``if __name__ == "__main__"`` guard a second time.
    """

    def __init__(self, spec: WriterSpec, shm: Path = SHM) -> None:
        self.spec = spec
        # the pid keeps two Checkpointers of one rank (a test, a relaunch overlapping) apart
        path = shm / f"resilient-ckpt-{spec.token}-r{spec.rank:05d}-{os.getpid()}.bin"
        self.arena = Arena(path)
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "resilient.checkpoint._writer_child", str(theirs.fileno()), str(path)],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(spec)

    def write(self, job: SaveJob) -> Manifest | None:
        reply = self._run(job, timeout=self.spec.commit_timeout + 60)
        for s in reply["deleted"]:
            logger.debug(f"retention: deleted {step_name(s)}")
        return None if reply["manifest"] is None else Manifest.model_validate_json(reply["manifest"])

    def _run(self, job: SaveJob, timeout: float) -> dict[str, Any]:
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
        """Stop the child and remove the staging file (a second call finds nothing left to do)."""
        self.arena.release()
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._conn.close()
        if self.arena.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.arena.path.unlink()
