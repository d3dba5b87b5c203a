"""One monitor round of the agent, against a :class:`~resilient.launcher.backend.WorkerBackend`:
which workers died or went silent, what the policy decides about them, and carrying it out.

- **Found.** A worker that stopped beating (SIGSTOP, a hang holding the GIL) is as dead as one
  that exited: after ``heartbeat_timeout`` (``startup_timeout`` before its first beat and once its
  last beat says it is exiting) its stacks are dumped and it is SIGKILLed. A worker its node
  marked for replacement (a straggler, a replica found corrupt twice) is ended so too. The
  others that exited meanwhile join the same round: one round, one decision.
- **Decided.** :meth:`LaunchPolicy.decide <resilient.launcher.policy.LaunchPolicy.decide>` says
  what the round's deaths cost; each death is reported with its cause
  (:mod:`resilient.launcher.causes`) as a ``worker_died`` event.
- **Done.** Each dead rank replaced alone (:class:`~resilient.launcher.replace.Replacer`), or the
  group restarted or stopped through the backend, with the verdict the launcher ends with.

The agent (:mod:`resilient.launcher.agent`) runs a round at each of torch's monitor polls; a unit
test runs it against an in-memory backend.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from loguru import logger

from resilient.contract import Beat, beat_path, is_unhealthy, read_beat, take_replace, take_unhealthy
from resilient.errors import ExitCode
from resilient.events import Event
from resilient.launcher.backend import Slot, WorkerBackend
from resilient.launcher.causes import describe_exit, dump_stacks, oom_kills
from resilient.launcher.policy import Action, Death, Decision, GiveUp, LaunchPolicy, Replace
from resilient.launcher.replace import Replacer

_STOP_WORDS = {int(ExitCode.FATAL): "fatal", int(ExitCode.REQUEUE): "requeue"}


class Seen(NamedTuple):
    """A dead worker as the agent found it: the policy's view of it, and what the events name."""

    death: Death
    local_rank: int | None
    pid: int
    cause: str
    reported: bool  # announced already (``heartbeat_missed``), not as ``worker_died``


class Round(NamedTuple):
    """One round's deaths and the decision about them."""

    seen: list[Seen]
    decision: Decision


class Supervisor:
    """``emit(event, **fields)``: the agent's event log; ``on_death(local_rank, global_rank)``: a
    worker died of its own (its snapshots are flushed); ``clock``: ``time.monotonic``."""

    def __init__(
        self,
        backend: WorkerBackend,
        policy: LaunchPolicy,
        replacer: Replacer,
        heartbeat_dir: Path,
        *,
        heartbeat_timeout: float,
        startup_timeout: float,
        emit: Callable[..., None],
        on_death: Callable[[int, int], Any] = lambda local_rank, global_rank: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.policy = policy
        self.replacer = replacer
        self.heartbeat_dir = heartbeat_dir
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self._emit = emit
        self._on_death = on_death
        self._clock = clock
        self.verdict: int | None = None  # an exit code the launcher must end with, not restart
        self.excluded = False
        self.failures: list[dict[str, Any]] = []
        self.health_failures: list[dict[str, Any]] = []
        self.fault_stacks = True  # py-spy dumps a silent worker's stacks before it is killed
        self.native_stacks = False  # ... with its C frames (--native-stacks: ~0.3 s more before the kill)
        self._started = clock()
        self._worker_started: dict[int, float] = {}  # local rank -> when its current process started
        self._oom = oom_kills()

    # ---- the group's start --------------------------------------------------------------------------
    def starting(self) -> None:
        """The group is about to start: an OOM kill from now on is one of its workers'."""
        self._oom = oom_kills()

    def started(self) -> None:
        """The group's workers started now: their start-up limits count from here."""
        self._started = self._clock()
        self._worker_started = {w.local_rank: self._started for w in self.backend.workers()}

    # ---- a round --------------------------------------------------------------------------------------
    def tend(self) -> Round | None:
        """Find this round's dead, report them and decide; a REPLACE decision is carried out
        here, any other is the caller's to :meth:`act` on (after the backend stopped the others).
        None when every worker lives and beats."""
        seen = self._silent() or self._marked()
        if self.backend.processes():  # (and the others that died meanwhile: one round, one decision)
            silent = {s.local_rank for s in seen}
            seen += [s for s in self._exited() if s.local_rank not in silent]
        if not seen:
            return None
        self.report(seen)
        decision = self.decide(seen, can_replace=self.backend.processes())
        if decision.action is Action.REPLACE:
            for s in seen:
                if s.local_rank is not None and s.death.beat is not None:  # (stepping: it has both)
                    self.replacer.replace(s.local_rank, s.death.beat, s.cause)
                    self._worker_started[s.local_rank] = self._clock()
            self._oom = oom_kills()
        return Round(seen, decision)

    def keep_standbys(self) -> None:
        """Warm standbys kept waiting, where dead ranks are replaced alone."""
        if self.policy.cfg.replace is Replace.RANK and self.backend.processes():
            self.replacer.keep_standbys(max(self._worker_started.values(), default=0.0))

    def decide(self, seen: list[Seen], *, can_replace: bool) -> Decision:
        workers = self.backend.workers()
        marked = any(is_unhealthy(self.heartbeat_dir, w.local_rank) for w in workers)
        return self.policy.decide([s.death for s in seen], node_unhealthy=marked, can_replace=can_replace)

    def act(self, decision: Decision) -> None:
        """Carry out a decision for the group: the backend restarts it, or stops it for good."""
        checks = self._take_health_marks()
        if decision.action is Action.RESTART:
            self.backend.restart_group(decision.not_alone)
            return
        self.backend.stop_group(decision.not_alone)
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

    def _take_health_marks(self) -> list[dict[str, Any]]:
        """The failed health checks this node's workers marked, removed as they are read (one
        failure counts once)."""
        checks = []
        for w in self.backend.workers():
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

    def dead(self, global_rank: int, local_rank: int | None, exitcode: int, pid: int) -> Seen:
        """A worker that ended with ``exitcode``, as the backend (or torch's own monitor) saw it."""
        death = self._death(global_rank, local_rank, exitcode, self._beat(local_rank))
        return Seen(death, local_rank, pid, describe_exit(exitcode, pid, self._oom, oom_kills()), False)

    def _exited(self) -> list[Seen]:
        """The workers that ended with an error since the backend last looked."""
        by_local = {w.local_rank: w for w in self.backend.workers()}
        out = []
        for local_rank, code in self.backend.exited():
            w = by_local[local_rank]
            out.append(self.dead(w.global_rank, local_rank, code, w.pid if w.pid is not None else -1))
        return out

    def report(self, seen: list[Seen], *, died: bool = True) -> None:
        """Record each death (``died``: the worker's own, not one the backend stopped for a
        peer's), and flush the dead worker's snapshots where it asked for that."""
        for s in seen:
            if died and s.local_rank is not None:
                self._on_death(s.local_rank, s.death.global_rank)
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

    def _marked(self) -> list[Seen]:
        """A worker marked for replacement (a straggler its node's judge named, a replica found
        corrupt twice), ended now (SIGKILL of its session) so that it is replaced like any dead
        rank; [] when none is."""
        if not self.backend.processes():
            return []
        for w in self.backend.workers():
            mark = take_replace(self.heartbeat_dir, w.local_rank)
            if mark is None or w.pid is None:
                continue
            self.backend.kill(w.local_rank)
            cause = str(
                mark.get("cause")
                or f"ended as a straggler ({mark.get('slowdown')}x its peers' work per step)"
            )
            logger.warning(f"worker rank {w.global_rank} (pid {w.pid}) {cause}")
            death = self._death(w.global_rank, w.local_rank, -signal.SIGKILL, self._beat(w.local_rank))
            return [Seen(death, w.local_rank, w.pid, cause, False)]
        return []

    # ---- who went silent ----------------------------------------------------------------------------
    def _limit(self, local_rank: int, beat: Beat | None, now: float) -> tuple[float, float]:
        """(how long ``local_rank`` has been silent, how long it may be): before its first beat
        and once its last says it is exiting, the start-up limit; else the heartbeat timeout."""
        if beat is None:
            return now - self._worker_started.get(local_rank, self._started), self.startup_timeout
        # a worker that left the runtime is expected to exit, not to beat: its silence counts
        # against the start-up limit (a teardown that never ends), not the hang limit
        return beat.age_s, self.startup_timeout if beat.exiting else self.heartbeat_timeout

    def silence_deadline(self) -> float | None:
        """When the first worker that beats no more reaches its limit (on ``clock``; a
        millisecond past it, so that it is over the limit then), if it does not beat before."""
        try:
            workers = self.backend.workers()
        except Exception:  # (no worker group yet)
            return None
        now, due = self._clock(), None
        for w in workers:
            age, limit = self._limit(w.local_rank, self._beat(w.local_rank), now)
            at = now + (limit - age) + 1e-3
            due = at if due is None else min(due, at)
        return due

    def _silent(self) -> list[Seen]:
        """The first worker that stopped beating, SIGKILLed now (a stopped or GIL-bound process
        never handles SIGTERM), after its stacks were dumped; [] when every worker beats."""
        now = self._clock()
        for w in self.backend.workers():
            beat = self._beat(w.local_rank)
            age, limit = self._limit(w.local_rank, beat, now)
            if age <= limit:
                continue
            step = beat.step if beat is not None else None
            record = {
                "global_rank": w.global_rank,
                "local_rank": w.local_rank,
                "pid": w.pid,
                "silent_s": round(age, 3),
                "limit_s": limit,
                "last_step": step,
                "ts": time.time(),
            }
            cause = f"no heartbeat for {age:.1f} s"
            self.failures.append({**record, "cause": cause})
            self._emit(Event.HEARTBEAT_MISSED, **record)
            logger.error(
                f"worker rank {w.global_rank} (pid {w.pid}) silent for {age:.1f} s (limit {limit:g} s)"
            )
            self._dump_stacks(w, step)
            self.backend.kill(w.local_rank)
            death = self._death(w.global_rank, w.local_rank, -signal.SIGKILL, beat, missed_heartbeat=True)
            return [Seen(death, w.local_rank, w.pid or -1, cause, True)]
        return []

    def _dump_stacks(self, w: Slot, step: int | None) -> None:
        """A silent worker's stacks in a ``fault_report`` event, before it is killed (py-spy)."""
        if w.pid is None or not self.fault_stacks:
            return
        stacks = dump_stacks(w.pid, native=self.native_stacks)
        if stacks is not None:
            self._emit(
                Event.FAULT_REPORT,
                global_rank=w.global_rank,
                pid=w.pid,
                kind="no_heartbeat",
                last_step=step,
                stacks=stacks,
                source="py-spy",
            )
