"""Real cgroup v1 memory limits for kernel OOM-kill faults (root only): made, and removed with
whatever is still charged to them, even when the run they served failed."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def memory_cgroup(limit_mib: int) -> tuple[Path | None, str]:
    """A fresh cgroup v1 memory cgroup limited to ``limit_mib`` (root only), or (None, why not)."""
    base = Path("/sys/fs/cgroup/memory")
    if not (base / "cgroup.procs").exists():
        return None, "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    if os.geteuid() != 0:
        return None, "creating a memory cgroup needs root"
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
