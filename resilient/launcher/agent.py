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
  ``--max-restarts`` (within ``--restart-window`` seconds, if given) with exponential backoff.
- **Lost nodes.** A member of the running round whose rendezvous keep-alive expired (its agent
  is gone with its node) restarts the group at once, instead of when the survivors' collectives
  time out.
- **Replacement** (``replace="rank"``, the default). A worker that dies while training (exit,
  signal, kernel OOM-kill, or killed after a missed heartbeat) is replaced alone: the agent posts
  the death to the job's store as the fault of the generation the worker was in (its heartbeat
  says which), so the surviving ranks leave their step at once and recover in their own processes;
  then it starts one process with the dead rank's identity (a warm standby if one waits, see
  :mod:`resilient.launcher.standby`), which restores that rank's snapshot from this node's shared
  memory and joins the survivors' recovery. Whole-group restart remains the fallback: a worker
  that dies before its first step or asks for it (exit 75), a failed health check, a fault that
  repeats, an exhausted budget, a replacement that dies before its first step; and survivors that
  cannot recover exit 75, which restarts the group.
- **Spares.** A node that joins a running job waits (torchrun instead restarts the healthy group
  at once to admit it). It joins at the next restart: in place of a lost node, or growing the
  world up to ``--nnodes``' maximum. A *member* of the running round that re-joins (its worker
  died) still restarts everyone, as in torchrun. ``--admit-waiting`` restores torchrun's behaviour.
- **Exclusion.** A worker whose health check failed says so in a file next to its heartbeat; after
  ``--max-health-failures`` such restarts the agent stops its workers, leaves the rendezvous
  without closing it (the other nodes go on, with a spare or fewer nodes) and exits with 75.
- **Events** (``worker_died``, ``heartbeat_missed``, ``group_stopped``, ``relaunched``,
  ``node_lost``, ``node_excluded``) go to the same JSONL as the runtime's, with ``rank: -1`` (the
  agent) and the local/global rank of the worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from resilient.backoff import Backoff
from resilient.contract import (
    Beat,
    beat_path,
    clear_worker,
    is_unhealthy,
    read_beat,
    run_namespace,
    take_unhealthy,
)
from resilient.errors import ExitCode
from resilient.events import Event, EventLog
from resilient.launch_env import Var
from resilient.launcher.standby import Standby, target

_STOP_CODES = {int(ExitCode.FATAL): "fatal", int(ExitCode.REQUEUE): "requeue"}
STANDBY_DELAY_S = 2.0


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


def _rdzv_state(handler: Any) -> Any:
    holder = getattr(handler, "_state_holder", None)  # DynamicRendezvousHandler (c10d, etcd-v2)
    return getattr(holder, "state", None)


def _rendezvous_round(worker_group: WorkerGroup) -> int | None:
    round_no = getattr(_rdzv_state(worker_group.spec.rdzv_handler), "round", None)
    return int(round_no) if isinstance(round_no, int) else None


def dump_stacks(pid: int, timeout_s: float = 3.0) -> str | None:
    """Every thread's stack of a silent worker, Python and native frames, by ``py-spy`` (where it
    is installed): the only way to see where a process that holds the GIL, or is stopped, is.
    A stopped process cannot be suspended for native frames: its Python frames are read instead."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(exe, os.X_OK):
        return None
    for mode in ("--native", "--nonblocking"):
        try:
            out = subprocess.run([exe, "dump", "--pid", str(pid), mode], capture_output=True, text=True,
                                 timeout=timeout_s)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout[-16000:]
    return None


def leave_rendezvous(handler: Any) -> None:
    """Leave the rendezvous without closing it (``shutdown()`` would end it for every node)."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 30)
    except Exception as e:  # private API: the keep-alive expiry removes this node anyway
        logger.warning(f"could not leave the rendezvous at once ({e}); peers drop it at keep-alive expiry")


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
        admit_waiting: bool = False,
        max_health_failures: int = 2,
        restart_window_s: float | None = None,
        max_repeats: int = 3,
        replace: str = "rank",
        standby: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_repeats = max_repeats
        self.replace = replace
        self.standby_count = standby
        self._standbys: list[Standby] = []
        self._worker_started: dict[int, float] = {}  # local rank -> when its current process started
        self._store_client: Any = None  # the workers' store, where a death is posted as a fault
        self._group_reason: str | None = None  # why the last death restarts the group, not one rank
        self._deaths: list[tuple[int, str]] = []  # (global rank, where: "step N" or "start-up ...")
        self.restart_window_s = restart_window_s
        self.window_max_restarts = self._worker_group.spec.max_restarts
        if restart_window_s is not None:
            self._worker_group.spec.max_restarts = self._remaining_restarts = 1 << 30
        self._failure_times: list[float] = []
        self.max_health_failures = max_health_failures
        self.health_failures: list[dict[str, Any]] = []
        self.excluded = False
        self._members: set[Any] | None = None  # the nodes of the running round
        self._lost_reported = False
        self._watch_membership(admit_waiting)
        self._publish_store_address()
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
        self.fault_stacks = True  # py-spy dumps a silent worker's stacks before it is killed
        self.forward_signals: Any = None  # the launcher's handler for SIGUSR1/SIGTERM (preemption)

    def _emit(self, event: Event, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, generation=self._restarts, step=None, **fields)

    def _watch_membership(self, admit_waiting: bool) -> None:
        """torch's agent restarts a healthy group when ``num_nodes_waiting() > 0``. Here that count
        is (a) the *members* of the running round that wait to re-join (a peer whose worker died),
        or every waiting node with ``admit_waiting`` (torchrun); a new node otherwise waits as a
        spare; plus (b) one if a member vanished from the rendezvous: its keep-alive expired (a
        lost node), which torch's agent would notice only when its own workers fail."""
        handler = self._worker_group.spec.rdzv_handler
        waiting = handler.num_nodes_waiting

        def members_waiting() -> int:
            n = int(waiting())  # syncs the rendezvous state, dropping nodes whose keep-alive expired
            state = _rdzv_state(handler)
            if state is None or self._members is None:
                return n
            queued = set(state.wait_list)
            count = len(queued) if admit_waiting else len(queued & self._members)
            lost = self._members - set(state.participants) - queued
            if lost and not state.closed and not self._lost_reported:
                self._lost_reported = True
                self._emit(Event.NODE_LOST, nodes=sorted(str(x) for x in lost))
                logger.error(f"node(s) {sorted(str(x) for x in lost)} left the rendezvous: restarting")
            return count + (1 if lost and not state.closed else 0)

        handler.num_nodes_waiting = members_waiting  # type: ignore[method-assign]

    def _publish_store_address(self) -> None:
        """torch (2.13) re-uses node 0's cached store address in later rounds without writing it to
        the new round's keys, so a node joining in a later round (a spare, a replacement) waits
        for ``MASTER_ADDR`` until it times out. Group rank 0 writes it for every round."""
        handler = self._worker_group.spec.rdzv_handler
        nxt = handler.next_rendezvous

        def next_rendezvous() -> Any:
            info = nxt()
            boot = getattr(info, "bootstrap_store_info", None)
            if info.rank == 0 and boot is not None:
                from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo as Info

                info.store.set(Info.MASTER_ADDR_KEY, boot.master_addr)
                info.store.set(Info.MASTER_PORT_KEY, str(boot.master_port))
            return info

        handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]

    # ---- lifecycle hooks --------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        state = _rdzv_state(worker_group.spec.rdzv_handler)
        if state is not None:
            self._members = set(state.participants)
            self._lost_reported = False
        for w in worker_group.workers:
            clear_worker(self.heartbeat_dir, w.local_rank)
        self._oom = oom_kills()
        # Every agent of a rendezvous round sees the same round number, unlike its restart count
        # (an agent restarted for a peer's failure does not count it): the workers' store keys and
        # checkpoint directories are named after it, so all ranks of a launch agree.
        round_no = _rendezvous_round(worker_group)
        if round_no is not None:
            os.environ[Var.LAUNCH_ROUND] = str(round_no)  # inherited by the workers started now
        pids = super()._start_workers(worker_group)
        self._started = time.monotonic()
        self._worker_started = {w.local_rank: self._started for w in worker_group.workers}
        if self.forward_signals is not None:  # starting workers installed torch's own SIGTERM handler
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(sig, self.forward_signals)
        if self._restarts:
            self._emit(Event.RELAUNCHED, restart=self._restarts, pids=sorted(pids.values()))
        self._emit(Event.WORKERS_STARTED, restart=self._restarts, round=round_no,
                   ranks={str(w.global_rank): pids.get(w.local_rank) for w in worker_group.workers},
                   max_restarts=self.window_max_restarts, restart_window_s=self.restart_window_s,
                   restarts_left=self._remaining_restarts)  # fmt: skip
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarts += 1
        delay = Backoff(self.backoff_initial_s, self.backoff_max_s).delay(self._restarts)
        if delay > 0:
            time.sleep(delay)  # exponential backoff between quick relaunches (bounded)
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        reason, self._group_reason = self._group_reason, None
        self._emit(Event.GROUP_STOPPED, restart=self._restarts, **({"reason": reason} if reason else {}))
        super()._stop_workers(worker_group)

    # ---- monitoring -------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # (workers started as binaries, which `resilient launch` always does: torch's
        # SubprocessContext, whose handlers a replacement takes the place of)
        replaceable = hasattr(self._pcontext, "subprocess_handlers")
        if self.replace == "rank" and replaceable and self.verdict is None:
            silent = self._check_heartbeats(worker_group)
            if silent is not None:
                ((global_rank, failure),) = silent.failures.items()
                w = next(w for w in worker_group.workers if w.global_rank == global_rank)
                pc: Any = self._pcontext
                handler = pc.subprocess_handlers.get(w.local_rank)
                if handler is not None:
                    with contextlib.suppress(Exception):
                        handler.proc.wait(timeout=10)  # SIGKILLed just now
                cause = self.failures[-1]["cause"]
                if not self._replace(worker_group, w.local_rank, failure.exitcode, cause, reported=True):
                    self._check_repeats(worker_group, silent)
                    if self.verdict is not None:
                        self._remaining_restarts = 0
                    return silent
            for local_rank, code in self._exited(worker_group):
                if not self._replace(worker_group, local_rank, code, None, reported=False):
                    break  # torch's monitor sees the death: the whole group restarts
            self._keep_standbys(worker_group)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            self._on_failed(worker_group, result)
            return result
        if result.state != WorkerState.HEALTHY:
            return result
        silent = self._check_heartbeats(worker_group)
        if silent is None:
            return result
        self._check_repeats(worker_group, silent)
        if self.verdict is not None:
            self._remaining_restarts = 0
        return silent

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
        self._count_health_failures(worker_group)
        self._check_repeats(worker_group, result)
        now = time.monotonic()
        self._failure_times.append(now)
        if self.restart_window_s is not None and not self.excluded:
            # --max-restarts counts the failures of the last --restart-window seconds only: a job
            # that fails once a day for a month is not a job that fails in a loop. (torch's own
            # budget is unbounded then, so that TORCHELASTIC_RESTART_COUNT still counts up.)
            recent = [t for t in self._failure_times if now - t <= self.restart_window_s]
            self._failure_times = recent
            if len(recent) > self.window_max_restarts:
                self._remaining_restarts = 0
        if self.verdict is not None:
            logger.info(f"stopping ({_STOP_CODES[self.verdict]}): not restarting")
            self._remaining_restarts = 0

    def _check_repeats(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """A hard fault that kills a rank at the same step launch after launch (the runtime's own
        repeat guard dies with the process) is diagnosed and stops the job: FATAL, not a loop."""
        by_global = {w.global_rank: w for w in worker_group.workers}
        for global_rank in sorted(result.failures):
            w = by_global.get(global_rank)
            beat = read_beat(beat_path(self.heartbeat_dir, w.local_rank)) if w is not None else None
            if beat is not None and beat.step >= 0:
                self._deaths.append((global_rank, f"step {beat.step}"))
            else:  # before its first step: the same exit code each time is the same failure (an
                # import error, a bad argument); 75 (a peer or the store unreachable) and signals
                # come from outside and may pass
                code = result.failures[global_rank].exitcode
                if code > 0 and code != int(ExitCode.HARD_FAULT):
                    self._deaths.append((global_rank, f"start-up (exit code {code})"))
        last = self._deaths[-self.max_repeats :]
        if self.verdict is None and len(last) == self.max_repeats and len(set(last)) == 1:
            rank, where = last[0]
            cause = f"rank {rank} died at {where} {self.max_repeats} times in a row: the fault repeats"
            self.failures.append({"global_rank": rank, "cause": cause, "ts": time.time()})
            logger.error(f"{cause}; not restarting")
            self.verdict = int(ExitCode.FATAL)

    def _count_health_failures(self, worker_group: WorkerGroup) -> None:
        checks = []
        for w in worker_group.workers:
            mark = take_unhealthy(self.heartbeat_dir, w.local_rank)
            if mark is not None:
                checks.append({"local_rank": w.local_rank, **mark})
        if not checks:
            return
        self.health_failures.append({"ts": time.time(), "checks": checks})
        if len(self.health_failures) < self.max_health_failures or self.verdict is not None:
            return
        self.excluded = True
        self._remaining_restarts = 0
        self._emit(Event.NODE_EXCLUDED, health_failures=len(self.health_failures), checks=checks)
        logger.error(
            f"this node failed health checks {len(self.health_failures)} times "
            f"(last: {checks[0].get('check')}): excluding it from the job"
        )

    def _check_heartbeats(self, worker_group: WorkerGroup) -> RunResult | None:
        now = time.monotonic()
        for w in worker_group.workers:
            beat = read_beat(beat_path(self.heartbeat_dir, w.local_rank))
            if beat is None:
                started = self._worker_started.get(w.local_rank, self._started)
                age, limit, step = now - started, self.startup_timeout, None
            else:
                age, step, limit = beat.age_s, beat.step, self.heartbeat_timeout
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
            if isinstance(w.id, int) and self.fault_stacks:
                stacks = dump_stacks(w.id)
                if stacks is not None:
                    self._emit(Event.FAULT_REPORT, global_rank=w.global_rank, pid=w.id, kind="no_heartbeat",
                               last_step=step, stacks=stacks, source="py-spy")  # fmt: skip
            if isinstance(w.id, int):
                # a stopped or GIL-bound process never handles SIGTERM: kill its session (its own) now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(w.id), signal.SIGKILL)
            failure = ProcessFailure(local_rank=w.local_rank, pid=w.id or -1, exitcode=-signal.SIGKILL,
                                     error_file="")  # fmt: skip
            return RunResult(state=WorkerState.FAILED, failures={w.global_rank: failure})
        return None

    # ---- replacing one rank -----------------------------------------------------------------------
    def _exited(self, worker_group: WorkerGroup) -> list[tuple[int, int]]:
        """(local rank, exit code) of the workers that ended with an error since the last look."""
        pc: Any = self._pcontext
        out = []
        for local_rank in sorted(pc._running_local_ranks):
            code = pc.subprocess_handlers[local_rank].proc.poll()
            if code is not None and code != 0:
                out.append((local_rank, code))
        return out

    def _replaceable(self, worker_group: WorkerGroup, local_rank: int, code: int) -> tuple[Beat | None, str]:
        """The dead worker's last beat, and why it cannot be replaced alone ('' if it can)."""
        beat = read_beat(beat_path(self.heartbeat_dir, local_rank))
        w = worker_group.workers[local_rank]
        if code in _STOP_CODES:
            return beat, f"its exit code {code} is a verdict"
        if code == int(ExitCode.HARD_FAULT):
            return beat, "it asked for a restart of the group (exit code 75)"
        if is_unhealthy(self.heartbeat_dir, local_rank):
            return beat, "it failed a health check"
        if beat is None or beat.step < 0:
            return beat, "it died before its first step"
        if self._remaining_restarts <= 0:
            return beat, "the restart budget is spent"
        if self.restart_window_s is not None:
            now = time.monotonic()
            if (
                len([t for t in self._failure_times if now - t <= self.restart_window_s])
                >= self.window_max_restarts
            ):
                return beat, "the restart budget of the window is spent"
        last = [*self._deaths[-(self.max_repeats - 1) :], (w.global_rank, f"step {beat.step}")]
        if self.max_repeats > 1 and len(last) == self.max_repeats and len(set(last)) == 1:
            return beat, "the fault repeats"
        return beat, ""

    def _replace(
        self, worker_group: WorkerGroup, local_rank: int, code: int, cause: str | None, *, reported: bool
    ) -> bool:
        """Replace the dead worker of ``local_rank`` alone; False: the whole group must restart."""
        pc: Any = self._pcontext
        w = worker_group.workers[local_rank]
        old = pc.subprocess_handlers[local_rank]
        beat, why_not = self._replaceable(worker_group, local_rank, code)
        if cause is None:
            cause = describe_exit(code, old.proc.pid, self._oom, oom_kills())
        if why_not:
            self._group_reason = f"rank {w.global_rank} not replaced alone: {why_not}"
            logger.info(f"rank {w.global_rank} is not replaced alone ({why_not}): restarting the group")
            return False
        assert beat is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(old.proc.pid, signal.SIGKILL)  # what it left in its session (loader workers)
        self._oom = oom_kills()
        record = {"global_rank": w.global_rank, "local_rank": local_rank, "pid": old.proc.pid,
                  "exitcode": code, "cause": cause, "ts": time.time()}  # fmt: skip
        if not reported:
            self.failures.append(record)
            self._emit(Event.WORKER_DIED, **record)
            logger.error(f"worker rank {w.global_rank} (pid {old.proc.pid}) died: {cause}")
        self._deaths.append((w.global_rank, f"step {beat.step}"))
        self._failure_times.append(time.monotonic())
        self._remaining_restarts -= 1
        t0 = time.time()
        env = {**pc.envs[local_rank], Var.JOIN_GENERATION.value: str(beat.generation)}
        posted = self._post_death(env, w.global_rank, beat, f"rank {w.global_rank} {cause}")
        beat_path(self.heartbeat_dir, local_rank).unlink(missing_ok=True)
        new, warm = self._spawn(local_rank, env)
        old_pid = old.proc.pid
        with contextlib.suppress(Exception):
            for f in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
                if f is not None:
                    f.close()
        pc.subprocess_handlers[local_rank] = new
        w.id = new.proc.pid
        self._worker_started[local_rank] = time.monotonic()
        self._emit(Event.RANK_REPLACED, global_rank=w.global_rank, local_rank=local_rank, old_pid=old_pid,
                   new_pid=new.proc.pid, standby=warm, join_generation=beat.generation, last_step=beat.step,
                   fault_posted=posted, duration_s=time.time() - t0, cause=cause,
                   restarts_left=self._remaining_restarts)  # fmt: skip
        logger.info(
            f"rank {w.global_rank} replaced by pid {new.proc.pid} "
            f"({'warm standby' if warm else 'new process'}); "
            f"survivors stay in generation {beat.generation}"
        )
        return True

    def _post_death(self, env: dict[str, str], global_rank: int, beat: Beat, message: str) -> bool:
        """The dead rank's fault in the workers' store: its survivors' listeners wake at once."""
        from resilient.runtime.coordinator import Coordinator, client
        from resilient.runtime.faults import FaultKind, FaultRecord, Severity, signature

        try:
            if self._store_client is None:
                self._store_client = client(env["MASTER_ADDR"], int(env["MASTER_PORT"]), 10.0)
            run_id = os.environ.get(Var.RUN_ID.value) or env.get(Var.ELASTIC_RUN_ID.value, "")
            attempt = os.environ.get(Var.LAUNCH_ROUND.value) or env.get(Var.RESTART_COUNT.value, "0")
            coord = Coordinator(self._store_client, run_namespace(run_id, attempt), -1, 0, 10.0)
            rec = FaultRecord(
                rank=global_rank,
                generation=beat.generation,
                step=beat.step,
                kind=FaultKind.DIED.value,
                severity=Severity.SOFT.value,
                signature=signature(FaultKind.DIED, RuntimeError(message.split(" ", 2)[-1])),
                message=f"worker process of {message}",
            )
            coord.post_fault(rec)
            return True
        except Exception as e:  # the survivors still notice: their collectives with it fail
            logger.warning(f"could not post rank {global_rank}'s death to the store: {e}")
            self._store_client = None
            return False

    def _spawn(self, local_rank: int, env: dict[str, str]) -> tuple[Any, bool]:
        """A process for ``local_rank`` with ``env``: a promoted standby if one waits, else a new one."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

        pc: Any = self._pcontext
        spec = self._worker_group.spec
        tgt = target(spec.entrypoint, pc.args[local_rank]) if isinstance(spec.entrypoint, str) else None
        stdout, stderr = pc.stdouts.get(local_rank) or None, pc.stderrs.get(local_rank) or None
        while self._standbys and tgt is not None:
            sb = self._standbys.pop(0)
            if sb.alive():
                sb.promote(local_rank, {**os.environ, **env}, tgt, stdout, stderr)
                return sb, True
        handler = SubprocessHandler(
            entrypoint=str(spec.entrypoint), args=pc.args[local_rank], env=env, stdout=stdout, stderr=stderr,
            local_rank_id=local_rank, numa_options=None,
        )  # fmt: skip
        return handler, False

    def _keep_standbys(self, worker_group: WorkerGroup) -> None:
        """Start a standby when fewer than asked wait, once every worker is stepping and the
        newest has been for ``STANDBY_DELAY_S`` (a standby's imports would compete with a starting
        worker's, or slow a replacement's first steps on a node with few cores)."""
        self._standbys = [s for s in self._standbys if s.alive()]
        for sb in self._standbys:
            if not sb.announced and sb.ready():
                sb.announced = True
                self._emit(Event.STANDBY_READY, standby_pid=sb.proc.pid, standbys=len(self._standbys))
        if len(self._standbys) >= self.standby_count:
            return
        if time.monotonic() - max(self._worker_started.values(), default=0.0) < STANDBY_DELAY_S:
            return
        for w in worker_group.workers:
            beat = read_beat(beat_path(self.heartbeat_dir, w.local_rank))
            if beat is None or beat.step < 0:
                return
        pc: Any = self._pcontext
        self._standbys.append(Standby({**os.environ, **pc.envs[0]}, self.heartbeat_dir))

    def close_standbys(self) -> None:
        for s in self._standbys:
            s.close()
        for s in self._standbys:
            with contextlib.suppress(Exception):
                s.proc.wait(timeout=10)
        self._standbys = []
