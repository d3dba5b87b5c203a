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
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

from resilient.detectors import Detectors
from resilient.detectors.collectives import (
    CollectiveCheck,
    CollectiveCount,
    NodeLinkHolder,
    PeerWait,
    issued_on_default_group,
)
from resilient.detectors.replicas import ReplicaCheck
from resilient.errors import ResilienceError
from resilient.events import Event
from resilient.runtime.coordination.pg import GroupOwner
from resilient.runtime.hooks import Tracked
from resilient.runtime.keeping.buckets import DdpBuckets
from resilient.runtime.run.generation import Generation, PendingRestore
from resilient.runtime.run.session import Session
from resilient.runtime.steps.cost import Cost
from resilient.runtime.steps.detector_run import DetectorRun
from resilient.runtime.steps.forms import StepForms
from resilient.runtime.steps.handover import Handover
from resilient.runtime.steps.keeper import Keeper
from resilient.runtime.steps.kept import StepKeeping
from resilient.runtime.steps.live import LiveResume
from resilient.runtime.steps.replay import ReplayCheck
from resilient.runtime.steps.restore import Restorer
from resilient.runtime.steps.untracked_watch import UntrackedWatch
from resilient.runtime.steps.verdicts import Verdicts
from resilient.state import SnapshotRing
from resilient.state.carry import CARRY, Carried
from resilient.state.registry import RNG


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
        handover: Handover | None = None,
    ) -> None:
        self.session = session
        self.groups = groups  # (the generation's group: built here, aborted and ended by others through it)
        self.keeper = keeper
        self.ring = ring
        self.liveness = liveness
        self.count_via = count_via
        self.buckets = DdpBuckets(session.run_dir)
        self.gen = Generation(0, None, None, session.clock())  # (none built yet)
        self.step: int | None = None  # the step being run; across generations, the one a fault hit
        self.began_at: dict[int, float] = {}  # when each recent step began (its first run)
        self.cost = Cost(session)
        run = DetectorRun(session, lambda: self.step, lambda: self.gen.batch())
        self.detectors = Detectors.build(session.detectors, session.cfg, run)
        self.sdc = self.detectors.get(ReplicaCheck)
        self.collectives = self.detectors.get(CollectiveCheck)
        self.verdicts = Verdicts(ring, self.sdc, session.rank)
        snap = session.cfg.snapshot  # (``live``: the engine resumes a soft fault from the live state)
        emit, joining = session.events.emit, session.launch.join_generation is not None
        self.untracked = UntrackedWatch(session.rank, emit, enabled=not joining)  # (its predecessor's did)
        self.replay = ReplayCheck(session.cfg.verify_replay, emit, suspects=self.untracked.causes)
        self.live = LiveResume(live and snap.live, snap.live_max_bytes, capture=self.replay.enabled)
        # (across a hard fault, under resilient launch: handover.py)
        self.handover = handover if handover is not None else Handover(session.rank)
        self.restorer = Restorer(
            session,
            lambda: self.gen,
            keeper=keeper,
            ring=ring,
            buckets=self.buckets,
            live=self.live,
            handover=self.handover,
            verdicts=self.verdicts,
            detectors=self.detectors,
            replay=self.replay,
        )
        self.keeping = StepKeeping(
            session,
            keeper,
            ring,
            buckets=self.buckets,
            replay=self.replay,
            verdicts=self.verdicts,
            sdc=self.sdc,
        )
        self.forms = StepForms(self)
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
            carry_unverified(self.gen.count, count, restore)
        self.gen = Generation(number, count, restore, s.clock())
        self.detectors.each(lambda d: d.generation(number))  # (the failed generation's objects go)
        self.live.generation()
        self.replay.generation()
        return self.gen

    def _peer_wait_ended(self, wait: PeerWait, waited_s: float) -> None:
        """A step check's wait that the monitor reported (``peer_wait``) is over."""
        s = self.session
        s.events.emit(
            Event.PEER_WAIT, generation=s.generation, step=self.step, ended=True, **wait.fields(waited_s)
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
                if gen.first_at("restore"):
                    self.session.at_point("restore", gen.restore.step)
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
        """``ctx.observe(loss=...)``: every detector sees it before the step is applied."""
        self.detectors.each(lambda d: d.observed(loss))

    def epochs(self, total: int) -> Iterator[int]:
        return self.forms.epochs(total)

    def steps_over(self, batches: Iterable[Any]) -> Iterator[Any]:
        return self.forms.steps_over(batches)

    def begin_step(self) -> int:
        return self.forms.begin_step()

    def end_step(self) -> None:
        self.forms.end_step()

    def steps(self, total: int) -> Iterator[int]:
        return self.forms.steps(total)

    # -- a step ------------------------------------------------------------------------------------------
    def ensure_begun(self) -> int:
        """The next step to run; the first call of a generation begins it (restore or step 0)."""
        gen = self.gen
        if not gen.begun:
            gen.next_step = self.begin_steps(None)
            gen.begun = True
        return gen.next_step

    def begin_steps(self, total: int | None) -> int:
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
        self.restorer.resumed(r, self.began_at.get(r.step))
        self.gen.restore = None
        self.step = r.step
        return r.step

    def step_begins(self, step: int, caller: FrameType | None = None) -> None:
        """``caller``: the frame whose caller runs the steps (the form's generator, by default the
        caller of this), which the untracked-state scan samples."""
        self.step = step
        self.began_at[step] = time.time()
        if len(self.began_at) > 4096:  # (beyond any snapshot interval a restore goes back)
            del self.began_at[next(iter(self.began_at))]
        gen, hooks = self.gen, self.session.hooks
        if gen.number > 0 and gen.first_at("first_step"):
            self.session.at_point("first_step", step)
        gen.registry.step_begins()
        if self.session.heartbeat is not None:  # the step a hard fault hits, exactly, for the agent
            self.session.heartbeat.beat(step)
        if self.untracked.active:  # (the caller: the steps generator, whose caller is the function)
            self.untracked.at_start(caller or sys._getframe(1), gen, step)
        if gen.count is not None:
            gen.count.begin(step)
        if hooks:
            objects = Tracked(gen.registry.objects(), gen.registry.names())
            for h in hooks:
                h.before_step(step, objects)

    def complete(self, step: int, total: int | None) -> None:
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
        kept = self.keeping.at_step_end(gen, step, total, now)
        s.schedule.observe(nxt, step_s, kept.capture_s)
        if s.cfg.events.steps:
            s.events.emit(Event.STEP_COMPLETED, generation=s.generation, step=step, step_s=step_s, log=False)
        for h in s.hooks:
            h.after_step(s.generation, step, step_s)
        self.keeper.keep(gen, nxt, total, kept.state, step_s, kept.sums)
        self.live.leave_if_asked(gen.number)
        self.cost.add(step, now, s.clock() - now, kept.capture_s is not None)
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


def carry_unverified(
    old: CollectiveCount | None, new: CollectiveCount, restore: PendingRestore | None
) -> None:
    """A resume that rolls nothing back (``live``, ``peer``) carries the failed generation's
    unverified steps into the next: its first check window begins where the old one's did."""
    since = old.window_start if old is not None else None
    if (
        restore is not None
        and restore.source in ("live", "peer")
        and since is not None
        and since < restore.step
    ):
        new.carry(since)
