"""The step loop: what ``ctx.track``, ``ctx.steps`` and ``ctx.epochs`` do, the same under both
engines.

Each step begins (the heartbeat, the hooks, the collective count's window) and completes (the
liveness signal, the collective check where state is kept, the in-memory snapshot when the
schedule says so, the events). The state of the generation being run is a
:class:`~resilient.runtime.run.generation.Generation`; what outlives generations (the snapshot ring,
the cost) is here.

The engines differ in a step at one seam, a :class:`Keeper`: where the state goes besides the
ring, and how a process's first entry starts (the built-in engine resumes what a previous process
left in shared memory, a peer or a checkpoint, and mirrors snapshots there; ``engine: nvrx``
keeps the ring alone, :class:`RingOnly`). The engine's liveness signal (re-arming the built-in
engine's hard-hang timer, pinging NVRx's progress watchdog) is ``liveness``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

from resilient.detectors import Detectors
from resilient.detectors.collectives import (
    CollectiveCheck,
    NodeLinkHolder,
    PeerWait,
    issued_on_default_group,
)
from resilient.detectors.guard import StepGuard
from resilient.detectors.replicas import ReplicaCheck
from resilient.errors import ResilienceError
from resilient.events import Event
from resilient.runtime.coordination.pg import GroupOwner
from resilient.runtime.hooks import Tracked
from resilient.runtime.keeping.buckets import AllSame, DdpBuckets
from resilient.runtime.run.generation import EpochPosition, Generation, PendingRestore
from resilient.runtime.run.session import Session
from resilient.runtime.steps.cost import Cost
from resilient.runtime.steps.detector_run import DetectorRun
from resilient.runtime.steps.handover import Handover
from resilient.runtime.steps.keeper import Keeper
from resilient.runtime.steps.live import LiveResume
from resilient.runtime.steps.replay import ReplayCheck
from resilient.runtime.steps.untracked_watch import UntrackedWatch
from resilient.runtime.steps.verdicts import Verdicts
from resilient.state import SnapshotRing
from resilient.state.carry import CARRY, Carried
from resilient.state.digest import Leaf
from resilient.state.loader import batches_consumed, finish_pass
from resilient.state.registry import EPOCHS, RNG


class StepLoop:
    """``ctx``'s runtime side (see the module docstring). ``count_via``: the coordinator whose
    node link the collective count posts through, if any. The detectors of the registry
    (``resilient.detectors``) are built here, one set per run, and their hooks called at the
    loop's fixed points; the collective count and the replica digests, which verify what is kept,
    are reached by their class where state is kept."""

    def __init__(
        self,
        session: Session,
        keeper: Keeper,
        ring: SnapshotRing,
        *,
        liveness: Callable[[int], None] = lambda step: None,
        count_via: NodeLinkHolder | None = None,
        live: bool = False,
        groups: GroupOwner,
    ) -> None:
        self.session = session
        self.groups = groups  # (the generation's group: built here, aborted and ended by others through it)
        self.keeper = keeper
        self.ring = ring
        self.liveness = liveness
        self.count_via = count_via
        self.buckets = DdpBuckets(session.run_dir)
        self.prepare_parts: dict[str, float] = {}  # the last prepare_restore's parts
        self.gen = Generation(0, None, None, session.clock())  # (none built yet)
        self.step: int | None = None  # the step being run; across generations, the one a fault hit
        self.began_at: dict[int, float] = {}  # when each recent step began (its first run)
        self.cost = Cost(session)
        run = DetectorRun(session, lambda: self.step, lambda: self.gen.batch())
        self.detectors = Detectors.build(session.detectors, session.cfg, run)
        guard = self.detectors.get(StepGuard)  # (ctx.observe reports to it)
        self.guard = guard if guard is not None else StepGuard.build(StepGuard.section_of(None), run)
        self.sdc = self.detectors.get(ReplicaCheck)
        self.collectives = self.detectors.get(CollectiveCheck)
        self.verdicts = Verdicts(ring, self.sdc, session.rank)
        snap = session.cfg.snapshot  # (``live``: the engine resumes a soft fault from the live state)
        emit, joining = session.events.emit, session.launch.join_generation is not None
        self.untracked = UntrackedWatch(session.rank, emit, enabled=not joining)  # (its predecessor's did)
        self.replay = ReplayCheck(session.cfg.verify_replay, emit, suspects=self.untracked.causes)
        self.live = LiveResume(live and snap.live, snap.live_max_bytes, capture=self.replay.enabled)
        self.handover = Handover(session.rank)  # (across a hard fault: the engine's, handover.py)
        self._job_start: bool | None = None

    # -- what Context reads (its identity is the session's) -------------------------------------
    @property
    def restored_step(self) -> int | None:
        return self.gen.restored_step

    @property
    def job_start(self) -> bool:
        """This entry begins the job: the process's first, neither a replacement nor a process
        that finds state to resume (decided once, before anything is tracked)."""
        if self._job_start is None:
            s = self.session
            first = s.generation == 0 and self.step is None and s.launch.join_generation is None
            self._job_start = first and not self.keeper.resumable()
        return self._job_start and self.session.generation == 0 and self.step is None

    # -- a generation ------------------------------------------------------------------------------------
    def start(self, *, joining: bool) -> None:
        """Before the first generation: DDP's layouts from a previous process (agreed at start
        unless this process replaces one rank: ``joining``), then the hooks' ``on_start``."""
        self.buckets.load()
        self.detectors.each(lambda d: d.install())
        if not joining:
            t = self.session.t
            self.buckets.agree_at_start(self.session.all_hold, t.startup + t.barrier)
        self.session.start_hooks()

    def begin_generation(self, number: int, restore: PendingRestore | None) -> Generation:
        """Build generation ``number``'s group; the function's next entry tracks its objects
        afresh (and loads ``restore`` into them). A group that fails to build changes nothing."""
        s = self.session
        self.groups.build(number)
        if s.heartbeat is not None:  # the generation a replacement for this rank would join
            s.heartbeat.generation = number
        count = None
        if self.collectives is not None:  # (the digests ride the count's posts)
            count = self.collectives.window(
                s.store,
                f"{s.ns}/g{number}/fp",
                s.rank,
                s.world_size,
                self.count_via,
                digests=self.sdc is not None,
            )
        if count is not None:
            count.on_wait_end = self._peer_wait_ended
        self.gen = Generation(number, count, restore, s.clock())
        self.detectors.each(lambda d: d.generation(number))  # (the failed generation's objects go)
        self.live.generation()
        self.replay.generation()
        return self.gen

    def _peer_wait_ended(self, wait: PeerWait, waited_s: float) -> None:
        """A step check's wait that the monitor reported (``peer_wait``) is over."""
        s = self.session
        s.events.emit(
            Event.PEER_WAIT,
            generation=s.generation,
            step=self.step,
            peer=wait.peer,
            key=wait.key,
            waited_s=round(waited_s, 4),
            ended=True,
            reads=wait.reads,
            slowest_request_s=round(wait.slowest_s, 4),
        )

    def layout_digest(self) -> str:
        """DDP's bucket layouts as the generation that ended left them (offered at the recovery
        barrier, whose verdict :meth:`prepare_restore` applies)."""
        return self.buckets.ended(self.gen.registry.objects())

    def live_offer(self, symptom: str | None) -> dict[str, Any]:
        """The step this rank can resume at from its live state, or why it cannot (live.py)."""
        return self.handover.vouch(self.live.offer(symptom, self.gen.registry), symptom, self.gen.registry)

    def prepare_restore(
        self,
        generation: int,
        step: int,
        fault_step: int | None,
        fault_ts: float | None,
        all_same: AllSame,
        live: bool = False,
        donors: dict[str, int] | None = None,
        since: int | None = None,
    ) -> PendingRestore:
        """The agreed ``step``'s state (``live``: the live objects' at the step every rank vouched
        for, ``donors``' for a replacement, else its snapshot), to be loaded into each object as
        the function tracks it in the next generation (``generation``: the one that ended)."""
        t0 = time.monotonic()
        self.buckets.at_recovery(
            self.gen.registry.objects(), generation, step, all_same, self.session.t.barrier
        )
        t1 = time.monotonic()
        donors, send_to, rank = donors or {}, [], self.session.rank
        if live and str(rank) in donors:  # (a replacement: handover.py)
            state, owned, source = self.handover.replacement_state(donors[str(rank)]), True, "peer"
        elif live:
            state, owned, source = self.live.state(self.gen.registry), True, "live"
            send_to = sorted(int(r) for r, q in donors.items() if q == rank)
        else:
            state, owned = self.keeper.materialize(step)
            source = "ring" if owned else "shm"
        t2 = time.monotonic()
        self.ring.drop_after(step)
        self.keeper.drop_after(step)
        # (the restore phase's parts, in the restore_agreed event: docs/recovery.md#phases)
        self.prepare_parts = {"layouts_s": t1 - t0, "materialize_s": t2 - t1, "drop_s": time.monotonic() - t2}
        return PendingRestore(
            step, state, owned, fault_step, fault_ts, source=source, send_to=send_to, since=since
        )

    def close(self) -> None:
        self.detectors.uninstall()
        self.buckets.release()
        self.groups.close()

    # -- what Context calls -------------------------------------------------------------------------------
    def track(self, objects: dict[str, Any]) -> None:
        gen = self.gen
        for name, obj in objects.items():
            gen.registry.add(name, obj)
            for d in self.detectors.all:
                d.tracked(name, obj)
            self.live.tracked(name, obj)  # (after the detectors: see live.py)
            if gen.restore is not None:  # (a handover's transfer is two ranks' alone: uncounted)
                with gen.count.uncounted() if gen.count is not None else contextlib.nullcontext():
                    gen.restore.load(gen.registry, name, obj, self.handover.value)

    def carry(self, carried: Carried) -> None:
        """``ctx.carry``: tracked under its own name, once per entry."""
        if CARRY in self.gen.registry:
            raise ResilienceError(
                f"ctx.carry() was called twice in this entry, or {CARRY!r} is tracked already: "
                "carry every value in one call (fields can be added later as attributes)"
            )
        self.track({CARRY: carried})

    def observe(self, loss: Any) -> None:
        """``ctx.observe(loss=...)``: held to the guard's rules before the step is applied."""
        self.guard.observe_loss(loss)

    def epochs(self, total: int) -> Iterator[int]:
        """Epoch numbers up to ``total``, resuming at the epoch of the restored step. Begins the
        run (a relaunched worker restores here), so an epoch loop's body sees its state."""
        progress = EpochPosition()
        self.track({EPOCHS: progress})
        self.gen.epochs = progress
        self._ensure_begun()
        if progress.done:  # restored at an epoch's end: the tracked loaders' next pass is a new one
            for obj in self.gen.registry.objects():
                finish_pass(obj)
        for epoch in range(progress.epoch + progress.done, total):
            progress.epoch, progress.done = epoch, False
            yield epoch
            last, self.gen.deferred = self.gen.deferred, None
            if last is not None:  # the epoch's own code ran: its last step is complete now
                progress.done = True
                self._complete(last, None)
        progress.epoch, progress.done = total, False

    def steps_over(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Each item of ``batches`` is one step; the step count runs on across calls (epochs)."""
        step = self._ensure_begun()
        n = len(batches) if isinstance(batches, Sized) else None  # (a DataLoader: batches per pass)
        for i, item in enumerate(batches):
            self._step_begins(step)
            yield item
            done = batches_consumed(batches)  # (a tracked loader counts skipped batches too)
            if self.gen.epochs is not None and n is not None and (i + 1 if done is None else done) >= n:
                # an epoch's last batch: its step completes (and may be kept) once the code after
                # the batch loop ran too (ctx.epochs resumes), so that code is never lost to a
                # restore nor run twice
                self.gen.deferred = step
            else:
                self._complete(step, None)
            step += 1
            self.gen.next_step = step

    def begin_step(self) -> int:
        """A step of a loop that is not ``ctx.steps`` begins (a trainer's callback, at each
        optimizer step's start): its index, counted on from the restored step. The first call of
        a generation begins the run, as ``ctx.steps`` does (a relaunched worker restores here)."""
        gen = self.gen
        if gen.open_step is not None:
            raise ResilienceError(f"ctx.begin_step(): step {gen.open_step} was begun and not ended")
        step = self._ensure_begun()
        self._step_begins(step)
        gen.open_step = step
        return step

    def end_step(self) -> None:
        """The step :meth:`begin_step` began is complete (its optimizer step applied): the
        progress signal, the checks, and the snapshot where the schedule says so."""
        gen = self.gen
        step, gen.open_step = gen.open_step, None
        if step is None:
            raise ResilienceError("ctx.end_step(): no step was begun (call ctx.begin_step() first)")
        gen.next_step = step + 1
        self._complete(step, None)

    def steps(self, total: int) -> Iterator[int]:
        start = self._begin_steps(total)
        for step in range(start, total):
            self._step_begins(step)
            yield step
            self._complete(step, total)

    # -- a step ------------------------------------------------------------------------------------------
    def _ensure_begun(self) -> int:
        """The next step to run; the first call of a generation begins it (restore or step 0)."""
        gen = self.gen
        if not gen.begun:
            gen.next_step = self._begin_steps(None)
            gen.begun = True
        return gen.next_step

    def _begin_steps(self, total: int | None) -> int:
        self.buckets.release()  # (every tracked DDP is built by now)
        gen = self.gen
        loaded = None
        if gen.restore is None:
            fresh = self.session.generation == 0 and self.step is None
            start, restored = self.keeper.first_step(gen, total, fresh)
            self.handover.started(start)
            if restored:
                gen.restored_step = start
        else:
            loaded = gen.restore.state
            start = self._resume_restored(gen.restore)
        self._capture_live(start, False, loaded)
        return start

    def _capture_live(self, step: int, accumulating: bool, loaded: dict[str, Any] | None = None) -> None:
        counts = self.collectives is not None and self.collectives.counts
        seq = issued_on_default_group() if counts else -1
        registry = self.gen.registry
        self.live.capture(step, registry, accumulating, seq, loaded)
        self.handover.captured(self.live, self.session.generation)
        if self.replay.enabled:
            objects = dict(zip(registry.names(), registry.objects(), strict=True))
            self.replay.at_start(step, self.live.cap, objects, self.live)

    def _resume_restored(self, r: PendingRestore) -> int:
        """At ``ctx.steps`` after a restart: every object of the snapshot was tracked again and
        loaded; the RNGs are restored last, and the step to resume at is returned."""
        r.finish()
        self.detectors.each(lambda d: d.restored(r.step))
        self.session.events.emit(
            Event.STATE_RESTORED,
            generation=self.session.generation,
            step=r.step,
            snapshot_interval=self.session.schedule.interval,
            **r.described(self.began_at.get(r.step)),
        )
        self.replay.restored(r.step, r.fault_step, r.source, self.session.generation, since=r.since)
        self.gen.restore = None
        self.step = r.step
        return r.step

    def _step_begins(self, step: int) -> None:
        self.step = step
        self.began_at[step] = time.time()
        if len(self.began_at) > 4096:  # (beyond any snapshot interval a restore goes back)
            del self.began_at[next(iter(self.began_at))]
        gen, hooks = self.gen, self.session.hooks
        gen.registry.step_begins()
        if self.session.heartbeat is not None:  # the step a hard fault hits, exactly, for the agent
            self.session.heartbeat.beat(step)
        if self.untracked.active:  # (the caller: the steps generator, whose caller is the function)
            self.untracked.at_start(sys._getframe(1), gen, step)
        if gen.count is not None:
            gen.count.begin(step)
        if hooks:
            objects = Tracked(gen.registry.objects(), gen.registry.names())
            for h in hooks:
                h.before_step(step, objects)

    def _complete(self, step: int, total: int | None) -> None:
        s, gen = self.session, self.gen
        now = s.clock()
        step_s = now - gen.progress if gen.stepped else None
        gen.progress, gen.stepped = now, True
        nxt = step + 1
        if nxt != total:
            # the next step's start, captured (and mirrored) before anything else: a rank that
            # dies from here on left the state a replacement resumes at (handover.py)
            self._capture_live(nxt, gen.registry.accumulating())
        self.liveness(step)
        try:
            for d in self.detectors.all:
                d.step_done(step)
        except Exception as e:  # a detector refused the step that ended: its successor is no start
            self.live.withdraw(f"step {step}'s end was refused ({type(e).__name__})")
            self.handover.captured(self.live, self.session.generation)
            raise
        capture_s = None
        state: dict[str, Any] | None = None
        sums: dict[str, Leaf] | None = None
        count, sdc = gen.count, self.sdc
        if count is not None and count.pending is not None:  # the last kept snapshot, verified now
            self.verdicts.settle(count, False)
        leaves = self.keeper.due(nxt, total) or nxt == total  # (the last: returned to the caller)
        ring_due = s.schedule.due(nxt, total)
        if self.keeper.stopping():
            # kept in the ring, its count posted but not awaited: a peer that saw the signal a
            # step later waits in the next step's collectives, not here; the recovery that the
            # stop starts verifies the count once every rank arrived (Recovery._preempt)
            ring_due, leaves = True, False
        digest_due = sdc is not None and count is not None and sdc.due(nxt)
        if ring_due or leaves or digest_due:
            state = gen.registry.capture()
            digests = None
            if sdc is not None and count is not None:  # the replicated state's digests, with the count
                objects = dict(zip(gen.registry.names(), gen.registry.objects(), strict=True))
                digests, sums = sdc.digests(step, state, objects)
            if count is not None:  # every rank issued the same collectives, or nothing is kept
                if count.pending is not None:  # (a window still open from a step that kept no state)
                    self.verdicts.settle(count, True)
                # state that leaves the process is verified first; the ring's, at the next step
                count.close_window(step, digests)
                if leaves:
                    self.verdicts.settle(count, True)
            self.buckets.observe(gen.registry.objects())
            if ring_due:
                self.ring.capture(nxt, state, sums)
                capture_s = s.clock() - now
                self.replay.snapshot_at(nxt, min(self.ring.steps(), default=None))
        s.schedule.observe(nxt, step_s, capture_s)
        if s.cfg.events.steps:
            s.events.emit(Event.STEP_COMPLETED, generation=s.generation, step=step, step_s=step_s, log=False)
        for h in s.hooks:
            h.after_step(s.generation, step, step_s)
        self.keeper.keep(gen, nxt, total, state, step_s, sums)
        self.live.leave_if_asked(gen.number)
        self.cost.add(step, now, s.clock() - now, capture_s is not None)
        if gen.resume_pending:
            gen.resume_pending = False
            s.events.emit(
                Event.STEP_RESUMED,
                generation=s.generation,
                step=step,
                since_fault_s=time.time() - (gen.fault_ts or time.time()),
                cpu_s=time.thread_time(),
            )

    # -- the collective check's verdicts (verdicts.py) -------------------------------------------------
    def settle_at_end(self) -> None:
        """The function returned (perhaps leaving ``ctx.steps`` early): no unverified state may
        stand as its result."""
        count = self.gen.count
        if count is not None and count.pending is not None:
            self.verdicts.settle(count, True)

    def settle_before_restore(self) -> None:
        self.verdicts.before_restore(self.gen.count)

    # -- the end -----------------------------------------------------------------------------------------
    def finished(self, **detail: Any) -> None:
        """Every rank returned: the hooks see the final state, then ``run_finished``."""
        s, registry = self.session, self.gen.registry
        for h in s.hooks:
            h.on_finish(lambda: {k: v for k, v in registry.capture().items() if k != RNG})
        s.events.emit(
            Event.RUN_FINISHED,
            generation=s.generation,
            step=self.step,
            steps_completed=self.cost.steps,
            snapshots=self.cost.snapshots,
            snapshot_interval=s.schedule.interval,
            runtime_ms_per_step=self.cost.ms_per_step,
            engine=s.engine,
            **detail,
        )
