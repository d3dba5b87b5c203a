"""The worker↔launcher contract beyond the environment (:mod:`resilient.launch_env` names the
variables): what a worker and its ``resilient launch`` agent read and write of each other's.

- **Heartbeats**: a 32-byte shared-memory record per local rank. The worker stores
  (CLOCK_MONOTONIC ns, step, generation, flags) into a mapped page: no syscall, no lock, nothing the
  training loop can block on. The agent (and the metrics) map the same files and read them.
  CLOCK_MONOTONIC is system-wide on Linux, so the two processes' clocks agree. A frozen worker
  (SIGSTOP, a hang holding the GIL) simply stops storing.
- **The unhealthy mark**: a worker whose health check failed says which, next to its heartbeat;
  the agent reads it (once) when it decides what the death means.
- **The replacement mark**: a rank to be replaced alone, named by its node's straggler judge
  (``straggler.action: replace``) or by itself (a replica found corrupt twice); the agent ends
  that worker and replaces it like a dead one, its survivors staying in their processes.
- **The stopping mark**: the agent is about to stop its workers (SIGTERM): a worker that gets a
  SIGTERM without it was sent one by someone else (Slurm signals every process of a job step at
  a requeue, a node failure or ``scancel``) and takes it as a preemption, a final checkpoint first.
- **The run's namespace** in the job's store: where the runtime's keys live, and where the agent
  posts a dead rank's fault so that its survivors' listeners wake.
- **A fault in the store**: a generation's keys, how a fault is posted there (the first is the
  generation's primary, the done barrier released with ``fault``) and the record the agent posts
  for a dead rank, which the runtime's ``FaultRecord`` reads as one of its own.
- **Where the heartbeats live**: one directory per launcher in ``/dev/shm``.
- **How a warm standby starts**: the command the agent runs and the runtime's standby serves.

The runtime, the launcher and the metrics import this module; none of them imports another's.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from resilient.launch_env import LaunchEnv

_FMT = struct.Struct("<qqqq")  # monotonic ns of the last beat, step, in-process generation, flags
_EXITING = 1  # flag: the worker left the runtime, this was its last beat
_SHM = Path("/dev/shm")


# ---- where things are --------------------------------------------------------------------------
def heartbeat_dir(run_id: str, launcher_pid: int) -> Path:
    """The directory one launcher keeps its workers' heartbeats (and standbys' ready marks) in."""
    return _SHM / f"resilient-hb-{run_id}-{launcher_pid}"


def heartbeat_dirs(run_id: str) -> list[Path]:
    """Every launcher's heartbeat directory of ``run_id`` on this node."""
    return sorted(_SHM.glob(f"resilient-hb-{run_id}-*"))


def run_namespace(run_id: str, attempt: str, engine: str = "") -> str:
    """The store prefix of one launch attempt's keys (``engine``: a prefix of an engine's own,
    ``nvrx/``); every rank of the attempt, and its agent, derive the same."""
    return f"resilient/{run_id}/{engine}a{attempt}"


# how the agent starts a standby (not ``-m``: ``resilient.wrap`` imports the runtime's standby module,
# which must be the one the standby runs in)
STANDBY_ENTRY = (sys.executable, "-u", "-c", "from resilient.runtime.standby import main; main()")


def beat_path(directory: Path, local_rank: int) -> Path:
    return directory / f"rank{local_rank:05d}.hb"


def unhealthy_path(directory: Path, local_rank: int) -> Path:
    """Where a worker whose health check failed says which (read by the agent, then removed)."""
    return directory / f"rank{local_rank:05d}.unhealthy"


# ---- the unhealthy mark -------------------------------------------------------------------------
def mark_unhealthy(directory: Path, local_rank: int, check: str, value: Any, detail: str) -> None:
    """The worker side: its health check ``check`` failed (best effort: a full disk is no reason
    to hide the failure itself, which the worker raises anyway)."""
    with contextlib.suppress(OSError):
        unhealthy_path(directory, local_rank).write_text(
            json.dumps({"check": check, "value": str(value), "detail": detail})
        )


def is_unhealthy(directory: Path, local_rank: int) -> bool:
    return unhealthy_path(directory, local_rank).exists()


def take_unhealthy(directory: Path, local_rank: int) -> dict[str, Any] | None:
    """The agent side: the mark of ``local_rank`` (``check``, ``value``, ``detail``), removed as it
    is read so that one failure counts once; None without a readable mark."""
    return _take(unhealthy_path(directory, local_rank))


def _take(path: Path) -> dict[str, Any] | None:
    """A mark's record, removed as it is read (one mark counts once); None without a readable one."""
    try:
        mark = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return mark if isinstance(mark, dict) else None


def replace_path(directory: Path, local_rank: int) -> Path:
    """Where a rank to be replaced alone is named (see the module docstring)."""
    return directory / f"rank{local_rank:05d}.replace"


def mark_replace(directory: Path, local_rank: int, detail: dict[str, Any]) -> bool:
    """The worker side: ``local_rank`` of this node should be replaced by its agent; ``detail``'s
    ``cause`` says why (a straggler's judge: its ``slowdown``)."""
    try:
        replace_path(directory, local_rank).write_text(json.dumps(detail))
    except OSError:
        return False
    return True


def take_replace(directory: Path, local_rank: int) -> dict[str, Any] | None:
    """The agent side: the replacement mark of ``local_rank``, removed as it is read."""
    return _take(replace_path(directory, local_rank))


def stopping_path(directory: Path) -> Path:
    """Where the agent says it is stopping its workers (see the module docstring)."""
    return directory / "agent.stopping"


def mark_stopping(directory: Path, stopping: bool) -> None:
    """The agent side: set (before it stops its workers) or clear (once new ones started)."""
    with contextlib.suppress(OSError):
        if stopping:
            stopping_path(directory).touch()
        else:
            stopping_path(directory).unlink(missing_ok=True)


def agent_stopping(directory: Path | None) -> bool:
    """The worker side: the SIGTERM just received is its agent's (stop now), not a scheduler's."""
    return directory is not None and stopping_path(directory).exists()


def clear_worker(directory: Path, local_rank: int) -> None:
    """A new process takes ``local_rank``: its predecessor's beat and marks are not its own."""
    beat_path(directory, local_rank).unlink(missing_ok=True)
    unhealthy_path(directory, local_rank).unlink(missing_ok=True)
    replace_path(directory, local_rank).unlink(missing_ok=True)


# ---- heartbeats -----------------------------------------------------------------------------------
class Beat(NamedTuple):
    age_s: float  # seconds since the last beat
    step: int  # the step it beat at (-1: before the first)
    generation: int  # the worker's in-process generation then (a replacement joins it)
    # the worker left the runtime and beats no more: its silence is not a hang (its exit is what
    # the agent waits for, within its start-up limit)
    exiting: bool = False


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


def wait_exited(pid: int, timeout_s: float) -> bool:
    """Wait until process ``pid`` has exited (a zombie counts: its memory is freed), at most
    ``timeout_s``; whether it did. A replacement that needs what its predecessor held (a GPU's
    memory) waits so for the dead worker its agent only just SIGKILLed."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (OSError, AttributeError):  # (no pidfd: a kernel before 5.3) the kernel is asked in turn
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            time.sleep(0.005)
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1e3))
    finally:
        os.close(fd)


class Heartbeat:
    """Worker side: a daemon thread beats every ``interval`` s with the step in progress."""

    def __init__(self, path: Path, interval: float = 1.0) -> None:
        self.interval = interval
        self.generation = 0  # set by the engine as it enters each generation
        self._step = -1  # the last step beaten
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
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
        self._step = step
        _FMT.pack_into(self._mm, 0, time.monotonic_ns(), step, self.generation, 0)

    def start(self, step: Callable[[], int | None], interval: float | None = None) -> None:
        """Beat from a daemon thread every ``interval`` s. A thread, not the step loop: a Python-level
        hang in the main thread is the runtime's soft fault to recover in-process, and the beats must
        go on meanwhile; a process that is stopped or holds the GIL stops them, which is the point."""
        every = interval or self.interval

        def run() -> None:
            while not self._halt.wait(every):
                s = step()
                self.beat(-1 if s is None else s)

        self.beat(-1)
        self._thread = threading.Thread(target=run, name="resilient-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop beating, the last beat saying so: what the process does after the runtime (the
        script's own end, the interpreter's teardown) may take longer than a heartbeat timeout."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        _FMT.pack_into(self._mm, 0, time.monotonic_ns(), self._step, self.generation, _EXITING)
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
    ns, step, generation, flags = _FMT.unpack(raw)
    if ns == 0:
        return None
    return Beat((time.monotonic_ns() - ns) / 1e9, step, generation, bool(flags & _EXITING))


# ---- a fault in the run's store -------------------------------------------------------------------
DIED = "died"  # a record's kind: a rank's process died (posted by its agent, which replaces it)
SOFT = "soft"  # a record's severity: the survivors recover in their own processes
FAULTED = "fault"  # a done barrier's release once a fault was posted: the ranks that returned recover
_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\[[0-9a-fA-F:.]+\]:\d+|\d+(\.\d+)?")


class KeyStore(Protocol):
    """What posting a fault needs of a store (torch's ``Store``)."""

    def set(self, key: str, value: str, /) -> None: ...

    def compare_set(self, key: str, expected: str, desired: str, /) -> bytes: ...


def generation_key(namespace: str, generation: int, *parts: object) -> str:
    """A key of generation ``generation`` in the run's namespace (:func:`run_namespace`)."""
    return "/".join([namespace, f"g{generation}", *map(str, parts)])


def publish_fault(store: KeyStore, namespace: str, generation: int, rank: int, raw: str) -> bytes:
    """Post ``raw`` (a fault record's JSON) as rank ``rank``'s observation of ``generation``'s
    fault; the first posted is the generation's primary, which every rank's listener waits for
    (returned: maybe this one). Ranks that returned already and wait in the done barrier wake."""
    store.set(generation_key(namespace, generation, "fault", rank), raw)
    primary = store.compare_set(generation_key(namespace, generation, "fault"), "", raw)
    store.compare_set(generation_key(namespace, generation, "done", "release"), "", FAULTED)
    return primary


def stable_line(text: str) -> str:
    """The first line of ``text`` with its volatile parts (numbers, addresses, ports) as ``N``:
    what a fault's signature compares, so the same bug at the same step signs the same twice."""
    first = (text.strip().splitlines() or [""])[0]
    return _VOLATILE.sub("N", first)[:160]


def death_record(rank: int, generation: int, step: int, cause: str) -> str:
    """The fault record (JSON, as the runtime's ``FaultRecord`` writes one) of rank ``rank``'s
    process, dead of ``cause`` at ``step`` of ``generation``, which its agent posts."""
    record = {
        "rank": rank,
        "generation": generation,
        "step": step,
        "kind": DIED,
        "severity": SOFT,
        "signature": f"{DIED}: {stable_line(cause)}",
        "message": f"worker process of rank {rank} {cause}",
        "ts": time.time(),
        "latency_s": 0.0,
        "since": None,
    }
    return json.dumps(record)
