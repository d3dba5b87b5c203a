"""``ResilientAgent``: torch.distributed.elastic's ``LocalElasticAgent`` plus heartbeats and verdicts.

The elastic agent already restarts a worker group whose process died, through its c10d
rendezvous. On top of it:

- **Heartbeats.** A worker that stopped beating (SIGSTOP, a hang holding the GIL) is as dead as one
  that exited: after ``heartbeat_timeout`` (``startup_timeout`` before its first beat and once its
  last beat says it is exiting) it is
  SIGKILLed (a stopped process never handles SIGTERM).
- **Causes.** Every death is reported with its cause (:mod:`resilient.launcher.causes`): exit code,
  signal name, and for SIGKILL whether the kernel's OOM killer did it.
- **Decisions.** What a round's deaths cost is :class:`resilient.launcher.policy.LaunchPolicy`'s to
  say, and only this agent acts on it: replace a dead rank alone (bounded by
  ``--max-replacements`` within ``--replacement-window``), restart the group (bounded by
  ``--max-restarts``, within ``--restart-window`` if given, with exponential backoff), or stop:
  ``FATAL`` (3: a worker gave up, the fault repeats, restarts exhausted), ``REQUEUE`` (76:
  preempted, final checkpoint written), or exclusion of this node (75).
- **Replacement** (``replace="rank"``, the default; :mod:`resilient.launcher.replace`). A worker
  that dies while training is replaced alone: its death is posted to the job's store, so the
  surviving ranks recover in their own processes, and one process (a warm standby if one waits)
  takes its identity and joins them. Whole-group restart remains the fallback, with its reason in
  the ``group_stopped`` event.
- **Lost nodes.** A member of the running round whose rendezvous keep-alive expired (its agent
  is gone with its node) restarts the group at once, instead of when the survivors' collectives
  time out.
- **Spares.** A node that joins a running job waits (torchrun instead restarts the healthy group
  at once to admit it). It joins at the next restart: in place of a lost node, or growing the
  world up to ``--nnodes``' maximum. A *member* of the running round that re-joins (its worker
  died) still restarts everyone, as in torchrun. ``--admit-waiting`` restores torchrun's behaviour.
- **Exclusion.** A worker whose health check failed says so next to its heartbeat; after
  ``--max-health-failures`` such restarts the agent stops its workers, leaves the rendezvous
  without closing it (the other nodes go on, with a spare or fewer nodes) and exits with 75.
- **Events** (``worker_died``, ``heartbeat_missed``, ``group_stopped``, ``relaunched``,
  ``rank_replaced``, ``node_lost``, ``node_excluded``) go to the same JSONL as the runtime's, with
  ``rank: -1`` (the agent) and the local/global rank of the worker.

torch elastic's private state is reached through :class:`resilient.launcher.elastic.Elastic` only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

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
    mark_stopping,
    read_beat,
    take_replace,
    take_unhealthy,
)
from resilient.errors import ExitCode
from resilient.events import Event, EventLog
from resilient.launch_env import Var
from resilient.launcher.causes import describe_exit, dump_stacks, oom_kills
from resilient.launcher.deaths import DeathWatch, WakeableTime
from resilient.launcher.elastic import Elastic
from resilient.launcher.flush import Flusher
from resilient.launcher.policy import Action, Death, Decision, GiveUp, LaunchPolicy, Replace
from resilient.launcher.replace import Replacer
from resilient.launcher.waiting import Membership

_STOP_WORDS = {int(ExitCode.FATAL): "fatal", int(ExitCode.REQUEUE): "requeue"}


class _Seen(NamedTuple):
    """A dead worker as the agent found it: the policy's view of it, and what the events name."""

    death: Death
    local_rank: int | None
    pid: int
    cause: str
    reported: bool  # announced already (``heartbeat_missed``), not as ``worker_died``


class ResilientAgent(LocalElasticAgent):
    def __init__(
        self,
        *args: Any,
        policy: LaunchPolicy,
        heartbeat_dir: Path,
        heartbeat_timeout: float,
        startup_timeout: float,
        events: EventLog | None,
        backoff_initial_s: float = 0.0,
        backoff_max_s: float = 10.0,
        admit_waiting: bool = False,
        standby: int = 0,
        standby_mode: str = "park",
        shm_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        self.elastic = Elastic(self)
        self.elastic.unbound_restarts()  # the policy counts restarts and replacements, each its own
        self.heartbeat_dir = heartbeat_dir
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.events = events
        self.backoff = Backoff(backoff_initial_s, backoff_max_s)
        park = standby_mode == "park"
        self.replacer = Replacer(
            self.elastic, heartbeat_dir, self._emit, standby, park=park, budgets=self.budgets
        )
        # torch's loop sleeps its monitor interval between looks at the workers: a death wakes it
        self._clock = WakeableTime()
        self._clock.deadline = self._silence_deadline
        self.deaths = DeathWatch(self.elastic.pids, self._clock.wake)
        self.flusher = Flusher(shm_name, self._emit)  # (checkpoint.flush_on_death: a dead rank's snapshots)
        self.verdict: int | None = None  # an exit code the launcher must end with, not restart
        self.excluded = False
        self.failures: list[dict[str, Any]] = []
        self.health_failures: list[dict[str, Any]] = []
        self.fault_stacks = True  # py-spy dumps a silent worker's stacks before it is killed
        self.native_stacks = False  # ... with its C frames (--native-stacks: ~0.3 s more before the kill)
        self.forward_signals: Any = None  # the launcher's handler for SIGUSR1/SIGTERM (preemption)
        self._group_reason: str | None = None  # why the group restarts, not one rank (group_stopped)
        self._started = time.monotonic()
        self._worker_started: dict[int, float] = {}  # local rank -> when its current process started
        self._oom = oom_kills()
        self._restarts = 0
        self.membership = Membership(self._emit, admit_waiting)  # (which waiting nodes restart the group)
        self.elastic.count_waiting(self.membership.count)
        self.elastic.publish_store_address()

    def _emit(self, event: Event, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, generation=self._restarts, step=None, **fields)

    def workers(self) -> list[Any]:
        """torch's ``Worker`` records of this node (local rank, global rank, pid as ``id``)."""
        return list(self.get_worker_group().workers)

    def close_standbys(self) -> None:
        self.replacer.close()
        self.deaths.close()

    def flush_before_exit(self, result: RunResult | None, timeout_s: float) -> None:
        """The agent gives up (restarts spent, a verdict, its node excluded, its own error): what
        every local rank holds in shared memory is flushed before it goes, where workers asked.
        Not after a success, nor a preemption (its final checkpoint is committed)."""
        if self.verdict == int(ExitCode.REQUEUE):
            return
        if result is not None and not result.is_failed() and self.verdict is None and not self.excluded:
            return
        self.flusher.before_exit(timeout_s)

    def _invoke_run(self, role: str = "default") -> RunResult:
        """torch's loop, its sleep woken by a worker's death (:mod:`resilient.launcher.deaths`)."""
        from torch.distributed.elastic.agent.server import api as elastic_api

        real, elastic_api.time = elastic_api.time, self._clock  # type: ignore[assignment]
        self.deaths.start()
        try:
            return super()._invoke_run(role)
        finally:
            elastic_api.time = real
            self.deaths.close()

    # ---- lifecycle hooks --------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        state = self.elastic.rendezvous()
        if state is not None:
            self.membership.round_started(state)
        for w in worker_group.workers:
            clear_worker(self.heartbeat_dir, w.local_rank)
        mark_stopping(self.heartbeat_dir, False)  # (a SIGTERM the new workers get is not ours)
        self._oom = oom_kills()
        # Every agent of a rendezvous round sees the same round number, unlike its restart count
        # (an agent restarted for a peer's failure does not count it): the workers' store keys and
        # checkpoint directories are named after it, so all ranks of a launch agree.
        round_no = state.round if state is not None else None
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
        self._emit(
            Event.WORKERS_STARTED,
            restart=self._restarts,
            round=round_no,
            ranks={str(w.global_rank): pids.get(w.local_rank) for w in worker_group.workers},
            **self.budgets(),
        )
        return pids

    def budgets(self) -> dict[str, Any]:
        """The launcher's two budgets and what is left of each (events and metrics)."""
        cfg, policy = self.policy.cfg, self.policy
        return {
            "max_restarts": cfg.max_restarts,
            "restart_window_s": cfg.restart_window_s,
            "restarts_left": policy.restarts_left,
            "max_replacements": cfg.max_replacements,
            "replacement_window_s": cfg.replacement_window_s,
            "replacements_left": policy.replacements_left,
        }

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarts += 1
        delay = self.backoff.delay(self._restarts)
        if delay > 0:
            time.sleep(delay)  # exponential backoff between quick relaunches (bounded)
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        reason, self._group_reason = self._group_reason, None
        self._emit(Event.GROUP_STOPPED, restart=self._restarts, **({"reason": reason} if reason else {}))
        mark_stopping(self.heartbeat_dir, True)  # (our SIGTERM: stop now, not a preemption)
        super()._stop_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        mark_stopping(self.heartbeat_dir, True)
        super()._shutdown(death_sig, timeout)

    # ---- monitoring -------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        seen = self._silent(worker_group) or self._marked(worker_group)
        if self.elastic.processes():  # (and the others that died meanwhile: one round, one decision)
            silent = {s.local_rank for s in seen}
            seen += [s for s in self._exited(worker_group) if s.local_rank not in silent]
        if seen:
            stopped = self._on_deaths(worker_group, seen)
            if stopped is not None:
                return stopped
        if self.policy.cfg.replace is Replace.RANK and self.elastic.processes():
            newest = max(self._worker_started.values(), default=0.0)
            self.replacer.keep_standbys(worker_group.workers, newest)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:  # a death torch saw first: too late to replace it alone
            seen = self._from_result(worker_group, result)
            self._report(seen)
            self._act(worker_group, self._decide(worker_group, seen, can_replace=False))
        return result

    def _on_deaths(self, worker_group: WorkerGroup, seen: list[_Seen]) -> RunResult | None:
        """Decide about one round's deaths and act: None when each dead rank was replaced, else
        the failed result on which torch's loop restarts or stops the group."""
        self._report(seen)
        decision = self._decide(worker_group, seen, can_replace=self.elastic.processes())
        if decision.action is Action.REPLACE:
            for s in seen:
                if s.local_rank is not None and s.death.beat is not None:  # (stepping: it has both)
                    self.replacer.replace(worker_group.workers[s.local_rank], s.death.beat, s.cause)
                    self._worker_started[s.local_rank] = time.monotonic()
            self._oom = oom_kills()
            return None
        ours = RunResult(
            state=WorkerState.FAILED,
            failures={
                s.death.global_rank: ProcessFailure(
                    local_rank=s.local_rank if s.local_rank is not None else -1,
                    pid=s.pid,
                    exitcode=s.death.exitcode,
                    error_file="",
                )
                for s in seen
            },
        )
        result = ours
        if not any(s.death.missed_heartbeat for s in seen):
            # torch stops the others now (SIGTERM) and reports them too, as it does without us
            result = super()._monitor_workers(worker_group)
            dead = {s.death.global_rank for s in seen}
            stopped = [s for s in self._from_result(worker_group, result) if s.death.global_rank not in dead]
            self._report(stopped, died=False)
            if result.state != WorkerState.FAILED:
                result = ours
        self._act(worker_group, decision)
        return result

    def _decide(self, worker_group: WorkerGroup, seen: list[_Seen], *, can_replace: bool) -> Decision:
        marked = any(is_unhealthy(self.heartbeat_dir, w.local_rank) for w in worker_group.workers)
        return self.policy.decide([s.death for s in seen], node_unhealthy=marked, can_replace=can_replace)

    def _act(self, worker_group: WorkerGroup, decision: Decision) -> None:
        """Carry out a decision for the group: torch's loop restarts it while restarts are left."""
        self._group_reason = decision.not_alone
        checks = self._take_health_marks(worker_group)
        if decision.action is Action.RESTART:
            return
        self.elastic.restarts_left = 0  # torch's loop stops the workers and returns
        if decision.action is Action.EXCLUDE:
            self.excluded = True
            n = self.policy.history.health_failures
            self._emit(Event.NODE_EXCLUDED, health_failures=n, checks=checks)
            last = checks[0].get("check") if checks else None
            logger.error(
                f"this node failed health checks {n} times (last: {last}): excluding it from the job"
            )
            return
        if decision.give_up is GiveUp.REPEATS:
            rank = decision.ranks[0] if decision.ranks else None
            self.failures.append({"global_rank": rank, "cause": decision.cause, "ts": time.time()})
            logger.error(f"{decision.cause}; not restarting")
        if decision.give_up is not GiveUp.BUDGET:  # (a spent budget is torch's "restarts exhausted")
            self.verdict = code = decision.exitcode
            logger.info(f"stopping ({_STOP_WORDS.get(code or 0, code)}): not restarting")

    def _take_health_marks(self, worker_group: WorkerGroup) -> list[dict[str, Any]]:
        """The failed health checks this node's workers marked, removed as they are read (one
        failure counts once)."""
        checks = []
        for w in worker_group.workers:
            mark = take_unhealthy(self.heartbeat_dir, w.local_rank)
            if mark is not None:
                checks.append({"local_rank": w.local_rank, **mark})
        if checks:
            self.health_failures.append({"ts": time.time(), "checks": checks})
        return checks

    # ---- what died ----------------------------------------------------------------------------------
    def _death(
        self, global_rank: int, local_rank: int | None, exitcode: int, beat: Beat | None, **kw: bool
    ) -> Death:
        unhealthy = local_rank is not None and is_unhealthy(self.heartbeat_dir, local_rank)
        return Death(global_rank, exitcode, beat, unhealthy=unhealthy, **kw)

    def _beat(self, local_rank: int | None) -> Beat | None:
        return None if local_rank is None else read_beat(beat_path(self.heartbeat_dir, local_rank))

    def _exited(self, worker_group: WorkerGroup) -> list[_Seen]:
        """The workers that ended with an error since torch last looked."""
        oom, out = oom_kills(), []
        for local_rank, code in self.elastic.exited():
            w = worker_group.workers[local_rank]
            pid = int(self.elastic.process(local_rank).proc.pid)
            death = self._death(w.global_rank, local_rank, code, self._beat(local_rank))
            out.append(_Seen(death, local_rank, pid, describe_exit(code, pid, self._oom, oom), False))
        return out

    def _from_result(self, worker_group: WorkerGroup, result: RunResult) -> list[_Seen]:
        """The failures torch's own monitor reported."""
        by_global = {w.global_rank: w for w in worker_group.workers}
        oom, out = oom_kills(), []
        for global_rank, f in result.failures.items():
            w = by_global.get(global_rank)
            local_rank = w.local_rank if w is not None else None
            death = self._death(global_rank, local_rank, f.exitcode, self._beat(local_rank))
            cause = describe_exit(f.exitcode, f.pid, self._oom, oom)
            out.append(_Seen(death, local_rank, f.pid, cause, False))
        return out

    def _report(self, seen: list[_Seen], *, died: bool = True) -> None:
        """Record each death (``died``: the worker's own, not one torch stopped for a peer's), and
        flush the dead worker's snapshots where it asked for that."""
        for s in seen:
            if died and s.local_rank is not None:
                self.flusher.on_death(s.local_rank, s.death.global_rank)
            if s.reported:
                continue
            record = {
                "global_rank": s.death.global_rank,
                "local_rank": s.local_rank,
                "pid": s.pid,
                "exitcode": s.death.exitcode,
                "cause": s.cause,
                "ts": time.time(),
            }
            self.failures.append(record)
            self._emit(Event.WORKER_DIED, **record)
            logger.error(f"worker rank {s.death.global_rank} (pid {s.pid}) died: {s.cause}")

    def _marked(self, worker_group: WorkerGroup) -> list[_Seen]:
        """A worker marked for replacement (a straggler its node's judge named, a replica found
        corrupt twice), ended now (SIGKILL of its session) so that it is replaced like any dead
        rank; [] when none is."""
        if not self.elastic.processes():
            return []
        for w in worker_group.workers:
            mark = take_replace(self.heartbeat_dir, w.local_rank)
            if mark is None or not isinstance(w.id, int):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(w.id), signal.SIGKILL)
            cause = str(
                mark.get("cause")
                or f"ended as a straggler ({mark.get('slowdown')}x its peers' work per step)"
            )
            logger.warning(f"worker rank {w.global_rank} (pid {w.id}) {cause}")
            death = self._death(w.global_rank, w.local_rank, -signal.SIGKILL, self._beat(w.local_rank))
            return [_Seen(death, w.local_rank, w.id, cause, False)]
        return []

    def _limit(self, local_rank: int, beat: Beat | None, now: float) -> tuple[float, float]:
        """(how long ``local_rank`` has been silent, how long it may be): before its first beat
        and once its last says it is exiting, the start-up limit; else the heartbeat timeout."""
        if beat is None:
            return now - self._worker_started.get(local_rank, self._started), self.startup_timeout
        # a worker that left the runtime is expected to exit, not to beat: its silence counts
        # against the start-up limit (a teardown that never ends), not the hang limit
        return beat.age_s, self.startup_timeout if beat.exiting else self.heartbeat_timeout

    def _silence_deadline(self) -> float | None:
        """When the first worker that beats no more reaches its limit (``time.monotonic()``; a
        millisecond past it, so that it is over the limit then), if it does not beat before."""
        try:
            workers = self.workers()
        except Exception:  # (no worker group yet)
            return None
        now, due = time.monotonic(), None
        for w in workers:
            age, limit = self._limit(w.local_rank, self._beat(w.local_rank), now)
            at = now + (limit - age) + 1e-3
            due = at if due is None else min(due, at)
        return due

    def _silent(self, worker_group: WorkerGroup) -> list[_Seen]:
        """The first worker that stopped beating, SIGKILLed now (a stopped or GIL-bound process
        never handles SIGTERM), after its stacks were dumped; [] when every worker beats."""
        now = time.monotonic()
        for w in worker_group.workers:
            beat = self._beat(w.local_rank)
            age, limit = self._limit(w.local_rank, beat, now)
            step = beat.step if beat is not None else None
            if age <= limit:
                continue
            record = {
                "global_rank": w.global_rank,
                "local_rank": w.local_rank,
                "pid": w.id,
                "silent_s": round(age, 3),
                "limit_s": limit,
                "last_step": step,
                "ts": time.time(),
            }
            cause = f"no heartbeat for {age:.1f} s"
            self.failures.append({**record, "cause": cause})
            self._emit(Event.HEARTBEAT_MISSED, **record)
            logger.error(
                f"worker rank {w.global_rank} (pid {w.id}) silent for {age:.1f} s (limit {limit:g} s)"
            )
            if isinstance(w.id, int) and self.fault_stacks:
                stacks = dump_stacks(w.id, native=self.native_stacks)
                if stacks is not None:
                    self._emit(
                        Event.FAULT_REPORT,
                        global_rank=w.global_rank,
                        pid=w.id,
                        kind="no_heartbeat",
                        last_step=step,
                        stacks=stacks,
                        source="py-spy",
                    )
            if isinstance(w.id, int):
                # a stopped or GIL-bound process never handles SIGTERM: kill its session (its own) now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(w.id), signal.SIGKILL)
            death = self._death(w.global_rank, w.local_rank, -signal.SIGKILL, beat, missed_heartbeat=True)
            return [_Seen(death, w.local_rank, w.id or -1, cause, True)]
        return []
