"""``ResilientAgent``: torch.distributed.elastic's ``LocalElasticAgent`` plus heartbeats and verdicts.

The elastic agent already restarts a worker group whose process died, through its c10d
rendezvous. On top of it:

- **Heartbeats.** A worker that stopped beating (SIGSTOP, a hang holding the GIL) is as dead as one
  that exited: after ``heartbeat_timeout`` (``startup_timeout`` before its first beat) it is
  SIGKILLed (a stopped process never handles SIGTERM) and the group is restarted.
- **Causes.** Every death is reported with its cause: exit code, signal name, and for SIGKILL
  whether the kernel's OOM killer did it (the cgroup's ``oom_kill`` counter moved).
- **Verdicts from the runtime.** A worker exiting with ``FATAL`` (3: fault repeats, budget spent)
  or ``REQUEUE`` (76: preempted, final checkpoint written) must not be restarted: the agent stops
  and the launcher exits with that code. ``HARD_FAULT`` (75) and deaths are restarted, bounded by
  ``--max-restarts`` with exponential backoff.
- **Events** (``worker_died``, ``heartbeat_missed``, ``group_stopped``, ``relaunched``) go to the same
  JSONL as the runtime's, with ``rank: -1`` (the agent) and the local/global rank of the worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from loguru import logger
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from resilient.errors import ExitCode
from resilient.events import Event, EventLog
from resilient.launcher.heartbeat import beat_path, read_beat

_STOP_CODES = {int(ExitCode.FATAL): "fatal", int(ExitCode.REQUEUE): "requeue"}


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


ENV_ROUND = "RESILIENT_LAUNCH_ROUND"


def _rendezvous_round(worker_group: WorkerGroup) -> int | None:
    handler = worker_group.spec.rdzv_handler
    holder = getattr(handler, "_state_holder", None)  # DynamicRendezvousHandler (c10d, etcd-v2)
    state = getattr(holder, "state", None)
    round_no = getattr(state, "round", None)
    return int(round_no) if isinstance(round_no, int) else None


class ResilientAgent(LocalElasticAgent):
    def __init__(
        self,
        *args: Any,
        heartbeat_dir: Path,
        heartbeat_timeout: float,
        startup_timeout: float,
        events: EventLog | None,
        backoff_initial_s: float = 0.0,
        backoff_max_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.heartbeat_dir = heartbeat_dir
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.events = events
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.verdict: int | None = None  # an exit code the launcher must end with, not restart
        self.failures: list[dict[str, Any]] = []
        self._started = time.monotonic()
        self._oom = oom_kills()
        self._restarts = 0
        self.forward_signals: Any = None  # the launcher's handler for SIGUSR1/SIGTERM (preemption)

    def _emit(self, event: Event, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, generation=self._restarts, step=None, **fields)

    # ---- lifecycle hooks --------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        for w in worker_group.workers:
            beat_path(self.heartbeat_dir, w.local_rank).unlink(missing_ok=True)
        self._oom = oom_kills()
        # Every agent of a rendezvous round sees the same round number, unlike its restart count
        # (an agent restarted for a peer's failure does not count it): the workers' store keys and
        # checkpoint directories are named after it, so all ranks of a launch agree.
        round_no = _rendezvous_round(worker_group)
        if round_no is not None:
            os.environ[ENV_ROUND] = str(round_no)  # inherited by the workers started now
        pids = super()._start_workers(worker_group)
        self._started = time.monotonic()
        if self.forward_signals is not None:  # starting workers installed torch's own SIGTERM handler
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(sig, self.forward_signals)
        if self._restarts:
            self._emit(Event.RELAUNCHED, restart=self._restarts, pids=sorted(pids.values()))
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarts += 1
        delay = (
            0.0
            if self._restarts == 1
            else min(self.backoff_max_s, self.backoff_initial_s * 2 ** (self._restarts - 2))
        )
        if delay > 0:
            time.sleep(delay)  # exponential backoff between quick relaunches (bounded)
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._emit(Event.GROUP_STOPPED, restart=self._restarts)
        super()._stop_workers(worker_group)

    # ---- monitoring -------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            self._on_failed(worker_group, result)
            return result
        if result.state != WorkerState.HEALTHY:
            return result
        return self._check_heartbeats(worker_group) or result

    def _on_failed(self, worker_group: WorkerGroup, result: RunResult) -> None:
        oom = oom_kills()
        by_global = {w.global_rank: w for w in worker_group.workers}
        for global_rank, failure in result.failures.items():
            cause = describe_exit(failure.exitcode, failure.pid, self._oom, oom)
            w = by_global.get(global_rank)
            record = {"global_rank": global_rank, "local_rank": w.local_rank if w else None,
                      "pid": failure.pid, "exitcode": failure.exitcode, "cause": cause,
                      "ts": time.time()}  # fmt: skip
            self.failures.append(record)
            self._emit(Event.WORKER_DIED, **record)
            logger.error(f"worker rank {global_rank} (pid {failure.pid}) died: {cause}")
            if failure.exitcode in _STOP_CODES and self.verdict is None:
                self.verdict = failure.exitcode
        if self.verdict is not None:
            logger.info(f"a worker asked to stop ({_STOP_CODES[self.verdict]}): not restarting")
            self._remaining_restarts = 0

    def _check_heartbeats(self, worker_group: WorkerGroup) -> RunResult | None:
        now = time.monotonic()
        for w in worker_group.workers:
            beat = read_beat(beat_path(self.heartbeat_dir, w.local_rank))
            if beat is None:
                age, limit, step = now - self._started, self.startup_timeout, None
            else:
                (age, step), limit = beat, self.heartbeat_timeout
            if age <= limit:
                continue
            record = {"global_rank": w.global_rank, "local_rank": w.local_rank, "pid": w.id,
                      "silent_s": round(age, 3), "limit_s": limit, "last_step": step,
                      "ts": time.time()}  # fmt: skip
            self.failures.append({**record, "cause": f"no heartbeat for {age:.1f} s"})
            self._emit(Event.HEARTBEAT_MISSED, **record)
            logger.error(
                f"worker rank {w.global_rank} (pid {w.id}) silent for {age:.1f} s (limit {limit:g} s)"
            )
            if isinstance(w.id, int):
                # a stopped or GIL-bound process never handles SIGTERM: kill its session (its own) now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(w.id), signal.SIGKILL)
            failure = ProcessFailure(local_rank=w.local_rank, pid=w.id or -1, exitcode=-signal.SIGKILL,
                                     error_file="")  # fmt: skip
            return RunResult(state=WorkerState.FAILED, failures={w.global_rank: failure})
        return None
