"""Peer benchmark: NVIDIA Resiliency Extension (NVRx) asynchronous checkpointing on CPU only.

What it measures
----------------
``measure(state, where)`` saves a (nested) dict of CPU tensors with NVRx's async checkpoint stack,
the one its ``examples/checkpointing/async_writer.py`` uses: ``save_state_dict_async_plan`` with a
``FileSystemWriterAsync`` (torch.distributed.checkpoint format: one ``__0_<i>.distcp`` file per
writer bucket plus ``.metadata``), an ``AsyncRequest`` scheduled on a persistent
``AsyncCallsQueue``, and ``save_state_dict_async_finalize`` as the request's finalize function.

- ``block_s``: best time the caller is blocked to start a save, i.e. planning
  (``save_state_dict_async_plan``) + ``schedule_async_request``. The latter returns once NVRx's
  persistent worker has received the request and run its preload step.
- ``total_s``: best time from the start of that call until the checkpoint is durable: the
  worker wrote and fsynced the data files, the caller's finalize wrote and fsynced ``.metadata``
  (NVRx / torch DCP do both: ``"fsync": "nvrx"``), plus an fsync of the checkpoint directory and of
  its parent that we add (``"dir_fsync": "added"``; neither NVRx nor DCP syncs directories).
  Completion is polled every millisecond with ``maybe_finalize_async_calls(blocking=False)``.
- ``finalize_s``: the part of ``total_s`` spent in the caller's finalize (metadata write), which in
  a training loop blocks the next ``maybe_finalize_async_calls``.
- ``first_block_s`` / ``first_total_s``: the first (cold) save, which also spawns NVRx's worker
  process and a multiprocessing Manager (both re-import ``__main__`` and torch: seconds).
- ``cloned_block_s`` / ``cloned_total_s``: the same with a caller-side ``clone()`` of every tensor
  before planning, i.e. what a *consistent* CPU checkpoint costs with NVRx (see caveat 3).

The written checkpoint is loaded back with ``torch.distributed.checkpoint.load`` and compared with
``torch.equal`` tensor by tensor (first and last plain save); a mismatch raises RuntimeError.

NVRx caveats found (nvidia-resiliency-ext 0.4.1, torch 2.13 CPU build)
---------------------------------------------------------------------
1. The documented entry points do not run without CUDA. ``TorchAsyncCheckpoint.async_save`` calls
   ``torch.cuda.synchronize()`` unconditionally (AssertionError "Torch not compiled with CUDA
   enabled"), so does ``AsyncCallsQueue(persistent=False)`` (TemporalAsyncCaller), and so does the
   ``preload_fn`` returned by ``FileSystemWriterAsync.get_save_function_and_args()``. With the
   persistent queue that preload runs in the worker: the worker dies and the caller hangs forever
   in ``schedule_async_request`` (it waits on a JoinableQueue, no liveness check). This benchmark
   therefore passes NVRx's own ``FileSystemWriterAsync.preload_tensors`` with
   ``non_blocking=False`` (which skips the CUDA sync; a no-op ``.to("cpu")`` for CPU tensors).
   Likewise ``maybe_finalize_async_calls(no_dist=False)`` and ``AsyncCallsQueue.close()`` with a
   pending call all-reduce a tensor on ``torch.cuda.current_device()``: everything here finalizes
   with ``no_dist=True`` before closing.
2. A process group is required (``torch.distributed.get_rank()`` in the caller, the writer and the
   finalize); ``measure`` creates a 1-rank gloo group on a free port if none exists and destroys it.
3. Not a snapshot on CPU. The request travels to the worker through a multiprocessing queue, which
   moves every CPU tensor's storage into shared memory *in place* (the caller's tensors, and so the
   model's parameters, now live in shm, counted against /dev/shm; the first save pays the copy).
   The worker then writes from the live tensors: an in-place update (optimizer step) after
   ``schedule`` returns and before the write ends lands in the checkpoint (verified). A consistent
   checkpoint needs a caller-side copy, measured as ``cloned_*``.
4. Processes: one persistent worker (spawn) per queue, which forks one writer process per bucket
   (``thread_count``) for every save, plus a Manager server process (spawn) behind a module-global
   results queue that NVRx never stops; ``measure`` stops it through that private global. Left
   after ``measure`` (both the standard library's, gone at exit): multiprocessing's
   resource_tracker process and the resource_sharer thread that passed the shared-memory fds.
   Because of ``spawn``, the caller's main module must be import-safe (``__main__`` guard).
5. ``maybe_finalize_async_calls(blocking=True)`` polls every 0.1 s (so it would add up to 100 ms to
   ``total_s``) and never notices a dead worker; hence our own poll loop with a liveness check.

Usage: python benchmarks/peers/nvrx_async_ckpt.py [--layers 5] [--width 1024] [--repeat 3]
Prints one JSON line on stdout (diagnostics on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async  # noqa: E402
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest  # noqa: E402
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (  # noqa: E402
    FileSystemWriterAsync,
)
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (  # noqa: E402
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

API = (
    "nvidia_resiliency_ext.checkpointing.async_ckpt: AsyncCallsQueue(persistent=True) + AsyncRequest"
    " + FileSystemWriterAsync + save_state_dict_async_plan/finalize (torch DCP format),"
    " preload_fn=FileSystemWriterAsync.preload_tensors(non_blocking=False)"
)
POLL_S = 0.001


def _tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor leaf of nested dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _tensors(v, f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _tensors(v, f"{prefix}/{i}")]
    return []


def _map_tensors(obj: Any, fn: Any) -> Any:
    """Copy of ``obj`` with ``fn`` applied to every tensor leaf; other leaves deep-copied."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return copy.deepcopy(obj)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(queue: AsyncCallsQueue) -> Any:
    """NVRx's persistent worker process (an mp.Process), or None before the first request."""
    caller = queue.persistent_caller
    return None if caller is None else caller.process


@contextlib.contextmanager
def _schedule_guard(queue: AsyncCallsQueue, timeout_s: float) -> Iterator[None]:
    """Turn a hang in ``schedule_async_request`` into RuntimeError (main thread only).

    The caller waits there on a JoinableQueue until the worker has run the preload step; if the
    worker dies first (e.g. NVRx's CUDA preload on a CPU-only torch) it waits forever. A watchdog
    thread then interrupts the wait with SIGUSR1, whose handler raises.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main_ident = threading.get_ident()
    reason: list[str] = []
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        raise RuntimeError(reason[0] if reason else f"NVRx async save interrupted by signal {signum}")

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not stop.wait(0.01):
            proc = _worker(queue)
            if proc is not None and not proc.is_alive():
                reason.append(
                    f"NVRx persistent checkpoint worker died (exit code {proc.exitcode}) while the"
                    " caller waited in schedule_async_request (the worker's traceback is on stderr)"
                )
            elif time.monotonic() > deadline:
                reason.append(f"NVRx schedule_async_request still blocked after {timeout_s:.0f} s")
            else:
                continue
            signal.pthread_kill(main_ident, signal.SIGUSR1)
            return

    previous = signal.signal(signal.SIGUSR1, on_signal)
    watchdog = threading.Thread(target=watch, name="nvrx-schedule-guard", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        stop.set()
        watchdog.join()
        signal.signal(signal.SIGUSR1, previous)


def _wait_finalized(queue: AsyncCallsQueue, timeout_s: float) -> float:
    """Poll until the pending request is written and finalized; returns the finalize call's time."""
    deadline = time.perf_counter() + timeout_s
    while True:
        f0 = time.perf_counter()
        if queue.maybe_finalize_async_calls(blocking=False, no_dist=True):
            return time.perf_counter() - f0
        proc = _worker(queue)
        if proc is None or not proc.is_alive():
            code = None if proc is None else proc.exitcode
            raise RuntimeError(
                f"NVRx persistent checkpoint worker died (exit code {code}) before finishing the save"
            )
        if time.perf_counter() > deadline:
            raise RuntimeError(f"NVRx async save not finished after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _save_once(
    queue: AsyncCallsQueue,
    cache: CheckpointMetadataCache,
    state: dict[str, Any],
    path: Path,
    *,
    clone: bool,
    thread_count: int,
    timeout_s: float,
) -> dict[str, float]:
    with _schedule_guard(queue, timeout_s):
        t0 = time.perf_counter()
        src = _map_tensors(state, lambda t: t.detach().clone()) if clone else state
        writer = FileSystemWriterAsync(path, thread_count=thread_count)
        plan_ret = save_state_dict_async_plan(src, writer, None, 0, enable_cache=True, metadata_cache=cache)
        # The preload_fn returned here (non_blocking=True) calls torch.cuda.synchronize(): caveat 1.
        save_fn, _cuda_preload_fn, save_args = writer.get_save_function_and_args()
        if save_fn is None:
            raise RuntimeError("NVRx planned nothing to write for this state dict")
        request = AsyncRequest(
            save_fn,
            save_args,
            [partial(save_state_dict_async_finalize, *plan_ret)],
            preload_fn=partial(FileSystemWriterAsync.preload_tensors, writer.write_buckets, False),
        )
        t_plan = time.perf_counter()
        queue.schedule_async_request(request)
        t_block = time.perf_counter()
    finalize_s = _wait_finalized(queue, timeout_s)
    _fsync_dir(path)
    _fsync_dir(path.parent)
    t_total = time.perf_counter()
    return {
        "plan_s": t_plan - t0,
        "block_s": t_block - t0,
        "total_s": t_total - t0,
        "finalize_s": finalize_s,
    }


def _verify(state: dict[str, Any], path: Path) -> int:
    """Load ``path`` into a zeroed copy of ``state``; raise unless every tensor is torch.equal."""
    loaded = _map_tensors(state, torch.zeros_like)
    dcp.load(loaded, checkpoint_id=str(path))
    want, got = _tensors(state), _tensors(loaded)
    if [k for k, _ in want] != [k for k, _ in got]:
        raise RuntimeError(f"NVRx checkpoint {path} loads back with a different structure")
    bad = [k for (k, a), (_, b) in zip(want, got, strict=True) if not torch.equal(a, b)]
    if bad:
        raise RuntimeError(f"NVRx checkpoint {path} loads back different tensors: {bad[:5]}")
    return len(want)


def _stop_nvrx(queue: AsyncCallsQueue) -> None:
    """Stop NVRx's worker and its results-queue Manager; leave no child process behind."""
    proc = _worker(queue)
    if proc is not None and proc.is_alive() and queue.get_num_unfinalized_calls() == 0:
        queue.close()  # sends 'DONE' and joins the worker
    elif proc is not None:
        # A pending call or a dead worker: close() would all-reduce on CUDA or wait forever.
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
        proc.join(10)
        queue.persistent_caller.process = None
    # NVRx keeps a Manager().Queue() in a module global and never shuts the Manager down.
    results_queue = filesystem_async._results_queue
    manager = getattr(results_queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None


def _size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def measure(
    state: dict[str, Any],
    where: Path,
    repeat: int = 2,
    *,
    thread_count: int = 1,
    cloned: bool = True,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Save ``state`` (CPU tensors) asynchronously with NVRx ``repeat`` times under ``where``.

    Returns best-of-``repeat`` ``block_s`` / ``total_s`` (see the module docstring), ``bytes``
    written per checkpoint and the API used. Raises RuntimeError (stating the NVRx exception or
    missing capability) if NVRx cannot save on CPU, or if the checkpoint does not load back equal.
    """
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    leaves = _tensors(state)
    if not leaves:
        raise ValueError("state holds no tensor")
    off_cpu = [k for k, t in leaves if t.device.type != "cpu"]
    if off_cpu:
        raise ValueError(f"measure() takes CPU tensors only; not on CPU: {off_cpu[:5]}")

    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="nvrx-async-", dir=where))
    own_group = not dist.is_initialized()
    queue: AsyncCallsQueue | None = None
    try:
        if own_group:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=120),
            )
        queue = AsyncCallsQueue(persistent=True)
        cache = CheckpointMetadataCache()
        runs: list[dict[str, float]] = []
        nbytes = nfiles = ntensors = 0
        for i in range(repeat):
            path = root / f"plain{i}"
            runs.append(
                _save_once(
                    queue,
                    cache,
                    state,
                    path,
                    clone=False,
                    thread_count=thread_count,
                    timeout_s=timeout_s,
                )
            )
            nbytes, nfiles = _size(path)
            if i in (0, repeat - 1):
                ntensors = _verify(state, path)
            shutil.rmtree(path)
        clone_runs: list[dict[str, float]] = []
        if cloned:
            for i in range(repeat):
                path = root / f"cloned{i}"
                clone_runs.append(
                    _save_once(
                        queue,
                        cache,
                        state,
                        path,
                        clone=True,
                        thread_count=thread_count,
                        timeout_s=timeout_s,
                    )
                )
                shutil.rmtree(path)
    except (RuntimeError, ValueError):
        raise
    except Exception as exc:  # e.g. AssertionError "Torch not compiled with CUDA enabled"
        raise RuntimeError(f"NVRx async checkpoint failed on CPU: {type(exc).__name__}: {exc}") from exc
    finally:
        try:
            if queue is not None:
                _stop_nvrx(queue)
        finally:
            if own_group and dist.is_initialized():
                dist.destroy_process_group()
            shutil.rmtree(root, ignore_errors=True)

    result: dict[str, Any] = {
        "api": API,
        "block_s": min(r["block_s"] for r in runs),
        "total_s": min(r["total_s"] for r in runs),
        "bytes": nbytes,
        "fsync": "nvrx",
        "dir_fsync": "added",
        "files": nfiles,
        "tensors_verified": ntensors,
        "plan_s": min(r["plan_s"] for r in runs),
        "finalize_s": min(r["finalize_s"] for r in runs),
        "first_block_s": runs[0]["block_s"],
        "first_total_s": runs[0]["total_s"],
        "consistent_snapshot": False,
        "repeat": repeat,
        "thread_count": thread_count,
        "cuda": torch.cuda.is_available(),
    }
    if clone_runs:
        result["cloned_block_s"] = min(r["block_s"] for r in clone_runs)
        result["cloned_total_s"] = min(r["total_s"] for r in clone_runs)
    return result


def _build_state(layers: int, width: int) -> dict[str, Any]:
    """Linear(width, width) layers + AdamW state after one step (float32, CPU)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5, help="Linear layers (5 x 1024^2: ~63 MB)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--thread-count", type=int, default=1, help="NVRx writer processes per save")
    parser.add_argument("--dir", default="/var/tmp", help="parent of the temporary checkpoint dir")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    state = _build_state(args.layers, args.width)
    tmp = Path(tempfile.mkdtemp(prefix="nvrx-async-ckpt-", dir=args.dir))
    try:
        result = measure(state, tmp, repeat=args.repeat, thread_count=args.thread_count)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    left = [" ".join(p.cmdline()[-2:]) for p in psutil.Process().children(recursive=True)]
    print(f"child processes left after measure(): {left}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
