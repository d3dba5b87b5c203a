"""What every rank does between a failed generation and the next (the built-in engine's RECOVERING
phase), in the phases the certificate reports (docs/recovery.md#phases):

- **leave**: this rank's fault recorded and posted (or a peer's heard), ``fault_detected``, the
  group ended by its owner (``group_aborted``);
- **admit**: the restart policy's verdict on the primary fault (:func:`decision.admit`, pure);
- **check**: the health checks, and (replicas differed) the corrupt replica named;
- **agree**: saves in flight settled, then the recovery barrier's :class:`RestorePlan`: the live
  step every rank vouched for, or the newest snapshot step every rank holds;
- **prepare**: that state materialized for the next generation (``restore_agreed``).

The engine then **rebuilds** the group on the next generation's store prefix, and the training
function **re-enters**: ``ctx.track`` loads each object (**restore**) and the first ``ctx.steps``
resumes. Also the two ways into a recovery that are not a fault of this process's: a replacement
joining its dead predecessor's survivors, and a preemption (a final checkpoint, then the requeue
exit)."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger

from resilient.contract import wait_exited
from resilient.detectors import Detectors
from resilient.detectors.replicas import CorruptReplica, ReplicaCheck
from resilient.errors import HardFault, Preempted, SetupFailed, StateRestoreError, StepInterrupted
from resilient.events import Event
from resilient.runtime.coordination.agreement import RestorePlan
from resilient.runtime.coordination.coordinator import Coordinator
from resilient.runtime.coordination.pg import GroupOwner
from resilient.runtime.faults.records import FaultRecord
from resilient.runtime.keeping.buckets import agreed
from resilient.runtime.keeping.builtin_keeper import BuiltinKeeper
from resilient.runtime.leave.notice import Detection
from resilient.runtime.recovery import decision
from resilient.runtime.recovery.decision import Admission, Verdict
from resilient.runtime.recovery.policy import RestartPolicy
from resilient.runtime.run.generation import PendingRestore
from resilient.runtime.steps.loop import StepLoop
from resilient.runtime.steps.restore import Restorer


@dataclass
class Left:
    """What the leave phase established: the generation that ended, the step it was in, the
    primary fault and this rank's own record of it (its own exception's), and when it was noticed."""

    generation: int
    step: int | None
    primary: FaultRecord
    own: FaultRecord | None
    exc: BaseException | None
    fault_ts: float


@dataclass
class Agreed:
    """What the agree phase established: the plan, the step it restores, this rank's DDP layouts."""

    plan: RestorePlan
    step: int
    layout: str


class Recovery:
    """See the module docstring; ``recover`` and ``join_survivors`` return the restore the next
    generation resumes from, or raise what ends the run (typed). ``clock`` and ``sleep`` are
    injected: a test's recovery never waits on the wall clock."""

    def __init__(
        self,
        loop: StepLoop,
        coord: Coordinator,
        keeper: BuiltinKeeper,
        detection: Detection,
        policy: RestartPolicy,
        *,
        groups: GroupOwner,
        detectors: Detectors,
        restorer: Restorer,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.session = loop.session
        self.t = loop.session.t
        self.loop = loop
        self.coord = coord
        self.keeper = keeper
        self.detection = detection
        self.hard_timer = detection.hard_timer
        self.policy = policy
        self.groups = groups
        self.detectors = detectors
        self.restorer = restorer
        self.sdc = detectors.get(ReplicaCheck)
        self.clock = clock
        self.sleep = sleep
        self.replacing: int | None = None  # the generation a replacement joins (it has no live state)
        self._departed: set[int] = set()

    def recover(self, exc: BaseException | None) -> PendingRestore:
        left = self._leave(exc)
        try:
            return self._after_leaving(left)
        except BaseException:
            # the run ends here on every rank (the verdicts are alike): the store's host leaves
            # last, or a slower peer still posting its fault finds the store gone
            self._depart(left.generation)
            raise

    def _after_leaving(self, left: Left) -> PendingRestore:
        admission = self._admit(left)
        self.session.at_point("check", left.step)
        self.check_health(left.generation, left.step)
        # the agreement's parts, for the restore_agreed event (docs/recovery.md#phases)
        lap = Laps(self.clock)
        if admission.attribute:
            self._attribute(left.generation)
            lap("attribute_s")
        if admission.delay_s > 0:
            self.sleep(admission.delay_s)
            lap("backoff_s")
        terms = self._agree(left, lap)
        pending = self._prepare(left, terms, lap)
        self.session.generation = left.generation + 1
        return pending

    # -- leave ----------------------------------------------------------------------------------
    def _leave(self, exc: BaseException | None) -> Left:
        """This rank's fault posted (or the peer's fault that released it found), ``fault_detected``,
        and the generation's group ended."""
        s = self.session
        gen, step = s.generation, self.loop.step
        fault_ts = time.time()
        s.at_point("leave", step)
        own: FaultRecord | None = None
        if exc is not None:
            own = FaultRecord.from_exception(exc, rank=s.rank, generation=gen, step=step)
            # The traceback pins the failed generation's frames, and through them its model, DDP
            # reducer and process group, in a reference cycle. Left to a random GC pass (or to
            # interpreter exit, where gloo's destructors abort the process), they must go now.
            # (Its text needs only code and line numbers, not the frames' locals.)
            traceback.clear_frames(exc.__traceback__)
            # (a fault this rank already heard of is not asked of the job's store again)
            primary = self.coord.post_fault(own, known=self.detection.remote_fault(gen))
            if primary.rank == s.rank and primary.kind == own.kind:  # this rank's own fault
                s.record.report(own, tb="".join(traceback.format_exception(exc)))
        else:  # we had returned; a peer faulted before everyone finished
            found = self.detection.heard(gen) or self.coord.primary_fault(gen)
            if found is None:
                raise HardFault(f"generation {gen} released without a fault record")
            primary = found
        heard = self.detection.heard_at(gen)
        noticed = fault_ts if heard is None else min(fault_ts, heard)
        s.record.detected(gen, step, primary, own.message if own else "finished; a peer faulted", noticed)
        t0 = self.clock()
        n = self.groups.end()
        s.events.emit(
            Event.GROUP_ABORTED,
            generation=gen,
            step=step,
            connections=n,
            duration_s=self.clock() - t0,
            cpu_s=time.thread_time(),
        )
        return Left(gen, step, primary, own, exc, fault_ts)

    # -- admit ----------------------------------------------------------------------------------
    def _admit(self, left: Left) -> Admission:
        """The policy's verdict; what ends the run here is raised."""
        s, gen, primary = self.session, left.generation, left.primary
        admission = decision.admit(primary, left.own, self.policy, self._recovering)
        if admission.verdict is Verdict.HARD:
            assert left.own is not None
            self.coord.abort_generation(gen, f"hard fault: {left.own.signature}")
            raise HardFault(f"rank {s.rank} cannot recover in-process: {left.own.message}") from left.exc
        if admission.verdict is Verdict.PREEMPT:
            self._preempt(gen, primary)
        self.hard_timer.arm(self.t.barrier + 10.0)
        if admission.verdict is Verdict.GIVE_UP:
            assert admission.refusal is not None
            self._give_up(gen, admission.refusal)
        return admission

    def _recovering(self, primary: FaultRecord, history: list[dict[str, Any]]) -> None:
        for d in self.detectors.all:  # (a guard fault seen at this step before: its verdict)
            d.recovering(primary, history)

    def _give_up(self, gen: int, refusal: BaseException) -> None:
        try:  # diagnosis only
            seen = "; ".join(f"rank {o['rank']}: {o['message']}" for o in self.coord.observations(gen))
        except Exception as store_gone:
            seen = f"unavailable ({type(store_gone).__name__}: {store_gone})"
        logger.error(
            "rank {}: giving up: {} (last fault as each rank saw it: {})", self.session.rank, refusal, seen
        )
        # every rank reaches the same verdict from the same agreed faults, some later than
        # others: the store's host must not leave while a slower peer still posts its fault
        self._depart(gen)
        raise refusal

    # -- agree ----------------------------------------------------------------------------------
    def _agree(self, left: Left, lap: Laps) -> Agreed:
        """Saves in flight settled, this rank's offer posted, and the plan every rank reads alike."""
        s, gen = self.session, left.generation
        s.at_point("agree", left.step)
        persist = self.keeper.persist
        if persist is not None:
            # a write still in flight would make this rank alone wait at its next save, a wait its
            # peers see as a hang: finish it here, where the recovery barrier holds them
            self.hard_timer.arm(s.cfg.checkpoint.commit_timeout_s + self.t.barrier + 10.0)
            persist.settle(gen, left.step, fault=(left.primary.rank, left.primary.step))
            lap("saves_s")
        self.restorer.settle()
        if self.replacing is None:
            offer = self.restorer.offer(left.primary.kind)
        else:  # (its predecessor's capture, for the survivors' live state: handover.py)
            offer = self.restorer.replacement_offer(self.replacing, s.launch.predecessor_pid)
        lap("verify_s")
        layout = self.restorer.layout_digest()
        held = self.restorer.offered_steps(self.keeper.held_steps(), joining=self.replacing is not None)
        failed: SetupFailed | StateRestoreError | None = None
        try:
            plan = self.coord.recovery_barrier(gen, held, layout, live=offer)
            restore = plan.restore_step(left.primary)
        except (SetupFailed, StateRestoreError) as e:
            failed = e
        if failed is not None:  # (raised outside the handler: the user's exception keeps its own chain)
            self._depart(gen)
            out = decision.failed_agreement(failed, left.exc, s.rank, s.launch.under_launcher)
            if out is left.exc:
                s.events.emit(Event.RUN_FAILED, generation=gen, step=left.step, error=str(failed))
            raise out
        lap("barrier_s")
        return Agreed(plan, restore, layout)

    # -- prepare --------------------------------------------------------------------------------
    def _prepare(self, left: Left, terms: Agreed, lap: Laps) -> PendingRestore:
        s, gen, step = self.session, left.generation, left.step
        plan, restore = terms.plan, terms.step
        persist = self.keeper.persist
        if persist is not None:
            # every rank settled its saves before that agreement, and none saves again before
            # the barrier in Restorer.prepare: rank 0 clears what did not commit in between
            persist.forget_unfinished(gen, step)
            persist.rebase(restore)  # (a rank the fault interrupted before its save must not differ)
            lap("saves_s")
        # (DDP's layouts were agreed in the same barrier; another agreement only if they changed)
        same = agreed(terms.layout, plan.layout_same, self.coord.same)
        cpu0 = time.thread_time()
        pending = loaded_everywhere(
            lambda: self.restorer.prepare(gen, restore, step, left.fault_ts, same, plan, left.primary.since),
            plan,
            lambda ok: self.coord.agree(gen, "buddy_loaded", "1" if ok else "0", "all") == "1",
            lambda e: decision.failed_agreement(e, left.exc, s.rank, s.launch.under_launcher),
        )
        lap("prepare_s")  # (last: the phases put it in the restore, docs/recovery.md#phases)
        parts: dict[str, Any] = {
            "fault_step": step,
            "duration_s": lap.total(),
            **lap.laps,
            **self.restorer.parts,
            "source": pending.source,
        }
        if plan.live_refused is not None:  # (why not the step in flight: docs/recovery.md#live-resume)
            parts["live_refused"] = plan.live_refused
        cpu = time.thread_time()  # (this thread's CPU time: the phases' cost, apart from waiting)
        s.events.emit(
            Event.RESTORE_AGREED, generation=gen, step=restore, cpu_s=cpu, prepare_cpu_s=cpu - cpu0, **parts
        )
        return pending

    def _agree_restore_step(self, gen: int) -> int:
        """(A preemption's) the newest step every rank holds."""
        return self.coord.recovery_barrier(gen, self.keeper.held_steps()).snapshot_step()

    def _attribute(self, gen: int) -> None:
        """Replicas differed: every rank's digests of its last windows, exchanged, name the
        corrupt one where a majority can (detectors/replicas.py); one named twice exits."""
        sdc = self.sdc
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
            self.sleep(self.t.barrier)  # (a bound: the agent's SIGKILL ends the wait)
            raise

    def check_health(self, gen: int, step: int | None) -> None:
        node = self.coord.node  # the store this rank uses: its round trip is timed
        store = node.store if node is not None and not node.leader else self.session.store
        self.session.checkup.run(gen, step, store, self._tell_peers)

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
        s.at_point("join", None)
        await_predecessor(s.launch.predecessor_pid, s.rank, self.t.barrier)
        self.keeper.adopt_predecessor()
        self.replacing = gen
        try:
            return self.recover(StepInterrupted(f"peer: rank {s.rank} replaced, joins generation {gen}"))
        finally:
            self.replacing = None

    def _preempt(self, gen: int, primary: FaultRecord) -> None:
        """Every rank left its step: save the newest state all ranks hold, then exit for requeue.
        Ranks may have seen the signal at different steps: once every rank arrived here, each has
        posted every collective count it ever will, so the snapshot kept where this rank stopped
        is verified or dropped for good before the ranks agree on the step to save."""
        self.coord.agree(gen, "preempt", "1", "all")
        self.restorer.settle()
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
        if gen in self._departed:  # (once: a second arrival would release the host early)
            return
        self._departed.add(gen)
        with contextlib.suppress(Exception):
            self.coord.depart(gen, self.session.launch.endpoint.hosts_store)


def await_predecessor(pid: int | None, rank: int, timeout: float) -> None:
    """On a machine with GPUs, the dead worker a replacement takes the place of may still be
    freeing its device memory (its agent SIGKILLed it just before starting this one): the restore
    waits for its exit. Elsewhere nothing it held is needed again."""
    if pid is None or not torch.cuda.is_available():
        return
    t0 = time.monotonic()
    if not wait_exited(pid, timeout):
        logger.warning(f"rank {rank}: predecessor pid {pid} still alive after {timeout:g} s")
        return
    logger.debug("rank {}: predecessor {} gone after {:.3f} s", rank, pid, time.monotonic() - t0)


def loaded_everywhere(
    prepare: Callable[[], PendingRestore],
    plan: RestorePlan,
    vote: Callable[[bool], bool],
    fall_back: Callable[[StateRestoreError], BaseException],
) -> PendingRestore:
    """``prepare()``; where the plan has new ranks read buddy copies (which only they check),
    every rank then learns whether each did: one that did not load makes every rank fall back
    together (``fall_back``: under ``resilient launch``, the group's restart from the checkpoint),
    not the new rank alone while its survivors wait for it in the next generation."""
    if not plan.ring_buddies:
        return prepare()
    try:
        pending = prepare()
    except StateRestoreError as e:
        vote(False)
        raise fall_back(e) from e
    if not vote(True):
        raise fall_back(StateRestoreError("a new rank's buddy copy did not load (its log says why)"))
    return pending


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
