"""Checkpoint save figures, side by side with torch.save, DCP and the machine's limits, in one run.

For each state size (a stack of Linear layers with AdamW-like moments, float32):
- limits: copy into reused host buffers (the floor of any blocking save); dd with fsync (the
  floor of any persist);
- peers: torch.save + fsync; dcp.save (blocking); dcp.async_save (time the caller is blocked);
- ours: blocking time of ``Checkpointer.save`` (steady state: buffers reused), pipelined blocking
  time (copy overlapped with a forward/backward; the optimizer step waits only if the copy is not
  done), and persist throughput (bytes / time from save to commit, fsync included);
- writer thread vs writer process: persist time of the same staged bytes, and how much a
  Python-bound training loop slows down while each persists.
Then the bundled example, 2 ranks, with a checkpoint every 10 steps (writer thread, writer process)
vs none, alternating runs, in three setups (see EXAMPLE_SETUPS).

    python benchmarks/checkpoint.py [--sizes 0.5 2] [--dir /var/tmp/ckbench] [--repeat 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos import results  # noqa: E402
from chaos.harness import run_ranks  # noqa: E402
from resilient.checkpoint.codec import encode  # noqa: E402
from resilient.checkpoint.manager import Checkpointer  # noqa: E402
from resilient.checkpoint.staging import Arena, extent  # noqa: E402

GB = 1e9


def make_model(gb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers whose params + two Adam moments total ``gb``; one step so the moments exist."""
    width = 2048
    per_layer = width * width * 4 * 3  # weight + exp_avg + exp_avg_sq
    layers = max(1, round(gb * GB / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def nbytes(state: Any) -> int:
    return sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in encode(state)[1])


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def best(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ---- limits ---------------------------------------------------------------------------------------
def copy_limit(state: dict[str, Any], repeat: int) -> float:
    leaves = [leaf.tensor for leaf in encode(state)[1]]
    bufs = [torch.empty_like(t) for t in leaves]

    def go() -> None:
        for b, t in zip(bufs, leaves, strict=True):
            b.copy_(t)

    go()  # first touch of the buffers is not part of the limit
    return best(go, repeat)


def dd_limit(size: int, where: Path) -> float:
    out = where / "dd.bin"
    bs = 16 << 20
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={out}", f"bs={bs}", f"count={max(1, size // bs)}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    el = time.perf_counter() - t0
    out.unlink()
    return max(1, size // bs) * bs / el


# ---- peers ----------------------------------------------------------------------------------------
def torch_save(state: dict[str, Any], where: Path) -> float:
    path = where / "torch.pt"
    t0 = time.perf_counter()
    torch.save(state, path)
    fsync_path(path)
    el = time.perf_counter() - t0
    path.unlink()
    return el


def dcp_times(state: dict[str, Any], where: Path) -> tuple[float, float, float]:
    """(dcp.save, dcp.async_save blocking, dcp.async_save total) on a 1-rank gloo group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    d1, d2 = where / "dcp_sync", where / "dcp_async"
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(d1))
    sync_s = time.perf_counter() - t0
    shutil.rmtree(d1)
    dcp.async_save(state, checkpoint_id=str(where / "dcp_warm")).result()  # warm-up (first-call setup)
    shutil.rmtree(where / "dcp_warm")
    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=str(d2))
    block_s = time.perf_counter() - t0
    fut.result()
    total_s = time.perf_counter() - t0
    shutil.rmtree(d2)
    return sync_s, block_s, total_s


# ---- ours -----------------------------------------------------------------------------------------
def ours(model: torch.nn.Module, opt: torch.optim.Optimizer, where: Path, repeat: int) -> dict[str, float]:
    root = where / "ours"
    blocks, persists = [], []
    with Checkpointer(root, token="bench", keep=1, incremental=False) as ck:
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            fut = ck.save(i + 1, state_of(model, opt))
            blocked = ck.last_block_s
            assert fut is not None
            fut.result()
            if i:  # the first save allocates the staging buffers
                blocks.append(blocked)
                persists.append(time.perf_counter() - t0)
        # pipelined: the copy overlaps a forward/backward; opt.step waits for it only if needed
        x = torch.randn(64, model[0].in_features)
        pipe = []
        for i in range(repeat):
            ck.wait()
            opt.zero_grad()
            t0 = time.perf_counter()
            ck.save(100 + i, state_of(model, opt), pipeline=[opt])
            model(x).sum().backward()
            compute_s = time.perf_counter() - t0
            opt.step()
            pipe.append(ck.last_block_s)
        ck.wait()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "block_s": min(blocks),
        "persist_s": statistics.median(persists),
        "pipelined_block_s": min(pipe),
        "fwd_bwd_s": compute_s,
    }


# ---- writer thread vs process ---------------------------------------------------------------------
def _persist_file(src: str, layout: list[tuple[int, int]], dst: str) -> float:
    """The writer's work on staged bytes: per-tensor hash, write, file hash, fsync."""
    import mmap

    t0 = time.perf_counter()
    with open(src, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(mm)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    h = xxhash.xxh3_128()
    try:
        for off, n in layout:
            part = view[off : off + n]
            xxhash.xxh3_128_hexdigest(part)
            while part:
                w = os.write(fd, part)
                h.update(part[:w])
                part = part[w:]
        os.fsync(fd)
        del part
    finally:
        os.close(fd)
        view.release()
        mm.close()
    return time.perf_counter() - t0


def _python_loop(stop: threading.Event) -> int:
    """A Python-bound training loop stand-in: small tensor ops dispatched from Python."""
    a = torch.randn(32, 32)
    n = 0
    while not stop.is_set():
        a = torch.tanh(a @ a) * 0.5
        n += 1
    return n


def _loop_rate(during: Any) -> float:
    stop = threading.Event()
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(_python_loop(stop)))
    t0 = time.perf_counter()
    t.start()
    try:
        during()
    finally:
        stop.set()
        t.join()
    return result[0] / (time.perf_counter() - t0)


def thread_vs_process(state: dict[str, Any], where: Path) -> dict[str, float]:
    shm = Path(tempfile.mkdtemp(prefix="ckbench-", dir="/dev/shm"))
    try:
        arena = Arena(shm / "staged.bin")
        leaves = encode(state)[1]
        slots = arena.stage(leaves)
        layout = [(s.offset, s.nbytes) for s in slots]
        size = extent(slots)
        dst = str(where / "tvp.bin")
        pool = cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
        pool.submit(time.time).result()  # the worker is up before anything is timed

        def in_thread() -> None:
            th = threading.Thread(target=_persist_file, args=(str(shm / "staged.bin"), layout, dst))
            th.start()
            th.join()

        def in_process() -> None:
            pool.submit(_persist_file, str(shm / "staged.bin"), layout, dst).result()

        idle = _loop_rate(lambda: time.sleep(1.0))
        out: dict[str, float] = {"loop_idle_per_s": idle}
        for name, fn in (("thread", in_thread), ("process", in_process)):
            t0 = time.perf_counter()
            rate = _loop_rate(fn)
            out[f"{name}_persist_s"] = time.perf_counter() - t0
            out[f"{name}_loop_per_s"] = rate
        pool.shutdown()
        os.unlink(dst)
        out["bytes"] = size
        arena.release()
        return out
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# ---- the example ----------------------------------------------------------------------------------
EXAMPLE_SETUPS = {
    # name: (train_tiny args, what it stands for)
    "dim32": (["--dim", "32"], "the example as shipped: 5 ms CPU-bound steps (a durable commit every 50 ms)"),
    "dim256": (["--dim", "256"], "a wider model, CPU-bound steps"),
    "dim256-50ms": (["--dim", "256", "--step-ms", "50"], "50 ms steps, CPU idle part of each (GPU-like)"),
}


def example_throughput(trials: int, steps: int) -> dict[str, Any]:
    """Steps/s of the example on 2 ranks, checkpoint every 10 steps vs none, alternating runs."""
    example = str(ROOT / "examples" / "train_tiny.py")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        for name, (setup, meaning) in EXAMPLE_SETUPS.items():
            rates: dict[str, list[float]] = {"none": [], "every10": [], "every10-process": []}
            state_mb = 0.0
            for t in range(trials):
                for mode in rates:  # alternating, so drift hits every mode alike
                    cwd = Path(d) / f"{name}-{mode}{t}"
                    cwd.mkdir()
                    ck = cwd / "ck"
                    extra = ["--ckpt-dir", str(ck), "--ckpt-every", "10"] if mode != "none" else []
                    if mode == "every10-process":
                        extra += ["--ckpt-writer", "process"]
                    res = run_ranks(
                        [example, "--steps", str(steps), "--report", *setup, *extra],
                        2,
                        cwd=cwd,
                        run_id=f"{name}-{mode}{t}",
                        timeout=600,
                    )
                    assert res.ok, res.describe()
                    line = [x for x in res.ranks[0].stdout.splitlines() if x.startswith("{")][-1]
                    rep = json.loads(line)
                    rates[mode].append(rep["steps"] / rep["loop_s"])
                    if mode == "every10":
                        newest = max(ck.glob("step-*"))  # one checkpoint's own shards, both ranks
                        state_mb = sum(p.stat().st_size for p in newest.glob("*.bin")) / 1e6
            med = {k: statistics.median(v) for k, v in rates.items()}
            out[name] = {"meaning": meaning, "steps_per_s": med, "ratio": med["every10"] / med["none"],
                         "ratio_process": med["every10-process"] / med["none"],
                         "trials": rates, "ckpt_mb": state_mb}  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2.0], help="state sizes in GB")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/ckbench"), help="a directory on a real disk")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--example-trials", type=int, default=3)
    p.add_argument("--example-steps", type=int, default=200)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "checkpoint.json")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    st = results.begin(repeat=args.repeat, example_trials=args.example_trials)
    found: dict[str, Any] = {"sizes": {}}
    try:
        for gb in args.sizes:
            model, opt = make_model(gb)
            state = state_of(model, opt)
            size = nbytes(state)
            r: dict[str, Any] = {"bytes": size}
            r["copy_s"] = copy_limit(state, args.repeat)
            r["dd_Bps"] = dd_limit(size, args.dir)
            r["torch_save_s"] = torch_save(state, args.dir)
            r["dcp_save_s"], r["dcp_async_block_s"], r["dcp_async_total_s"] = dcp_times(state, args.dir)
            r.update(ours(model, opt, args.dir, args.repeat))
            r["persist_Bps"] = size / r["persist_s"]
            r["writer"] = thread_vs_process(state, args.dir)
            found["sizes"][f"{gb:g}"] = r
            print(json.dumps({f"{gb:g}GB": r}, indent=1), flush=True)
            del model, opt, state
        if args.example_trials:
            found["example"] = example_throughput(args.example_trials, args.example_steps)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, found, st)
    report(found)


def report(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="checkpoint save (lower is better unless marked)")
    t.add_column("state")
    cols = ["copy limit", "dd+fsync", "torch.save", "dcp.save", "dcp.async blk", "ours blk"]
    cols += ["ours pipe blk", "ours persist", "blk/copy", "pipe/copy", "dcp.async/ours", "persist/dd"]
    for c in cols:
        t.add_column(c, justify="right")
    for r in results["sizes"].values():
        t.add_row(
            f"{r['bytes'] / GB:.2f} GB",
            f"{r['copy_s']:.3f}s",
            f"{r['dd_Bps'] / GB:.2f} GB/s",
            f"{r['torch_save_s']:.2f}s",
            f"{r['dcp_save_s']:.2f}s",
            f"{r['dcp_async_block_s']:.3f}s",
            f"{r['block_s']:.3f}s",
            f"{r['pipelined_block_s']:.3f}s",
            f"{r['persist_Bps'] / GB:.2f} GB/s",
            f"{r['block_s'] / r['copy_s']:.2f}x",
            f"{r['pipelined_block_s'] / r['copy_s']:.2f}x",
            f"{r['dcp_async_block_s'] / r['block_s']:.1f}x",
            f"{r['persist_Bps'] / r['dd_Bps']:.0%}",
        )
    w = Table(title="writer: thread vs process (same staged bytes; loop = Python-bound training stand-in)")
    for c in ("state", "thread persist", "process persist", "loop idle/s", "w/ thread", "w/ process"):
        w.add_column(c, justify="right")
    for r in results["sizes"].values():
        x = r["writer"]
        w.add_row(
            f"{x['bytes'] / GB:.2f} GB",
            f"{x['thread_persist_s']:.2f}s",
            f"{x['process_persist_s']:.2f}s",
            f"{x['loop_idle_per_s']:.0f}",
            f"{x['thread_loop_per_s'] / x['loop_idle_per_s']:.0%}",
            f"{x['process_loop_per_s'] / x['loop_idle_per_s']:.0%}",
        )
    c = Console(width=200)
    c.print(t)
    c.print(w)
    for name, e in results.get("example", {}).items():
        c.print(
            f"example {name} ({e['meaning']}; {e['ckpt_mb']:.1f} MB per checkpoint, 2 ranks): "
            f"{e['steps_per_s']['none']:.1f} steps/s without checkpoints, "
            f"{e['steps_per_s']['every10']:.1f} with one every 10 steps → {e['ratio']:.1%} "
            f"(writer process: {e['ratio_process']:.1%})"
        )


if __name__ == "__main__":
    main()
