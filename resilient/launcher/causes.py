"""How the agent names a worker's death, and what it saves of a silent one before killing it.

A death is reported with its cause: the exit code, or the signal's name and, for SIGKILL, whether
the kernel's OOM killer did it (the kernel log names the pid, else the cgroup's ``oom_kill``
counter moved). A worker that stopped beating has its stacks dumped by ``py-spy`` first.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def oom_kills() -> int | None:
    """The kernel's OOM-kill count for this process's cgroup (v2 ``memory.events``, else v1)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def oom_killed_by_kernel(pid: int) -> bool | None:
    """Whether the kernel log names ``pid`` as an OOM-killer victim (None: the log is unreadable)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    pat = re.compile(
        rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b|Memory cgroup out of memory: Kill.* {pid}\b)"
    )
    return any(pat.search(line) for line in out.splitlines()[-2000:])


def describe_exit(exitcode: int, pid: int, oom_before: int | None, oom_after: int | None) -> str:
    """``exit code N``, or ``killed by SIGNAME`` (for SIGKILL: whether it was an OOM kill, where known)."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL:
        oom = oom_killed_by_kernel(pid)
        if oom is None and oom_before is not None and oom_after is not None:
            oom = oom_after > oom_before
        if oom is not None:
            return f"killed by {name} ({'OOM-killed by the kernel' if oom else 'not an OOM kill'})"
    return f"killed by {name}"


def dump_stacks(pid: int, timeout_s: float = 3.0, *, native: bool = False) -> str | None:
    """Every thread's stack of a silent worker, by ``py-spy`` (where it is installed): the only way
    to see where a process that holds the GIL, or is stopped, is. Python frames and which thread
    holds the GIL; with ``native``, the C frames too (py-spy then reads every shared library's
    symbols: ~0.3 s with torch loaded, on the replacement's critical path). A stopped process
    cannot be suspended: its Python frames are read without."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(exe, os.X_OK):
        return None
    modes: tuple[tuple[str, ...], ...] = (
        (("--native",), (), ("--nonblocking",)) if native else ((), ("--nonblocking",))
    )
    if _stopped(pid):
        modes = (("--nonblocking",),)
    for mode in modes:
        try:
            out = subprocess.run(
                [exe, "dump", "--pid", str(pid), *mode], capture_output=True, text=True, timeout=timeout_s
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout[-16000:]
    return None


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP: state ``T`` in ``/proc/<pid>/stat``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()  # (the command name may hold spaces and parentheses)
    return bool(fields) and fields[0] in ("T", "t")
