"""``Checkpointer``: async saves that block only for a copy, committed atomically, kept N deep.

``save(step, state)`` encodes the tree, copies its tensors into reused host buffers (the only time
the caller waits) and hands the rest to one background thread: checksum, write, fsync, commit (rank
0, after every rank's shard is on disk), retention, upload to the persistent tier. At most one
save is in flight; the next one waits for it or is skipped (``on_busy``). A failure is raised as
``CheckpointError`` from the next ``save`` and from ``close`` — never left in a log.

Pipelined mode (``save(..., pipeline=[optimizer])``) does not even wait for the copy: it runs in the
writer thread while the caller computes the next forward/backward, and a step pre-hook on each
optimizer blocks only if the optimizer would modify tensors not yet copied.

Who persists and where copies go are collaborators (``backends.py``): a writer (``"thread"`` by
default, or ``"process"``), and with ``persistent_url`` a tier and rank 0's uploader, built from the
validated :class:`~resilient.config.CheckpointConfig` unless handed in (``backends=``, e.g. fakes
in a test). ``benchmarks/checkpoint.py`` measures both writers.
"""

from __future__ import annotations

import atexit
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
from pydantic import ValidationError

from resilient.checkpoint.backends import Backends, ShardWriter, Storage, build_backends
from resilient.checkpoint.codec import encode
from resilient.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    committed_steps,
    quarantine,
    read_manifest,
    step_name,
    tmp_dirs,
    tmp_name,
)
from resilient.checkpoint.persistent import Uploads, restore_from_tier
from resilient.checkpoint.reader import Loaded, load_latest
from resilient.checkpoint.staging import Slot
from resilient.checkpoint.writer import SaveJob, remove_stale
from resilient.config import CheckpointConfig
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
        config: CheckpointConfig | str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        token: str | None = None,
        any_busy: Callable[[int, bool], bool] | None = None,
        backends: Backends | None = None,
        **fields: Any,
    ) -> None:
        """``config``: a ``checkpoint:`` section, or the directory for its ``dir`` with any of its
        other fields as keywords (``keep=3``, ``persistent_url=...``), which it validates.
        ``backends``: the writer, tier and uploader to use instead of the ones the config's
        ``writer``, ``persistent_url`` and ``storage_options`` describe (which must then be unset)."""
        cfg, self.root = _config(config, fields)
        self.config = cfg
        if backends is not None and (cfg.writer != "thread" or cfg.persistent_url or cfg.storage_options):
            raise CheckpointError("Checkpointer: pass backends= or writer=/persistent_url=, not both")
        self.on_busy = OnBusy(cfg.on_busy)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self.root} cannot be created: {e}") from e
        self.rank, self.world_size = rank, world_size
        self.token = token or default_token()
        if backends is None:
            backends = build_backends(cfg, rank=rank, world_size=world_size, token=self.token)
        self.writer: ShardWriter = backends.writer
        self.tier: Storage | None = backends.tier
        self._uploads: Uploads | None = None  # rank 0's, with a persistent tier
        if backends.tier is not None and backends.uploader is not None:
            self._uploads = Uploads(backends.tier, backends.uploader, cfg.keep)
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

    @classmethod
    def from_config(
        cls,
        cfg: CheckpointConfig,
        *,
        rank: int,
        world_size: int,
        token: str | None = None,
        any_busy: Callable[[int, bool], bool] | None = None,
    ) -> Checkpointer:
        """The ``Checkpointer`` that ``cfg`` (a runtime's ``checkpoint:`` section) describes."""
        return cls(cfg, rank=rank, world_size=world_size, token=token, any_busy=any_busy)

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
        done = self._saved_already(step)
        if done is not None:
            return done
        t0 = time.perf_counter()
        busy = self._inflight is not None and not self._inflight.done()
        if not busy:
            self._settle(wait=False)  # it may have ended since the first look: its error must surface
        if self.on_busy is OnBusy.SKIP and self._skips(step, busy):
            return None
        if busy or sharded is not None:
            self._wait_inflight()  # DCP writes into the step's directory now: nothing else may be
        dcp_files = self._save_sharded(step, sharded) if sharded is not None else []
        skeleton, leaves = encode(state)
        self.last_nbytes = sum(leaf.tensor.nbytes for leaf in leaves)
        if pipeline:
            self._hook(pipeline)
            self._staged.clear()
            fut = self._pool.submit(self._save_job, step, None, leaves, skeleton, extra, dcp_files)
        else:
            slots = self.writer.arena.stage(leaves)
            fut = self._pool.submit(self._save_job, step, slots, None, skeleton, extra, dcp_files)
        self.last_block_s = time.perf_counter() - t0
        self._inflight, self._inflight_step, self._inflight_t0 = fut, step, time.perf_counter()
        self._last = (step, fut)
        self.saved += 1
        fut.add_done_callback(functools.partial(self._log_failure, step))
        return fut

    def _saved_already(self, step: int) -> Future[Manifest | None] | None:
        """The future of ``step``'s save where it needs no other: this rank's save of it, or its
        committed checkpoint; None where it must be saved."""
        if self._last is not None and self._last[0] == step:
            # the same step again (a preemption's final save that the periodic one already
            # covers): same state, and a second writer into the same temporary directory would
            # race with rank 0 renaming it
            return self._last[1]
        if (self.root / step_name(step)).is_dir():
            # committed before a recovery that replays it (see forget_unfinished): every rank
            # sees the same directory, so every rank skips it alike
            done: Future[Manifest | None] = Future()
            done.set_result(read_manifest(self.root / step_name(step) / MANIFEST) if self.rank == 0 else None)
            return done
        return None

    def _skips(self, step: int, busy: bool) -> bool:
        """``on_busy: skip``: whether ``step`` is skipped, the previous save being still in flight
        here (``busy``) or on another rank."""
        if self.world_size > 1:  # every rank must skip the same steps, or no step commits
            busy = self._any_busy(step, busy)
        if busy:
            self.skipped += 1
            logger.info(f"checkpoint at step {step} skipped: the previous one is still being written")
        return busy

    def _save_sharded(self, step: int, sharded: dict[str, Any]) -> list[str]:
        """DCP's collective write of ``sharded`` into the step's temporary directory: its files."""
        tmp = self.root / tmp_name(step, self.token)
        tmp.mkdir(parents=True, exist_ok=True)
        from resilient.checkpoint.sharded import save_sharded  # DCP: ~0.5 s to import, only if used

        return [f"dcp/{p}" for p in save_sharded(sharded, tmp / "dcp")]

    def _hook(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """A pipelined save's pre-step hook on each optimizer, once: it waits for the copy."""
        for opt in optimizers:
            if opt not in self._hooked:
                opt.register_step_pre_hook(self._before_optimizer_step)
                self._hooked.add(opt)

    def _before_optimizer_step(self, *_: Any) -> None:
        if not self._staged.is_set():
            t0 = time.perf_counter()
            if not self._staged.wait(self.config.commit_timeout_s):
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
                slots = self.writer.arena.stage(leaves)
            finally:
                self._staged.set()
        pinned = self._uploads.pinned() if self._uploads is not None else frozenset()
        manifest = self.writer.write(SaveJob(step, slots, skeleton, extra, dcp_files, pinned))
        if manifest is not None and self._uploads is not None:
            self._uploads.submit(self.root, manifest)
        return manifest

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
            fut.result(timeout=self.config.commit_timeout_s + 60)
        except Exception as e:
            self._last = None
            raise CheckpointError(f"checkpoint {step_name(step)} failed: {type(e).__name__}: {e}") from e

    def forget_unfinished(self) -> list[Path]:
        """After a recovery, once every rank's save in flight was settled (committed or failed):
        a replayed step is saved afresh unless it was committed. Each rank forgets the save it
        made itself (a peer may not have made it, or rank 0's commit of it may have failed and
        removed its part), and rank 0 removes this writer's uncommitted temporary directories,
        whose parts and failure reports would otherwise meet the replay's. The caller makes
        sure no rank saves before rank 0 returned from here. Returns the directories removed."""
        self._settle(wait=True)
        self._last = None
        if self.rank != 0:
            return []
        gone = []
        for _, token, path in tmp_dirs(self.root):
            if token == self.token:
                shutil.rmtree(path, ignore_errors=True)
                gone.append(path)
        return gone

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
            if self._uploads is not None:
                self._uploads.close()
        finally:
            self._pool.shutdown(wait=True)
            self.writer.close()

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
            loaded = self.load_from_tier(sharded)
        elif loaded is not None and self.rank == 0:  # every rank voted these bad: out of the way
            for bad in loaded.rejected_steps:
                if (moved := quarantine(self.root, bad)) is not None:
                    logger.warning(f"checkpoint step {bad} does not verify: moved to {moved}")
        return loaded

    def load_from_tier(self, sharded: dict[str, Any] | None = None) -> Loaded | None:
        """The newest checkpoint of the persistent tier that loads on this rank (None without a tier,
        or when none loads), fetched into a cache beside the local root."""
        if self.tier is None:
            return None
        return restore_from_tier(self.tier, self.root, self.rank, self.world_size, sharded)

    def committed(self) -> list[int]:
        return committed_steps(self.root)

    def manifest(self, step: int) -> Manifest:
        return read_manifest(self.root / step_name(step) / MANIFEST)


def _config(
    config: CheckpointConfig | str | os.PathLike[str], fields: dict[str, Any]
) -> tuple[CheckpointConfig, Path]:
    """The one validated checkpoint config, and its directory: ``config``, or the directory it
    names with ``fields`` (a field left None takes the config's default); an error names the field."""
    if isinstance(config, CheckpointConfig):
        if fields:
            raise CheckpointError(
                f"Checkpointer: a CheckpointConfig, or its fields as keywords, not both: {sorted(fields)}"
            )
        cfg = config
    else:
        try:
            cfg = CheckpointConfig(dir=Path(config), **{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "?"
            raise CheckpointError(f"Checkpointer({name}={err.get('input')!r}): {err['msg']}") from None
    if cfg.dir is None:
        raise CheckpointError("checkpoint.dir is not set: there is nowhere to write checkpoints")
    return cfg, Path(cfg.dir)


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
