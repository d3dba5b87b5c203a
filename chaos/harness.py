"""Run a training command as N local ranks (env:// like torchrun) and collect what happened.

Each rank is started in its own session so that everything it spawns can be killed by process
group; a run that exceeds its timeout is killed, never left behind. An ``env`` with a chaos
variable (``CHAOS_PLAN``, ``CHAOS_FINAL_STATE``, …) gets the harness's step hook named in
``RESILIENT_HOOKS``. Used by the tests, the demo and the benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from chaos.hooks import enable
from resilient.events import read_events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str


@dataclass
class RunResult:
    ranks: list[RankResult]
    events: list[dict[str, Any]]
    wall_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def describe(self) -> str:
        parts = [f"timed_out={self.timed_out} wall={self.wall_s:.1f}s"]
        for r in self.ranks:
            parts.append(f"--- rank {r.rank} rc={r.returncode}\n{r.stderr[-3000:]}")
        return "\n".join(parts)


def _kill_group(p: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


def run_ranks(
    argv: Sequence[str],
    nproc: int,
    *,
    cwd: Path,
    run_id: str = "run",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    on_start: Callable[[list[subprocess.Popen[str]]], None] | None = None,
) -> RunResult:
    """Start ``python argv...`` as ``nproc`` ranks; wait, kill on timeout, collect output and events.

    ``on_start(procs)`` runs once every rank is started (e.g. to signal them when an event shows
    up); whatever it does, the ranks are killed by process group before this returns.
    """
    base = _environment(nproc, run_id, env)
    procs: list[subprocess.Popen[str]] = []
    outs: list[tuple[IO[str], IO[str]]] = []
    t0 = time.monotonic()
    timed_out = False
    try:
        for rank in range(nproc):
            log_out = open(cwd / f"rank{rank}.out", "w+")  # noqa: SIM115 - closed in _collect
            log_err = open(cwd / f"rank{rank}.err", "w+")  # noqa: SIM115
            outs.append((log_out, log_err))
            e = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc)}
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    cwd=cwd,
                    env=e,
                    stdout=log_out,
                    stderr=log_err,
                    text=True,
                    start_new_session=True,
                )
            )
        if on_start is not None:
            on_start(procs)
        timed_out = not _wait(procs, t0 + timeout)
    finally:
        for p in procs:
            _kill_group(p)  # also reaps anything a rank spawned
            p.wait()
    results = _collect(procs, outs, timed_out)
    ev_path = cwd / "resilient_runs" / run_id / "events.jsonl"
    events = read_events(ev_path) if ev_path.exists() else []
    return RunResult(results, events, time.monotonic() - t0, timed_out)


def _environment(nproc: int, run_id: str, env: dict[str, str] | None) -> dict[str, str]:
    """What every rank's environment shares: env:// on a free local port, the run id, ``env``."""
    port = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    base.update({"WORLD_SIZE": str(nproc), "RESILIENT_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"})
    base.update(env or {})
    enable(base)  # a run that asks for chaos (CHAOS_PLAN, CHAOS_FINAL_STATE, ...) loads its step hook
    return base


def _wait(procs: list[subprocess.Popen[str]], deadline: float) -> bool:
    """Wait for every rank until ``deadline`` (monotonic): whether all ended in time."""
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def _collect(
    procs: list[subprocess.Popen[str]], outs: list[tuple[IO[str], IO[str]]], timed_out: bool
) -> list[RankResult]:
    """Each rank's exit code (None: killed at the timeout) and output, its log files closed."""
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        out.seek(0)
        err.seek(0)
        code = None if timed_out and p.returncode < 0 else p.returncode
        results.append(RankResult(rank, code, out.read(), err.read()))
        out.close()
        err.close()
    return results
