"""The in-process restart engine: one per process, owning the store, the group and the state.

Lifecycle per generation g (states are :class:`Phase`; transitions in brackets):

    STARTING → [group built on g] → RUNNING → (fn returns) → FINISHING → [all done] → CLOSED
                                       │                         │ (a peer faulted)
                                       └──── fault ──→ RECOVERING ←┘
    RECOVERING: post fault → abort group → policy → health → barrier → agree restore step → g+1 → RUNNING

:class:`BuiltinEngine` is configured with a :class:`~resilient.runtime.run.wiring.Setup`; each run
builds its collaborators from the wiring (:func:`collaborators`, the one factory) and a
:class:`BuiltinRun` composes its parts from them: the step loop
(:class:`~resilient.runtime.steps.loop.StepLoop`), the keeper of snapshots beyond the ring
(:class:`~resilient.runtime.keeping.builtin_keeper.BuiltinKeeper`), fault detection
(:class:`~resilient.runtime.leave.notice.Detection`) and what a recovery does between two generations
(:class:`~resilient.runtime.recovery.recovery.Recovery`, with the restart policy).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from resilient.checkpoint import flushed
from resilient.checkpoint.shm import ShmSnapshot
from resilient.contract import agent_stopping, die_with_launcher, mark_replace
from resilient.detectors.straggler_watch import Place, StragglerWatch
from resilient.detectors.stragglers import Stragglers
from resilient.errors import (
    CoordinationError,
    HardFault,
    Preempted,
    ResilienceError,
    SoftFault,
    StepInterrupted,
)
from resilient.events import Event
from resilient.launch_env import local_address
from resilient.runtime.coordination import coordinator as coord_mod
from resilient.runtime.coordination import node as node_mod
from resilient.runtime.coordination.pg import GroupOwner, group_paths
from resilient.runtime.engine.warmup import first_use_imports
from resilient.runtime.keeping import resume
from resilient.runtime.keeping.buddy import Buddy, buddy_of
from resilient.runtime.keeping.builtin_keeper import BuiltinKeeper, ring_share
from resilient.runtime.keeping.durable import Persistence
from resilient.runtime.leave.notice import Detection
from resilient.runtime.leave.watchdog import HardHangTimer
from resilient.runtime.recovery.policy import RestartPolicy
from resilient.runtime.recovery.recovery import Recovery
from resilient.runtime.run.generation import PendingRestore
from resilient.runtime.run.session import Session
from resilient.runtime.run.wiring import Setup, Wiring, WiringFactory, wire
from resilient.runtime.steps.handover import Handover
from resilient.runtime.steps.loop import StepLoop
from resilient.runtime.steps.mirror import LiveMirror
from resilient.state import SnapshotRing


class Phase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    CLOSED = "closed"


@dataclass
class Collaborators:
    """What a built-in run reaches outside its process besides the session's wiring: the store
    protocol, a connection per background thread, durable checkpoints, the shared-memory mirror
    and the store copy (the last three where configured / under ``resilient launch``)."""

    session: Session
    coord: coord_mod.Coordinator
    monitor_store: dist.Store
    listener_store: dist.Store
    persist: Persistence | None
    shm: ShmSnapshot | None
    store_copy: resume.StoreCopy | None
    buddy: Buddy | None = None  # (snapshot.buddy, more than one node)
    straggler_store: dist.Store | None = None  # the straggler watch's connection (straggler.enabled)


def collaborators(setup: Setup, wiring: Wiring) -> Collaborators:
    """The one factory of the built-in engine's collaborators (connections made, nothing started)."""
    launch, cfg, t = setup.launch, setup.cfg, setup.cfg.timeouts
    session = Session(setup, wiring, engine=BuiltinEngine.name, ring_share=ring_share(launch))
    ep = launch.endpoint
    stragglers = Stragglers.wanted(Stragglers.section_of(cfg), ep.world_size)
    blocks, _ = node_mod.node_mode(cfg.node_aggregation, ep.world_size, ep.local_world_size)
    coord = coord_mod.Coordinator(session.store, session.ns, ep.rank, ep.world_size, t.barrier, blocks=blocks)
    persist = None
    if cfg.checkpoint.dir is not None:
        persist = Persistence(
            cfg.checkpoint,
            rank=ep.rank,
            world_size=ep.world_size,
            token=f"{session.run_id}-a{launch.attempt}",
            events=session.events,
            exchange=lambda name, payload: coord.exchange(session.generation, name, payload),
            agree=lambda name, payload, how: coord.agree(session.generation, name, payload, how),
            signals=launch.preempt_signals,
            agent_stopping=(
                (lambda: agent_stopping(launch.heartbeat_dir)) if launch.heartbeat_dir is not None else None
            ),
        )
    shm = store_copy = None
    if launch.shm_name is not None:  # `resilient launch` keeps it across relaunches
        # keyed by the local rank: a relaunched worker finds its predecessor's snapshot even when
        # the rendezvous renumbered the nodes (each snapshot records the global rank that wrote it)
        shm = ShmSnapshot(launch.shm_name, ep.local_rank)
        if cfg.checkpoint.flush_on_death and cfg.checkpoint.dir is not None:
            flushed.offer(shm, flushed.root(cfg.checkpoint.dir))  # (its agent flushes it if it dies)
        store_copy = resume.StoreCopy(
            session.store,
            f"resilient/{session.run_id}/store_copy",
            ep.rank,
            cfg.snapshot.store_copy_max_bytes,
        )
    return Collaborators(
        session=session,
        coord=coord,
        monitor_store=wiring.side_store(t.barrier),
        listener_store=wiring.side_store(coord_mod.FOREVER),
        persist=persist,
        shm=shm,
        store_copy=store_copy,
        buddy=_buddy(setup, wiring, session, shm, store_copy),
        straggler_store=wiring.side_store(t.barrier) if stragglers else None,
    )


def _buddy(
    setup: Setup, wiring: Wiring, session: Session, shm: ShmSnapshot | None, copy: resume.StoreCopy | None
) -> Buddy | None:
    """This rank's buddy copy (keeping/buddy.py): under ``resilient launch`` with the store copy
    on, ``snapshot.buddy``, and more than one node."""
    ep, snap = setup.launch.endpoint, setup.cfg.snapshot
    if shm is None or copy is None or copy.max_bytes <= 0 or not snap.buddy:
        return None
    if buddy_of(ep.rank, ep.world_size, ep.local_world_size) is None:
        return None
    side = wiring.side_store(setup.cfg.timeouts.barrier)  # (the sender thread's own connection)
    copies = resume.StoreCopy(side, copy.prefix, ep.rank, copy.max_bytes)
    host = local_address((ep.host, ep.port))
    return Buddy(shm, ep.rank, ep.world_size, ep.local_world_size, side, session.run_id, copies, host)


def _straggler_watch(c: Collaborators, detector: Stragglers | None) -> StragglerWatch | None:
    """This rank's straggler watch on its detector's meter (straggler.enabled, more than one
    rank), not started."""
    s = c.session
    if c.straggler_store is None or detector is None:
        return None
    ep, beats = s.launch.endpoint, s.launch.heartbeat_dir

    def emit(event: Event, **fields: Any) -> None:
        s.events.emit(event, generation=s.generation, step=None, **fields)

    return StragglerWatch(
        detector.cfg,
        Place(ep.rank, ep.local_rank, ep.local_world_size, s.ns),
        detector.meter,
        c.straggler_store,
        emit,
        settings=s.run_dir / "straggler.yaml",
        mark=None if beats is None else lambda local_rank, detail: mark_replace(beats, local_rank, detail),
    )


def freeze_gc() -> None:
    """Everything alive now (torch's ~180k import-time objects, and the ~120k of what its first
    model and optimizer step import lazily, imported here first) leaves the collector's view: the
    full collection after a fault, which frees the failed generation's model, optimizer state and
    group before the new ones are built, then scans only what the training function created.
    Refcounting still frees frozen objects; only cycles among them are kept. A parked standby
    does it before it waits (the first collection of a process pays for every object alive)."""
    first_use_imports()
    gc.collect()
    gc.freeze()


class BuiltinEngine:
    """The built-in engine behind :func:`resilient.wrap`: ``run(fn)`` calls ``fn(loop)`` once per
    generation until it returns on every rank (or the run gives up, typed)."""

    name = "resilient"

    def __init__(self, setup: Setup, *, wiring: WiringFactory = wire) -> None:
        self.setup = setup
        self._wire = wiring

    def run(self, fn: Callable[[StepLoop], Any]) -> Any:
        if self.setup.cfg.freeze_gc:
            freeze_gc()
        # first: a launcher killed while this worker connects (or stopped before it got further)
        # must still take the worker with it
        die_with_launcher(self.setup.launch.launcher_pid)
        w = self._wire(self.setup)
        with contextlib.ExitStack() as undo:  # (the event log is closed if the rest cannot be built)
            undo.callback(w.events.close)
            parts = collaborators(self.setup, w)
            undo.pop_all()
        try:
            return BuiltinRun(parts).run(fn)
        finally:
            # the run is over: what was frozen is the collector's again, so that the process's
            # exit frees it (native libraries that count their live objects at exit, as
            # triton's nanobind bindings in torch 2.15's CUDA build do, otherwise report leaks)
            gc.unfreeze()


class BuiltinRun:
    """One run of the function in this process: its generations and the recoveries between them
    (the state machine of the module docstring). Not thread-safe except where detection needs it."""

    def __init__(self, c: Collaborators, policy: RestartPolicy | None = None) -> None:
        self.session = s = c.session
        self.t = s.t
        self.coord = c.coord
        self.policy = policy or RestartPolicy(s.cfg.restart)
        self.phase = Phase.STARTING
        self.ring = SnapshotRing()
        self.hard_timer = HardHangTimer()
        self.keeper = BuiltinKeeper(
            s,
            self.ring,
            c.coord,
            persist=c.persist,
            shm=c.shm,
            store_copy=c.store_copy,
            arm=self.hard_timer.arm,
            buddy=c.buddy,
        )
        self.groups = GroupOwner(lambda generation: s.wiring.build_group(generation, s.ns))
        handover = None
        if c.shm is not None and c.store_copy is not None and s.world_size > 1:  # (handover.py)
            handover = Handover(s.rank, LiveMirror(c.shm.dir), c.store_copy, c.buddy)
        self.loop = StepLoop(
            s,
            self.keeper,
            self.ring,
            liveness=self._stepped,
            count_via=c.coord,
            live=True,
            groups=self.groups,
            handover=handover,
        )
        self.straggler = _straggler_watch(c, self.loop.detectors.get(Stragglers))
        self.detection = Detection(
            s,
            c.coord,
            self.loop,
            self.groups,
            self.hard_timer,
            running=self._running,
            busy=lambda: self.keeper.in_save,
            monitor_store=c.monitor_store,
            listener_store=c.listener_store,
        )
        self.recovery = Recovery(
            self.loop,
            c.coord,
            self.keeper,
            self.detection,
            self.policy,
            groups=self.groups,
            detectors=self.loop.detectors,
            restorer=self.loop.restorer,
        )
        self.pending: PendingRestore | None = None  # what the next generation restores
        self._cleanup = contextlib.ExitStack()  # what _start() set up, undone in reverse by close()

    # -- setup / teardown -------------------------------------------------------------------------
    def _start(self) -> None:
        s, stack = self.session, self._cleanup
        stack.callback(self._close_session)  # last: the event log closes after everything else
        s.open(lambda: self.loop.step)
        self.loop.start(joining=s.launch.join_generation is not None)
        self._link_node()
        stack.callback(self.coord.leave_node)  # after the listener stopped (callbacks run in reverse)
        if self.keeper.persist is not None:
            self.keeper.persist.install()
            stack.callback(self.keeper.close)
        self.detection.install(stack)
        self.detection.start(stack)
        stack.callback(self.detection.release)
        if self.straggler is not None:
            self.straggler.node = lambda: self.coord.node
            self.straggler.start()
            stack.callback(self.straggler.close)

    def _link_node(self) -> None:
        """Link to this node's store when the job spans nodes (and say why not, in the
        ``node_link`` event, when it could be and is not)."""
        s, ep = self.session, self.session.launch.endpoint
        _, want = node_mod.node_mode(s.cfg.node_aggregation, s.world_size, ep.local_world_size)
        if not want:
            return
        got = node_mod.link(
            s.store,
            f"{s.ns}/node/{s.rank - ep.local_rank}",
            s.rank,
            ep.local_rank,
            ep.local_world_size,
            self.t.barrier,
            coord_mod.FOREVER,
            node=f"{socket.gethostname()}/{s.launch.launcher_pid}",  # (its launcher: its node)
        )
        link = got if isinstance(got, node_mod.NodeLink) else None
        self.coord.node, self.coord.on_lost = link, self._node_lost
        s.events.emit(
            Event.NODE_LINK,
            generation=s.generation,
            step=None,
            linked=link is not None,
            leader=s.rank - ep.local_rank,
            size=ep.local_world_size,
            reason=got if isinstance(got, str) else None,
        )

    def _node_lost(self, reason: str) -> None:
        """(any thread) The node's store went away with its host process: this rank goes on alone."""
        s = self.session
        logger.warning(
            "rank {}: the node's store is gone ({}); the job's store alone from now on", s.rank, reason
        )
        s.events.emit(
            Event.NODE_LINK_LOST,
            generation=s.generation,
            step=self.loop.step,
            leader=s.rank - s.launch.endpoint.local_rank,
            reason=reason,
        )

    def _close_session(self) -> None:
        self.loop.close()
        self.session.close()

    def close(self) -> None:
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        try:  # every step runs (ExitStack); a failing one must not mask the run's own outcome
            self._cleanup.close()
        except Exception as e:
            logger.error("rank {}: at close: {}: {}", self.session.rank, type(e).__name__, e)
        self.detection.monitor_store = self.detection.listener_store = None  # type: ignore[assignment]

    # -- the restart loop -------------------------------------------------------------------------
    def run(self, fn: Callable[[StepLoop], Any]) -> Any:
        s = self.session
        try:
            self._start()
            if s.launch.under_launcher:
                # under `resilient launch` a (re)started worker checks its node before it joins:
                # a node that fails here again and again is excluded by its agent
                self.recovery.check_health(0, None)
            if s.launch.join_generation is not None:
                self.phase = Phase.RECOVERING
                self.pending = self.recovery.join_survivors(s.launch.join_generation)
            while True:
                pulled = self._enter_generation()
                try:
                    done, result, exc = (False, None, pulled) if pulled else self._attempt(fn)
                except StepInterrupted as late:  # an interrupt that raced with the except clause
                    self.phase = Phase.RECOVERING
                    done, result, exc = False, None, late
                if done:
                    persist = self.keeper.persist
                    if persist is not None:
                        persist.close(s.generation, self.loop.step)
                    self.loop.finished(
                        mirror_interval=self.keeper.mirror_schedule.interval if self.keeper.shm else None,
                        monitor_wakeups=self.detection.monitor.wakeups,
                        checkpoint_failures=persist.failures if persist else 0,
                        buddy=self.keeper.buddy.summary() if self.keeper.buddy else None,
                    )
                    return result
                self.pending = self._recover(exc)
                exc = None  # drop the failed generation (see Recovery.recover)
        except Preempted as e:
            s.events.emit(Event.RUN_PREEMPTED, generation=s.generation, step=e.step, error=str(e))
            raise
        except ResilienceError as e:
            s.events.emit(Event.RUN_FAILED, generation=s.generation, step=self.loop.step, error=str(e))
            raise
        finally:
            self.close()

    def _recover(self, exc: BaseException | None) -> PendingRestore:
        try:
            return self.recovery.recover(exc)
        except dist.DistNetworkError as e:  # (every recovery step agrees through the job's store)
            raise HardFault(
                f"rank {self.session.rank}: the job's store is unreachable ({str(e).splitlines()[0]}): the "
                "node that hosts it was lost, or the network to it; in-process recovery needs it"
            ) from e

    def _running(self) -> int | None:
        """The generation whose step may be interrupted now."""
        return self.session.generation if self.phase is Phase.RUNNING else None

    def _stepped(self, step: int) -> None:
        self.hard_timer.arm(self.t.hard)

    def _attempt(self, fn: Callable[[StepLoop], Any]) -> tuple[bool, Any, BaseException | None]:
        gen = self.session.generation
        grad = torch.is_grad_enabled()
        try:
            if gen > 0:
                self.session.at_point("reenter", self.loop.restored_step)
            result = fn(self.loop)
            self.loop.settle_at_end()
        except (Exception, StepInterrupted) as exc:
            self.phase = Phase.RECOVERING  # first: a late interrupt must not fire in recovery code
            # an interrupt that lands between a grad-disabling region's entry and its exit (torch's
            # own, in Python) leaves the thread without autograd; the function re-enters as it began
            torch.set_grad_enabled(grad)
            if isinstance(exc, ResilienceError) and not isinstance(exc, HardFault | SoftFault):
                self.coord.abort_generation(gen, f"{type(exc).__name__}: {exc}")
                raise
            return False, None, exc
        self.phase = Phase.FINISHING
        self.hard_timer.arm(self.t.barrier + 10.0)
        if self.coord.finish_barrier(gen):
            self.hard_timer.disarm()
            self.coord.close_generation(gen)
            return True, result, None
        self.phase = Phase.RECOVERING
        return False, None, None

    def _enter_generation(self) -> StepInterrupted | None:
        """Build this generation's group. ``None``, or the interruption when a peer faulted first."""
        s, gen = self.session, self.session.generation
        self.hard_timer.arm(self.t.startup + self.t.hard)
        t0 = time.time()
        gc_s = 0.0
        if gen > 0:
            gc.collect()  # free the previous generation's group and DDP here, in order, not at exit
            gc_s = time.time() - t0
        t_build, cpu_build = time.time(), time.thread_time()
        try:
            if gen > 0:
                s.at_point("rebuild", self.pending.step if self.pending else None)
            self.loop.begin_generation(gen, self.pending)
        except Exception as e:
            # a peer that faulted right after building its side closes its connections while this
            # rank still connects: that is its fault to recover from, not a failed rendezvous
            with contextlib.suppress(Exception):
                found = self.coord.primary_fault(gen)
                if found is not None:
                    self.phase = Phase.RECOVERING
                    return StepInterrupted(
                        f"peer: rank {found.rank} faulted while the group was built: {found.signature}"
                    )
            raise CoordinationError(
                f"rank {s.rank}: building the process group of generation {gen} failed: {e}"
            ) from e
        self.pending = None
        if gen > 0:
            s.events.emit(
                Event.GROUP_REBUILT,
                generation=gen,
                step=self.loop.restored_step,
                duration_s=time.time() - t0,
                gc_s=gc_s,
                build_s=time.time() - t_build,
                cpu_s=(cpu := time.thread_time()),
                build_cpu_s=cpu - cpu_build,
                abort=(paths := group_paths(self.groups.current))["abort"],
                rebuild=paths["rebuild"],
            )
        self.phase = Phase.RUNNING
        self.detection.watch(gen)
        return None
