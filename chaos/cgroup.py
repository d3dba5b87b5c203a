"""Real cgroup v1 memory limits for kernel OOM-kill faults (root only): made, and removed with
whatever is still charged to them, even when the run they served failed."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil


def sweep_stale(base: Path) -> list[Path]:
    """Remove the ``chaos-[slow-|cpu-]<pid>-...`` cgroups of chaos runs whose process is gone
    (SIGKILLed before its ``finally``), killing (memory) or releasing (blkio, cpu) what is left in them."""
    gone = []
    for cg in base.glob("chaos-*"):
        pid = cg.name.removeprefix("chaos-").removeprefix("slow-").removeprefix("cpu-").split("-")[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        if base.name in ("blkio", "cpu"):
            release_blkio(cg)
        else:
            remove_cgroup(cg)
        gone.append(cg)
    return gone


def memory_cgroup(limit_mib: int) -> tuple[Path | None, str]:
    """A fresh cgroup v1 memory cgroup limited to ``limit_mib`` (root only), or (None, why not)."""
    base = Path("/sys/fs/cgroup/memory")
    if not (base / "cgroup.procs").exists():
        return None, "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    if os.geteuid() != 0:
        return None, "creating a memory cgroup needs root"
    sweep_stale(base)
    cg = base / f"chaos-{os.getpid()}-{time.monotonic_ns()}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(limit_mib << 20))
    except OSError as e:
        return None, f"cannot create a memory cgroup here: {e}"
    return cg, ""


def remove_cgroup(cg: Path, *, strict: bool = False) -> None:
    """SIGKILL what is left in ``cg``, then remove it (``strict``: raise if it cannot be)."""
    with contextlib.suppress(OSError):
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while cg.exists() and time.monotonic() < deadline:  # rmdir works once its tasks are gone
        try:
            cg.rmdir()
        except OSError:
            time.sleep(0.05)
    if strict and cg.exists():
        raise OSError(f"{cg}: still in use 10 s after its tasks were killed")


def cpu_cgroup() -> tuple[Path | None, str]:
    """A fresh cgroup v1 ``cpu`` cgroup, its quota not set yet (root only), or (None, why not)."""
    base = Path("/sys/fs/cgroup/cpu")
    if not (base / "cpu.cfs_quota_us").exists():
        return None, "no cgroup v1 cpu controller with CFS quotas at /sys/fs/cgroup/cpu"
    if os.geteuid() != 0:
        return None, "creating a cpu cgroup needs root"
    sweep_stale(base)
    cg = base / f"chaos-cpu-{os.getpid()}-{time.monotonic_ns()}"
    try:
        cg.mkdir()
    except OSError as e:
        return None, f"cannot create a cpu cgroup here: {e}"
    return cg, ""


def set_cpu_quota(cg: Path, fraction: float, period_us: int = 100_000) -> int:
    """Limit ``cg`` to ``fraction`` of one CPU (CFS quota per period); returns the quota in µs."""
    quota = max(1000, int(fraction * period_us))
    (cg / "cpu.cfs_period_us").write_text(str(period_us))
    (cg / "cpu.cfs_quota_us").write_text(str(quota))
    return quota


def blkio_cgroup(path: Path, write_bps: int) -> tuple[Path | None, str]:
    """A fresh cgroup v1 blkio cgroup whose writes to the block device holding ``path`` are
    throttled to ``write_bps`` bytes/s (root only), or (None, why not).

    Writes are charged to the task that submits them: a checkpoint writer's ``fsync`` submits
    its own dirty pages, so its commit really proceeds at that rate (measured here: ``dd ...
    conv=fsync`` of 10 MiB at a 2 MiB/s limit takes 4.99 s, 0.02 s outside the cgroup)."""
    base = Path("/sys/fs/cgroup/blkio")
    if not (base / "cgroup.procs").exists():
        return None, "no cgroup v1 blkio controller at /sys/fs/cgroup/blkio"
    if not (base / "blkio.throttle.write_bps_device").exists():
        return None, "the blkio controller has no throttling (blkio.throttle.write_bps_device)"
    if os.geteuid() != 0:
        return None, "creating a blkio cgroup needs root"
    sweep_stale(base)
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not Path(f"/sys/dev/block/{dev}").exists():
        return None, f"{path} is not on a block device ({dev}: tmpfs/overlay?), blkio cannot throttle it"
    cg = base / f"chaos-slow-{os.getpid()}-{time.monotonic_ns()}"
    try:
        cg.mkdir()
        (cg / "blkio.throttle.write_bps_device").write_text(f"{dev} {write_bps}")
    except OSError as e:
        with contextlib.suppress(OSError):
            cg.rmdir()
        return None, f"cannot throttle writes to {dev} here: {e}"
    return cg, ""


def release_blkio(cg: Path) -> None:
    """Move every task of ``cg`` back to its controller's root cgroup (unthrottled: blkio, cpu),
    remove ``cg``."""
    root = cg.parent / "cgroup.procs"
    deadline = time.monotonic() + 10
    while cg.exists() and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            for pid in (cg / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # exited meanwhile
                    root.write_text(pid)
        try:
            cg.rmdir()
        except OSError:
            time.sleep(0.05)
