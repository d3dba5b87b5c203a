"""The agent's side of flush on death (:mod:`resilient.checkpoint.flushed`): a dead worker's newest
shared-memory snapshots are copied to durable storage in a background thread, and every local
rank's before the agent gives up and its shared memory goes.

Only a worker that asked for it (``checkpoint.flush_on_death``: a note in its shared-memory
directory) is flushed, to where it asked. Copies run one at a time in one thread: a death never
waits for one, and the copies of two deaths do not compete for the disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from loguru import logger

from resilient.checkpoint import flushed
from resilient.checkpoint.shm import ShmSnapshot
from resilient.events import Event


class Flusher:
    """``emit(event, **fields)``: the agent's event log. ``shm_name``: the launcher's snapshot
    mirror (None: nothing to flush). ``base``: where shared memory is (a test's directory)."""

    def __init__(self, shm_name: str | None, emit: Callable[..., None], base: Path | None = None) -> None:
        self._top = ShmSnapshot(shm_name, 0, **({"base": base} if base else {})).top if shm_name else None
        self._emit = emit
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []
        self._copied: dict[Path, list[dict[str, Any]]] = {}  # a rank's slots, as last flushed

    def _dir(self, local_rank: int) -> Path | None:
        return None if self._top is None else self._top / f"rank{local_rank:05d}"

    def on_death(self, local_rank: int, global_rank: int) -> Future[Any] | None:
        """Flush ``local_rank``'s snapshots (its worker just died) in the background, if it asked."""
        d = self._dir(local_rank)
        return None if d is None else self._submit(d, "death", local_rank, global_rank)

    def before_exit(self, timeout_s: float) -> int:
        """The agent gives up: every local rank's snapshots, after the flushes in flight; waits at
        most ``timeout_s`` in all. Returns how many were flushed or already in flight."""
        if self._top is None or not self._top.is_dir():
            return 0
        for d in sorted(self._top.glob("rank[0-9]*")):
            if d in self._copied and ShmSnapshot.at(d).slots() == self._copied[d]:
                continue  # (flushed at its death, and nothing newer since)
            self._submit(d, "exit", int(d.name[4:]), None)
        done, late = wait(self._pending, timeout=timeout_s)
        if late:
            logger.error(f"{len(late)} snapshot flush(es) not done after {timeout_s:g} s: left unfinished")
        return len(done)

    def _submit(self, d: Path, why: str, local_rank: int, global_rank: int | None) -> Future[Any] | None:
        top = flushed.target(d)
        if top is None:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="resilient-flush")
        fut = self._pool.submit(self._flush, d, top, why, local_rank, global_rank)
        self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def _flush(self, d: Path, top: Path, why: str, local_rank: int, global_rank: int | None) -> None:
        fields: dict[str, Any] = {"local_rank": local_rank, "why": why, "dir": str(top)}
        try:
            slots = ShmSnapshot.at(d).slots()
            got = flushed.flush(d, top)
        except Exception as e:  # (a full disk: the snapshots stay in shared memory, as without the flush)
            logger.warning(f"local rank {local_rank}: its snapshots could not be flushed to {top}: {e}")
            self._emit(Event.SNAPSHOT_FLUSHED, **fields, global_rank=global_rank, error=str(e))
            return
        if got is None:
            return
        self._copied[d] = slots
        gbps = got.nbytes / got.seconds / 1e9 if got.seconds > 0 else None
        self._emit(
            Event.SNAPSHOT_FLUSHED,
            **fields,
            global_rank=got.rank,
            world=got.world,
            steps=list(got.steps),
            nbytes=got.nbytes,
            duration_s=got.seconds,
            gb_per_s=round(gbps, 3) if gbps is not None else None,
        )
        logger.info(
            f"rank {got.rank}'s snapshots of steps {list(got.steps)} flushed to {got.path} "
            f"({got.nbytes / 1e6:.1f} MB in {got.seconds:.2f} s)"
        )

    def close(self) -> None:
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
