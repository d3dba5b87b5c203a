"""``Checkpointer``: async saves that block only for a copy, committed atomically, kept N deep.

``save(step, state)`` encodes the tree, copies its tensors into reused host buffers (the only time
the caller waits) and hands the rest to one background thread: checksum, write, fsync, commit (rank
0, after every rank's shard is on disk), retention, upload to the persistent tier. At most one
save is in flight; the next one waits for it or is skipped (``on_busy``). A failure is raised as
``CheckpointError`` from the next ``save`` and from ``close`` — never left in a log.

Pipelined mode (``save(..., pipeline=[optimizer])``) does not even wait for the copy: it runs in the
writer thread while the caller computes the next forward/backward, and a step pre-hook on each
optimizer blocks only if the optimizer would modify tensors not yet copied.

Why a thread and not a process: writing and hashing release the GIL (``os.write``, xxhash), so the
writer costs the training thread little; a process would need the staged bytes in shared memory
and a second copy of the commit logic's state. ``benchmarks/checkpoint.py`` measures both.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from resilient.checkpoint.codec import encode
from resilient.checkpoint.manifest import MANIFEST, Manifest, read_manifest, step_name, tmp_name
from resilient.checkpoint.procwriter import ProcessWriter
from resilient.checkpoint.reader import Loaded, load_latest, load_step
from resilient.checkpoint.shm import SHM
from resilient.checkpoint.staging import Arena, Slot
from resilient.checkpoint.writer import (
    commit,
    discard,
    persist_rank,
    remove_stale,
    report_failure,
    retain,
)
from resilient.errors import CheckpointError


class OnBusy(str, enum.Enum):
    """What ``save`` does while the previous save is still being written."""

    WAIT = "wait"  # block until it is committed, then save (no checkpoint is lost)
    SKIP = "skip"  # return at once without saving (the step never waits on the disk)


def default_token() -> str:
    """A name shared by every rank of this launch, so all write into the same temporary directory."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        token = [uuid.uuid4().hex[:12]]
        torch.distributed.broadcast_object_list(token, src=0)
        return str(token[0])
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run:
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{run}-r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    return uuid.uuid4().hex[:12]


class Checkpointer:
    """Saves and loads this rank's part of a job's checkpoints under ``root``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        token: str | None = None,
        keep: int = 3,
        incremental: bool = True,
        on_busy: OnBusy | str = OnBusy.WAIT,
        commit_timeout: float = 600.0,
        persistent_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        any_busy: Callable[[int, bool], bool] | None = None,
        writer: str = "thread",
    ) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1 (the newest checkpoint is never deleted), got {keep}")
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self.root} cannot be created: {e}") from e
        self.rank, self.world_size = rank, world_size
        self.token = token or default_token()
        self.keep, self.incremental = keep, incremental
        self.on_busy = OnBusy(on_busy)
        self.commit_timeout = commit_timeout
        self.tier: Any = None
        self._uploader: Any = None
        if persistent_url:
            from resilient.checkpoint.tiers import AsyncUploader, PersistentTier

            self.tier = PersistentTier(persistent_url, **(storage_options or {}))
            if rank == 0:
                self._uploader = AsyncUploader(self.tier)
        if writer not in ("thread", "process"):
            raise CheckpointError(f"writer must be 'thread' or 'process', got {writer!r}")
        self._procw: ProcessWriter | None = None
        self._arena_path: Path | None = None
        if writer == "process":  # staged bytes in /dev/shm, mapped by the child
            self._arena_path = SHM / f"resilient-ckpt-{self.token}-r{rank:05d}-{os.getpid()}.bin"
            self._procw = ProcessWriter(self._arena_path, self.root, rank, world_size, self.token, keep)
        self._arena = Arena(self._arena_path)
        self._pinned: dict[int, set[str]] = {}  # step -> local step dirs its pending upload reads
        self._pin_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="resilient-ckpt")
        self._inflight: Future[Manifest | None] | None = None
        self._inflight_step = -1
        self._inflight_t0 = 0.0
        self._last: tuple[int, Future[Manifest | None]] | None = None
        self._any_busy = any_busy or _any_rank_busy
        self._staged = threading.Event()
        self._staged.set()
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._closed = False
        self.saved = self.skipped = 0
        self.last_block_s = 0.0
        self.last_nbytes = 0  # tensor bytes of the last save (the metrics' checkpoint size)
        if rank == 0:
            for path in remove_stale(self.root, self.token):
                logger.info(f"removed {path.name}, left by a writer that died mid-save")
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- saving ---------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        extra: dict[str, Any] | None = None,
        pipeline: Sequence[torch.optim.Optimizer] = (),
        sharded: dict[str, Any] | None = None,
    ) -> Future[Manifest | None] | None:
        """Start saving ``state`` as checkpoint ``step``; returns a future (rank 0's resolves to the
        committed manifest), or None when skipped because the previous save is still in flight.

        ``sharded``: DTensor/FSDP2 state (e.g. from ``get_state_dict``) written through DCP into the
        same checkpoint, so it is checksummed and committed with the rest and reshards on load.
        DCP's write is collective and synchronous: the caller waits for it (not only for a copy).
        """
        if self._closed:
            raise CheckpointError("save() on a closed Checkpointer")
        self._settle(wait=False)
        if self._last is not None and self._last[0] == step:
            # the same step again (replayed after a restart, or a preemption's final save that the
            # periodic one already covers): same state, and a second writer into the same temporary
            # directory would race with rank 0 renaming it
            return self._last[1]
        t0 = time.perf_counter()
        busy = self._inflight is not None and not self._inflight.done()
        if self.on_busy is OnBusy.SKIP:
            if self.world_size > 1:  # every rank must skip the same steps, or no step commits
                busy = self._any_busy(step, busy)
            if busy:
                self.skipped += 1
                logger.info(f"checkpoint at step {step} skipped: the previous one is still being written")
                return None
        if busy or sharded is not None:
            self._wait_inflight()  # DCP writes into the step's directory now: nothing else may be
        dcp_files: list[str] = []
        if sharded is not None:
            tmp = self.root / tmp_name(step, self.token)
            tmp.mkdir(parents=True, exist_ok=True)
            from resilient.checkpoint.sharded import save_sharded  # DCP: ~0.5 s to import, only if used

            dcp_files = [f"dcp/{p}" for p in save_sharded(sharded, tmp / "dcp")]
        skeleton, leaves = encode(state)
        self.last_nbytes = sum(leaf.tensor.nbytes for leaf in leaves)
        if pipeline:
            for opt in pipeline:
                if opt not in self._hooked:
                    opt.register_step_pre_hook(self._before_optimizer_step)
                    self._hooked.add(opt)
            self._staged.clear()
            fut = self._pool.submit(self._save_job, step, None, leaves, skeleton, extra, dcp_files)
        else:
            slots = self._arena.stage(leaves)
            fut = self._pool.submit(self._save_job, step, slots, None, skeleton, extra, dcp_files)
        self.last_block_s = time.perf_counter() - t0
        self._inflight, self._inflight_step, self._inflight_t0 = fut, step, time.perf_counter()
        self._last = (step, fut)
        self.saved += 1
        fut.add_done_callback(functools.partial(self._log_failure, step))
        return fut

    def _before_optimizer_step(self, *_: Any) -> None:
        if not self._staged.is_set():
            t0 = time.perf_counter()
            if not self._staged.wait(self.commit_timeout):
                raise CheckpointError("staging a pipelined checkpoint did not finish in time")
            self.last_block_s += time.perf_counter() - t0

    def _save_job(
        self,
        step: int,
        slots: list[Slot] | None,
        leaves: Any,
        skeleton: Any,
        extra: dict[str, Any] | None,
        dcp_files: list[str],
    ) -> Manifest | None:
        if slots is None:
            try:
                slots = self._arena.stage(leaves)
            finally:
                self._staged.set()
        with self._pin_lock:
            pinned = set().union(*self._pinned.values()) if self._pinned else set()
        if self._procw is not None:
            job = {"step": step, "slots": slots, "skeleton": skeleton, "extra": extra,
                   "dcp_files": dcp_files, "incremental": self.incremental,
                   "timeout": self.commit_timeout, "pinned": pinned}  # fmt: skip
            reply = self._procw.run(job, timeout=self.commit_timeout + 60)
            if self.rank != 0:
                return None
            manifest = Manifest.model_validate_json(reply["manifest"])
        else:
            manifest_or_none = self._persist_here(step, slots, skeleton, extra, dcp_files, pinned)
            if manifest_or_none is None:
                return None
            manifest = manifest_or_none
        if self._uploader is not None:
            files = [f.path for f in manifest.files()]
            with self._pin_lock:  # local retention keeps what a queued upload still has to copy
                self._pinned[step] = {p.split("/", 1)[0] for p in files}
            up = self._uploader.submit(self.root, step_name(step), files)
            up.add_done_callback(functools.partial(self._uploaded, step))  # on the uploader thread
        return manifest

    def _persist_here(
        self,
        step: int,
        slots: list[Slot],
        skeleton: Any,
        extra: dict[str, Any] | None,
        dcp_files: list[str],
        pinned: set[str],
    ) -> Manifest | None:
        """The thread writer: this rank's shard, then (rank 0) the commit and retention."""
        try:
            entry = persist_rank(self.root, step, self.token, self.rank, self._arena, slots, skeleton,
                                 incremental=self.incremental, sharded_files=dcp_files)  # fmt: skip
        except Exception as e:
            # give the space back (a full disk); rank 0 will not commit, so the whole directory goes
            discard(self.root, step, self.token, None if self.rank == 0 else self.rank)
            if self.rank != 0:
                report_failure(self.root, step, self.token, self.rank, e)
            raise
        if self.rank != 0:
            return None
        try:
            manifest = commit(self.root, step, self.token, self.world_size, timeout=self.commit_timeout,
                              extra=extra, own=entry)  # fmt: skip
        except Exception:
            discard(self.root, step, self.token, None)
            raise
        for s in retain(self.root, self.keep, self.token, pinned):
            logger.debug(f"retention: deleted {step_name(s)}")
        return manifest

    def _uploaded(self, step: int, upload: Future[None]) -> None:
        with self._pin_lock:
            self._pinned.pop(step, None)
        if upload.exception() is None:
            self._prune_remote()

    def _prune_remote(self) -> None:
        """Persistent-tier retention, after a successful upload: the same rule as the local one."""
        try:
            names = self.tier.committed()
            needed: set[str] = set()
            for name in names[-self.keep :]:
                m = Manifest.model_validate_json(self.tier.read_bytes(f"{name}/{MANIFEST}"))
                needed |= {f.path.split("/", 1)[0] for f in m.files()} | {name}
            for name in names[: -self.keep]:
                if name not in needed:
                    self.tier.delete(name)
        except (CheckpointError, OSError, ValueError) as e:  # the next upload prunes again
            logger.warning(f"pruning {self.tier.url} failed: {e}")

    @staticmethod
    def _log_failure(step: int, fut: Future[Manifest | None]) -> None:
        e = fut.exception()
        if e is not None:
            logger.error(f"checkpoint {step_name(step)} failed: {type(e).__name__}: {e}")

    def _settle(self, wait: bool) -> None:
        """Forget the save in flight once done (waiting for it if asked); raise if it failed."""
        fut, step = self._inflight, self._inflight_step
        if fut is None or (not wait and not fut.done()):
            return
        self._inflight = None
        try:
            fut.result(timeout=self.commit_timeout + 60)
        except Exception as e:
            self._last = None
            raise CheckpointError(f"checkpoint {step_name(step)} failed: {type(e).__name__}: {e}") from e

    def in_flight(self) -> tuple[int, float] | None:
        """The save still being written: (its step, seconds since it started), else None."""
        fut = self._inflight
        if fut is None or fut.done():
            return None
        return self._inflight_step, time.perf_counter() - self._inflight_t0

    def _wait_inflight(self) -> None:
        self._settle(wait=True)

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        self._wait_inflight()

    def close(self) -> None:
        """Flush: finish the save in flight and pending uploads; raise any error. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wait_inflight()
            if self._uploader is not None:
                self._uploader.close()
        finally:
            self._pool.shutdown(wait=True)
            self._arena.release()
            if self._procw is not None:
                self._procw.close()
            if self._arena_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    self._arena_path.unlink()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading --------------------------------------------------------------------------------
    def load_latest(self, sharded: dict[str, Any] | None = None) -> Loaded | None:
        """The newest checkpoint that verifies on every rank (local first, then the persistent tier).

        ``sharded``: a DTensor/FSDP2 state dict to load into in place (collective), resharded to this
        job's world size; at a different world size ``Loaded.state`` (per-rank state) is None.
        """
        agree = _all_ranks_agree if self.world_size > 1 and torch.distributed.is_initialized() else None
        try:
            loaded = load_latest(self.root, self.rank, self.world_size, agree=agree, sharded=sharded)
        except CheckpointError:
            if self.tier is None:
                raise
            loaded = None
        if loaded is None and self.tier is not None:
            loaded = self._load_from_tier(sharded)
        elif loaded is not None and self.rank == 0:  # every rank voted these bad: out of the way
            from resilient.checkpoint.manifest import quarantine

            for bad in loaded.rejected_steps:
                if (moved := quarantine(self.root, bad)) is not None:
                    logger.warning(f"checkpoint step {bad} does not verify: moved to {moved}")
        return loaded

    def _load_from_tier(self, sharded: dict[str, Any] | None) -> Loaded | None:
        """Fetch the newest persistent checkpoint into a cache root beside the local one and load it.

        The cache is its own checkpoint root (manifest written after the files), so a fetch cut
        short never looks like a committed local checkpoint.
        """
        cache = self.root / ".persistent-cache" / f"rank{self.rank:05d}"
        for name in reversed(self.tier.committed()):
            try:
                manifest = Manifest.model_validate_json(self.tier.read_bytes(f"{name}/{MANIFEST}"))
                need = {f.path for f in manifest.sharded_files()} if sharded is not None else set()
                if manifest.world_size == self.world_size:
                    need |= {f.path for f in manifest.rank(self.rank).files}
                self.tier.fetch(sorted(need), cache)
                (cache / name).mkdir(parents=True, exist_ok=True)
                (cache / name / MANIFEST).write_bytes(manifest.model_dump_json().encode())
                loaded = load_step(cache, manifest.step, self.rank, self.world_size, sharded=sharded)
                logger.info(f"restored {name} from the persistent tier {self.tier.url}")
                return loaded
            except (CheckpointError, ValueError, OSError) as e:
                logger.warning(f"persistent checkpoint {name} does not load: {e}; trying the previous one")
            finally:
                shutil.rmtree(cache, ignore_errors=True)
                with contextlib.suppress(OSError):
                    cache.parent.rmdir()  # only once every rank's cache is gone
        return None

    def committed(self) -> list[int]:
        from resilient.checkpoint.manifest import committed_steps

        return committed_steps(self.root)

    def manifest(self, step: int) -> Manifest:
        return read_manifest(self.root / step_name(step) / MANIFEST)


def _any_rank_busy(step: int, busy: bool) -> bool:
    """Default vote for ``on_busy: skip``: an all-reduce MAX over the default group."""
    if not torch.distributed.is_initialized():
        raise CheckpointError("on_busy='skip' with several ranks needs a process group or any_busy=")
    dev = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if busy else 0], dtype=torch.int32, device=dev)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _all_ranks_agree(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _close_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is not None and not ckpt._closed:
        try:
            ckpt.close()
        except CheckpointError as e:
            logger.error(f"at exit: {e}")
