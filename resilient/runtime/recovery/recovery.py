"""What every rank does between a failed generation and the next (the built-in engine's RECOVERING
phase): the fault posted and reported, the group aborted, the restart policy's verdict, the health
checks, the newest snapshot step every rank holds agreed on, and the restore prepared for the next
generation. Also the two ways into a recovery that are not a fault of this process's: a
replacement joining its dead predecessor's survivors, and a preemption (a final checkpoint, then
the requeue exit)."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from loguru import logger

from resilient.contract import wait_exited
from resilient.detectors.replicas import SDC, CorruptReplica
from resilient.errors import (
    HardFault,
    Preempted,
    RestartBudgetExhausted,
    SetupFailed,
    StateRestoreError,
    StepInterrupted,
)
from resilient.events import Event
from resilient.runtime.coordination.agreement import plan_step
from resilient.runtime.coordination.coordinator import Coordinator
from resilient.runtime.faults.exits import raised_as_itself
from resilient.runtime.faults.records import FaultRecord, Severity, Symptom
from resilient.runtime.keeping.buckets import agreed
from resilient.runtime.keeping.mirrors import Mirrors
from resilient.runtime.leave.notice import Detection
from resilient.runtime.recovery.policy import RestartPolicy
from resilient.runtime.run.generation import PendingRestore
from resilient.runtime.steps.loop import StepLoop


class Recovery:
    """See the module docstring; ``recover`` and ``join_survivors`` return the restore the next
    generation resumes from, or raise what ends the run (typed)."""

    def __init__(
        self,
        loop: StepLoop,
        coord: Coordinator,
        keeper: Mirrors,
        detection: Detection,
        policy: RestartPolicy,
    ) -> None:
        self.session = loop.session
        self.t = loop.session.t
        self.loop = loop
        self.coord = coord
        self.keeper = keeper
        self.detection = detection
        self.hard_timer = detection.hard_timer
        self.policy = policy
        self.replacing: int | None = None  # the generation a replacement joins (it has no live state)

    def recover(self, exc: BaseException | None) -> PendingRestore:
        s, loop = self.session, self.loop
        gen, step = s.generation, loop.step
        fault_ts = time.time()
        rec: FaultRecord | None = None
        if exc is not None:
            rec = FaultRecord.from_exception(exc, rank=s.rank, generation=gen, step=step)
            # The traceback pins the failed generation's frames, and through them its model, DDP
            # reducer and process group, in a reference cycle. Left to a random GC pass (or to
            # interpreter exit, where gloo's destructors abort the process), they must go now.
            # (Its text needs only code and line numbers, not the frames' locals.)
            traceback.clear_frames(exc.__traceback__)
            # (a fault this rank already heard of is not asked of the job's store again)
            primary = self.coord.post_fault(rec, known=self.detection.remote_fault(gen))
            if primary.rank == s.rank and primary.kind == rec.kind:  # this rank's own fault
                s.fault_report(rec, tb="".join(traceback.format_exception(exc)))
        else:  # we had returned; a peer faulted before everyone finished
            found = self.detection.heard(gen) or self.coord.primary_fault(gen)
            if found is None:
                raise HardFault(f"generation {gen} released without a fault record")
            primary = found
        heard = self.detection.heard_at(gen)
        noticed = fault_ts if heard is None else min(fault_ts, heard)
        s.fault_detected(gen, step, primary, rec.message if rec else "finished; a peer faulted", noticed)
        t0 = time.time()
        n = 0
        group = loop.gen.group
        if group is not None:  # (None: this generation's group was never built)
            n = group.abort()
            group.destroy()
            loop.gen.group = None
        s.events.emit(
            Event.GROUP_ABORTED,
            generation=gen,
            step=step,
            connections=n,
            duration_s=time.time() - t0,
            cpu_s=time.thread_time(),
        )
        if rec is not None and rec.severity == Severity.HARD.value:
            self.coord.abort_generation(gen, f"hard fault: {rec.signature}")
            raise HardFault(f"rank {s.rank} cannot recover in-process: {rec.message}") from exc
        if primary.kind == Symptom.PREEMPT.value:
            self._preempt(gen, primary)
        self.hard_timer.arm(self.t.barrier + 10.0)
        try:
            history = [asdict(f) for f in [*self.policy.history, primary]]
            for d in loop.detectors.all:  # (a guard fault seen at this step before: its verdict)
                d.recovering(primary, history)
            delay = self.policy.admit(primary)
        except RestartBudgetExhausted as e:
            try:  # diagnosis only
                seen = "; ".join(f"rank {o['rank']}: {o['message']}" for o in self.coord.observations(gen))
            except Exception as store_gone:
                seen = f"unavailable ({type(store_gone).__name__}: {store_gone})"
            logger.error("rank {}: giving up: {} (last fault as each rank saw it: {})", s.rank, e, seen)
            # every rank reaches the same verdict from the same agreed faults, some later than
            # others: the store's host must not leave while a slower peer still posts its fault
            self._depart(gen)
            raise
        self.check_health(gen, step)
        lap = Laps()  # the agreement's parts, for the restore_agreed event (docs/recovery.md#phases)
        if primary.kind == SDC and primary.severity == Severity.SOFT.value:
            self._attribute(gen)
            lap("attribute_s")
        if delay > 0:
            time.sleep(delay)
            lap("backoff_s")
        persist = self.keeper.persist
        if persist is not None:
            # a write still in flight would make this rank alone wait at its next save, a wait its
            # peers see as a hang: finish it here, where the recovery barrier holds them
            self.hard_timer.arm(s.cfg.checkpoint.commit_timeout_s + self.t.barrier + 10.0)
            persist.settle(gen, step)
            lap("saves_s")
        loop.settle_before_restore()
        if self.replacing is None:
            offer = loop.live_offer(primary.kind)
        else:  # (its predecessor's capture, for the survivors' live state: handover.py)
            offer = loop.handover.replacement_offer(self.replacing, s.launch.predecessor_pid)
        lap("verify_s")
        own: BaseException | None = None
        try:
            plan = self.coord.recovery_barrier(
                gen, self.keeper.held_steps(), layout := loop.layout_digest(), live=offer
            )
            live = plan.get("live")
            restore = live if live is not None else plan_step(plan, primary)
        except SetupFailed as e:
            self._depart(gen)
            if exc is None or s.rank not in e.ranks or isinstance(exc, StepInterrupted):
                raise  # (a rank pulled out by the culprit: the error names it)
            s.events.emit(Event.RUN_FAILED, generation=gen, step=step, error=str(e))
            own = exc
        except StateRestoreError as e:
            if not s.launch.under_launcher:
                raise
            # (a replacement whose predecessor's snapshots no survivor holds any more): the whole
            # group restarts, and resumes from shared memory or the checkpoint
            self._depart(gen)
            raise HardFault(f"rank {s.rank}: {e}; the launcher restarts the group") from e
        if own is not None:  # raised outside the handler: the user's exception keeps its own chain
            raise raised_as_itself(own, s.rank)
        lap("barrier_s")
        if persist is not None:
            # every rank settled its saves before that agreement, and none saves again before
            # the barrier in prepare_restore: rank 0 clears what did not commit in between
            persist.forget_unfinished(gen, step)
            persist.rebase(restore)  # (a rank the fault interrupted before its save must not differ)
            lap("saves_s")
        # (DDP's layouts were agreed in the same barrier; another agreement only if they changed)
        same = agreed(layout, plan.get("layout_same"), self.coord.same)
        cpu0 = time.thread_time()
        pending = loop.prepare_restore(
            gen,
            restore,
            step,
            fault_ts,
            same,
            live=live is not None,
            donors=plan.get("live_donors"),
            since=primary.since,
        )
        lap("prepare_s")  # (last: the phases put it in the restore, docs/recovery.md#phases)
        parts: dict[str, Any] = {
            "fault_step": step,
            "duration_s": lap.total(),
            **lap.laps,
            **loop.prepare_parts,
            "source": pending.source,
        }
        if "live_refused" in plan:  # (why the step in flight was not enough: docs/recovery.md#live-resume)
            parts["live_refused"] = plan["live_refused"]
        cpu = time.thread_time()  # (this thread's CPU time: the phases' cost, apart from waiting)
        s.events.emit(
            Event.RESTORE_AGREED, generation=gen, step=restore, cpu_s=cpu, prepare_cpu_s=cpu - cpu0, **parts
        )
        s.generation = gen + 1
        return pending

    def _agree_restore_step(self, gen: int) -> int:
        """(A preemption's) the newest step every rank holds."""
        return plan_step(self.coord.recovery_barrier(gen, self.keeper.held_steps()))

    def _attribute(self, gen: int) -> None:
        """Replicas differed: every rank's digests of its last windows, exchanged, name the
        corrupt one where a majority can (detectors/replicas.py); one named twice exits."""
        sdc = self.loop.sdc
        if sdc is None:
            return
        try:
            sdc.attribute(gen, self.coord.exchange)
        except CorruptReplica as e:
            if not e.replaced:
                self._tell_peers(gen, str(e))
                raise
            # its agent ends this process (it polls the mark) and a standby joins the peers, who
            # wait for it in this recovery as for any dead rank: nothing to tell them
            logger.error("rank {}: {}", self.session.rank, e)
            self.session.events.emit(Event.RUN_FAILED, generation=gen, step=self.loop.step, error=str(e))
            self.hard_timer.arm(self.t.barrier + 10.0)
            time.sleep(self.t.barrier)  # (a bound: the agent's SIGKILL ends the wait)
            raise

    def check_health(self, gen: int, step: int | None) -> None:
        node = self.coord.node  # the store this rank uses: its round trip is timed
        store = node.store if node is not None and not node.leader else self.session.store
        self.session.check_health(gen, step, store, self._tell_peers)

    def _tell_peers(self, gen: int, reason: str) -> None:
        """This rank cannot go on in generation ``gen``: its peers' barriers are released."""
        try:
            self.coord.abort_generation(gen, reason)
        except Exception as e:  # the store's host (rank 0) may have exited first, failing its own
            logger.warning(f"rank {self.session.rank}: could not tell the peers (store unreachable: {e})")

    def join_survivors(self, gen: int) -> PendingRestore:
        """A replacement for a dead rank (started by ``resilient launch`` with the dead rank's
        identity): its survivors are in generation ``gen``'s recovery, waiting for this rank. It
        offers the snapshots its predecessor left in this node's shared memory, agrees on the
        step to resume with them, and enters generation ``gen + 1`` as they do."""
        s = self.session
        s.generation = gen
        if s.heartbeat is not None:
            s.heartbeat.generation = gen
        self._await_predecessor()
        self.keeper.adopt_predecessor()
        self.replacing = gen
        try:
            return self.recover(StepInterrupted(f"peer: rank {s.rank} replaced, joins generation {gen}"))
        finally:
            self.replacing = None

    def _await_predecessor(self) -> None:
        """On a machine with GPUs, the dead worker this process replaces may still be freeing its
        device memory (its agent SIGKILLed it just before starting this one): the restore waits
        for its exit. Elsewhere nothing it held is needed again."""
        pid = self.session.launch.predecessor_pid
        if pid is None or not torch.cuda.is_available():
            return
        rank, t0 = self.session.rank, time.monotonic()
        if not wait_exited(pid, self.t.barrier):
            logger.warning(f"rank {rank}: predecessor pid {pid} still alive after {self.t.barrier:g} s")
            return
        logger.debug("rank {}: predecessor {} gone after {:.3f} s", rank, pid, time.monotonic() - t0)

    def _preempt(self, gen: int, primary: FaultRecord) -> None:
        """Every rank left its step: save the newest state all ranks hold, then exit for requeue.
        Ranks may have seen the signal at different steps: once every rank arrived here, each has
        posted every collective count it ever will, so the snapshot kept where this rank stopped
        is verified or dropped for good before the ranks agree on the step to save."""
        self.coord.agree(gen, "preempt", "1", "all")
        self.loop.settle_before_restore()
        step = self._agree_restore_step(gen)
        persist = self.keeper.persist
        if persist is None:
            self._depart(gen)
            raise Preempted(f"preempted ({primary.message}); no checkpoint.dir, nothing saved", step)
        self.hard_timer.arm(self.session.cfg.checkpoint.commit_timeout_s + self.t.barrier)
        state, _ = self.keeper.materialize(step)  # (the ring's copy, or shared memory's)
        persist.final(step, state, gen)
        self._depart(gen)
        raise Preempted(f"preempted ({primary.message}); final checkpoint at step {step} committed", step)

    def _depart(self, gen: int) -> None:
        """Every rank leaves after this generation's last barrier: the store's host last, or it
        resets its peers' connections while they still read."""
        with contextlib.suppress(Exception):
            self.coord.depart(gen, self.session.launch.endpoint.hosts_store)


class Laps:
    """Named durations since the last lap (or since it was made): what a phase's parts took."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start = self.last = clock()
        self.laps: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = self.clock()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return self.clock() - self.start
