"""Worker → agent heartbeats through a 24-byte shared-memory file per local rank.

The worker's step loop stores (CLOCK_MONOTONIC ns, step, generation) into a mapped page: no syscall, no lock,
nothing the training loop can block on. The agent maps the same files and reads them at every
monitor interval. CLOCK_MONOTONIC is system-wide on Linux, so the two processes' clocks agree. A
frozen worker (SIGSTOP, a hang holding the GIL) simply stops storing.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from resilient.launch_env import LaunchEnv

_FMT = struct.Struct("<qqq")  # monotonic ns of the last beat, step, in-process generation


class Beat(NamedTuple):
    age_s: float  # seconds since the last beat
    step: int  # the step it beat at (-1: before the first)
    generation: int  # the worker's in-process generation then (a replacement joins it)


def die_with_launcher(launcher: int | None) -> None:
    """Under ``resilient launch``: have the kernel SIGKILL this worker when the launcher dies.

    torch's agent starts workers in sessions of their own, so a launcher killed with SIGKILL (no
    chance to stop them) would leave them running, holding the node's GPUs and ports."""
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def beat_path(directory: Path, local_rank: int) -> Path:
    return directory / f"rank{local_rank:05d}.hb"


def unhealthy_path(directory: Path, local_rank: int) -> Path:
    """Where a worker whose health check failed says which (read by the agent, then removed)."""
    return directory / f"rank{local_rank:05d}.unhealthy"


class Heartbeat:
    """Worker side: ``beat(step)`` after every completed step (and once at start)."""

    def __init__(self, path: Path, interval: float = 1.0) -> None:
        self.interval = interval
        self.generation = 0  # set by the engine as it enters each generation
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _FMT.size)
            self._mm = mmap.mmap(fd, _FMT.size)
        finally:
            os.close(fd)

    @classmethod
    def for_worker(cls, launch: LaunchEnv) -> Heartbeat | None:
        """The heartbeat the launcher asked for (its directory, this local rank's file), if any."""
        if launch.heartbeat_dir is None:
            return None
        return cls(beat_path(launch.heartbeat_dir, launch.endpoint.local_rank), launch.heartbeat_interval)

    def beat(self, step: int) -> None:
        _FMT.pack_into(self._mm, 0, time.monotonic_ns(), step, self.generation)

    def start(self, step: Callable[[], int | None], interval: float | None = None) -> None:
        """Beat from a daemon thread every ``interval`` s. A thread, not the step loop: a Python-level
        hang in the main thread is the runtime's soft fault to recover in-process, and the beats must
        go on meanwhile; a process that is stopped or holds the GIL stops them, which is the point."""
        every = interval or self.interval
        self._halt = threading.Event()

        def run() -> None:
            while not self._halt.wait(every):
                s = step()
                self.beat(-1 if s is None else s)

        self.beat(-1)
        self._thread = threading.Thread(target=run, name="resilient-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        halt = getattr(self, "_halt", None)
        if halt is not None:
            halt.set()
            self._thread.join(timeout=5)
        self._mm.close()


def read_beats(directory: Path) -> dict[int, Beat]:
    """local rank -> last beat, of every worker that beat in ``directory`` (an unreadable file is
    left out: a worker being replaced, a directory being removed)."""
    out: dict[int, Beat] = {}
    for p in sorted(directory.glob("rank*.hb")):
        with contextlib.suppress(ValueError, OSError):
            b = read_beat(p)
            if b is not None:
                out[int(p.stem[4:])] = b
    return out


def read_beat(path: Path) -> Beat | None:
    """The last beat of a worker, or None if it never beat."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_FMT.size)
    except FileNotFoundError:
        return None
    if len(raw) < _FMT.size:
        return None
    ns, step, generation = _FMT.unpack(raw)
    if ns == 0:
        return None
    return Beat((time.monotonic_ns() - ns) / 1e9, step, generation)
