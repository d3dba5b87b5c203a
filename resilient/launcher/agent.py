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
  say, and only this agent (its supervisor) acts on it: replace a dead rank alone (bounded by
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

Each monitor round (heartbeats, causes, decisions, replacements) is
:class:`resilient.launcher.supervisor.Supervisor`'s, against the
:class:`~resilient.launcher.backend.WorkerBackend` seam; this agent is torch's loop around it.
torch elastic's private state is reached through :class:`resilient.launcher.elastic.Elastic` only,
the backend the supervisor is given.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
from loguru import logger
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from resilient.backoff import Backoff
from resilient.contract import clear_worker, mark_stopping
from resilient.errors import ExitCode
from resilient.events import Event, EventLog
from resilient.launch_env import Var
from resilient.launcher.deaths import DeathWatch, WakeableTime
from resilient.launcher.elastic import Elastic
from resilient.launcher.flusher import Flusher
from resilient.launcher.policy import Action, LaunchPolicy, Replace
from resilient.launcher.replace import Replacer
from resilient.launcher.seating import Seating
from resilient.launcher.spare import LEASE_S
from resilient.launcher.supervisor import Round, Seen, Supervisor
from resilient.launcher.waiting import Membership


class ResilientAgent(LocalElasticAgent):
    def __init__(
        self,
        *args: Any,
        policy: LaunchPolicy,
        heartbeat_dir: Path,
        heartbeat_timeout: float,
        startup_timeout: float,
        events: EventLog | None,
        standby: int,
        standby_mode: str,
        admit_waiting: bool = False,
        shm_name: str | None = None,
        seats_at: tuple[str, int] | None = None,
        max_nodes: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.policy = policy
        self.elastic = Elastic(self)
        self.elastic.unbound_restarts()  # the policy counts restarts and replacements, each its own
        self.heartbeat_dir = heartbeat_dir
        self.events = events
        self.backoff = Backoff(policy.cfg.backoff_initial_s, policy.cfg.backoff_max_s)
        park = standby_mode == "park"
        replacer = Replacer(
            self.elastic, heartbeat_dir, self._emit, standby, park=park, budgets=policy.budgets
        )
        self.flusher = Flusher(shm_name, self._emit)  # (checkpoint.flush_on_death: a dead rank's snapshots)
        self.supervisor = Supervisor(
            self.elastic,
            policy,
            replacer,
            heartbeat_dir,
            heartbeat_timeout=heartbeat_timeout,
            startup_timeout=startup_timeout,
            emit=self._emit,
            on_death=self.flusher.on_death,
        )
        # torch's loop sleeps its monitor interval between looks at the workers: a death wakes it
        self._clock = WakeableTime()
        self._clock.deadline = self.supervisor.silence_deadline
        self.deaths = DeathWatch(self.elastic.pids, self._clock.wake)
        self.forward_signals: Any = None  # the launcher's handler for SIGUSR1/SIGTERM (preemption)
        self._restarts = 0
        # a lost node's seat is taken by a spare node (c10d, --replace rank): seats.py, spare.py
        self.seating = (
            self._seating(seats_at, max_nodes, replacer) if policy.cfg.replace is Replace.RANK else None
        )
        self.membership = self._membership(admit_waiting)  # (which waiting nodes restart the group)
        self.elastic.count_waiting(self.membership.count)
        self.elastic.publish_store_address()

    def _seating(
        self, where: tuple[str, int] | None, max_nodes: int | None, replacer: Replacer
    ) -> Seating | None:
        """This node's seat in the rendezvous store, or its spare's watch (None: no c10d store)."""
        if where is None:
            return None
        spec = self.get_worker_group().spec
        run_id, count = spec.rdzv_handler.get_run_id(), spec.local_world_size
        seating = Seating(where, run_id, self.elastic, replacer, self.heartbeat_dir, self._emit, count)
        seating.max_nodes = max_nodes
        return seating

    def _membership(self, admit_waiting: bool) -> Membership:
        seating = self.seating
        if seating is None:
            return Membership(self._emit, admit_waiting)
        return Membership(
            self._emit,
            admit_waiting,
            taken=seating.seat_taken,
            spares=seating.spares,
            grace_s=2 * LEASE_S + 1.0,
        )

    def _emit(self, event: Event, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, generation=self._restarts, step=None, **fields)

    def workers(self) -> list[Any]:
        """torch's ``Worker`` records of this node (local rank, global rank, pid as ``id``)."""
        return list(self.get_worker_group().workers)

    def close_standbys(self) -> None:
        self.supervisor.replacer.close()
        self.deaths.close()

    def leave_seat(self, result: RunResult | None) -> None:
        """Stop holding this node's seat; goodbye unless it failed (a spare may take it then)."""
        if self.seating is not None:
            sup = self.supervisor
            bye = (result is not None and not result.is_failed()) or sup.verdict is not None or sup.excluded
            self.seating.close(bye=bye)

    def flush_before_exit(self, result: RunResult | None, timeout_s: float) -> None:
        """The agent gives up (restarts spent, a verdict, its node excluded, its own error): what
        every local rank holds in shared memory is flushed before it goes, where workers asked.
        Not after a success, nor a preemption (its final checkpoint is committed)."""
        sup = self.supervisor
        if sup.verdict == int(ExitCode.REQUEUE):
            return
        if result is not None and not result.is_failed() and sup.verdict is None and not sup.excluded:
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
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous, unless this node parks as a running round's spare and takes a lost
        node's seat (:mod:`resilient.launcher.spare`)."""
        seating = self.seating
        if seating is not None:
            spec = worker_group.spec
            if seating.park(str(spec.entrypoint), tuple(str(a) for a in spec.args)) is not None:
                seating.take(worker_group)
                return
        super()._rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        with self.seating.starting() if self.seating is not None else contextlib.nullcontext() as seat_round:
            return self._start(worker_group, seat_round)

    def _start(self, worker_group: WorkerGroup, seat_round: int | None) -> dict[int, Any]:
        state = self.elastic.sync_rendezvous() if seat_round is not None else self.elastic.rendezvous()
        if state is not None:
            self.membership.round_started(state)
        for w in worker_group.workers:
            clear_worker(self.heartbeat_dir, w.local_rank)
        mark_stopping(self.heartbeat_dir, False)  # (a SIGTERM the new workers get is not ours)
        self.supervisor.starting()
        # Every agent of a rendezvous round sees the same round number, unlike its restart count
        # (an agent restarted for a peer's failure does not count it): the workers' store keys and
        # checkpoint directories are named after it, so all ranks of a launch agree.
        round_no = seat_round if seat_round is not None else state.round if state is not None else None
        if round_no is not None:
            os.environ[Var.LAUNCH_ROUND] = str(round_no)  # inherited by the workers started now
        pids = super()._start_workers(worker_group)
        self.supervisor.started()
        if self.seating is not None:
            self.seating.started(worker_group, round_no)
        if self.forward_signals is not None:  # starting workers installed torch's own SIGTERM handler
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(sig, self.forward_signals)
        if self._restarts:
            self._emit(Event.RELAUNCHED, restart=self._restarts, pids=sorted(pids.values()))
        self._emit(
            Event.WORKERS_STARTED,
            restart=self._restarts,
            round=round_no,
            # the launcher's own start (its imports, its rendezvous): the job's start for goodput
            launched=psutil.Process().create_time(),
            ranks={str(w.global_rank): pids.get(w.local_rank) for w in worker_group.workers},
            **self.policy.budgets(),
        )
        return pids

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarts += 1
        delay = self.backoff.delay(self._restarts)
        if delay > 0:
            time.sleep(delay)  # exponential backoff between quick relaunches (bounded)
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        reason, self.elastic.group_reason = self.elastic.group_reason, None
        self._emit(Event.GROUP_STOPPED, restart=self._restarts, **({"reason": reason} if reason else {}))
        mark_stopping(self.heartbeat_dir, True)  # (our SIGTERM: stop now, not a preemption)
        super()._stop_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        mark_stopping(self.heartbeat_dir, True)
        super()._shutdown(death_sig, timeout)

    # ---- monitoring -------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        sup = self.supervisor
        if self.seating is not None and self.seating.fenced is not None and sup.verdict is None:
            return self._fenced(self.seating.fenced)
        found = sup.tend()
        if found is not None and found.decision.action is not Action.REPLACE:
            return self._group_failed(worker_group, found)
        sup.keep_standbys()
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:  # a death torch saw first: too late to replace it alone
            seen = self._from_result(worker_group, result)
            sup.report(seen)
            sup.act(sup.decide(seen, can_replace=False))
        return result

    def _fenced(self, by: str) -> RunResult:
        """A spare took this node's seat (it was cut off long enough to be taken for lost): its
        workers' ranks run there now, so these stop, and the agent leaves (exit 75)."""
        self._emit(Event.NODE_FENCED, taken_by=by)
        logger.error(f"this node's seat was taken by spare {by} (it was taken for lost): stopping")
        self.supervisor.verdict = int(ExitCode.HARD_FAULT)
        self.elastic.stop_group(f"seat taken by spare {by}")
        return RunResult(state=WorkerState.FAILED)

    def _group_failed(self, worker_group: WorkerGroup, found: Round) -> RunResult:
        """The failed result on which torch's loop restarts or stops the group, for a round whose
        deaths were not replaced alone."""
        seen = found.seen
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
            # torch stops the others now (SIGTERM) and reports them too, as it does without us:
            # marked ours (stop now), unless a preempted rank's peers still write their final
            # checkpoint (that SIGTERM then waits for them, as a scheduler's does)
            if found.decision.action is not Action.REQUEUE:
                mark_stopping(self.heartbeat_dir, True)
            result = super()._monitor_workers(worker_group)
            dead = {s.death.global_rank for s in seen}
            stopped = [s for s in self._from_result(worker_group, result) if s.death.global_rank not in dead]
            self.supervisor.report(stopped, died=False)
            if result.state != WorkerState.FAILED:
                result = ours
        self.supervisor.act(found.decision)
        return result

    def _from_result(self, worker_group: WorkerGroup, result: RunResult) -> list[Seen]:
        """The failures torch's own monitor reported."""
        by_global = {w.global_rank: w for w in worker_group.workers}
        out = []
        for global_rank, f in result.failures.items():
            w = by_global.get(global_rank)
            out.append(self.supervisor.dead(global_rank, w.local_rank if w else None, f.exitcode, f.pid))
        return out
