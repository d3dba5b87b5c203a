"""The in-process restart engine: one per process, owning the store, the group and the state.

Lifecycle per generation g (states are :class:`Phase`; transitions in brackets):

    STARTING → [group built on g] → RUNNING → (fn returns) → FINISHING → [all done] → CLOSED
                                       │                         │ (a peer faulted)
                                       └──── fault ──→ RECOVERING ←┘
    RECOVERING: post fault → abort group → policy → health → barrier → agree restore step → g+1 → RUNNING
"""

from __future__ import annotations

import contextlib
import enum
import functools
import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from resilient.checkpoint.shm import ShmSnapshot
from resilient.config import Config
from resilient.errors import (
    CheckpointError,
    CoordinationError,
    HardFault,
    Preempted,
    ResilienceError,
    RestartBudgetExhausted,
    SetupFailed,
    SoftFault,
    StateRestoreError,
    StepInterrupted,
)
from resilient.events import Event
from resilient.launch_env import LaunchEnv
from resilient.runtime import coordinator as coord_mod
from resilient.runtime import node as node_mod
from resilient.runtime import resume
from resilient.runtime.core import EngineCore, Wiring, all_stacks, main_thread_where, plan_step
from resilient.runtime.faults import FaultKind, FaultRecord, Severity
from resilient.runtime.health import Check
from resilient.runtime.hooks import StepHook
from resilient.runtime.persist import Persistence
from resilient.runtime.schedule import SnapshotSchedule
from resilient.runtime.watchdog import FaultListener, HardHangTimer, MainThreadInterrupter, Monitor
from resilient.state.dtensor import live_meshes
from resilient.state.registry import RNG, restore_rng


class Phase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    CLOSED = "closed"


class NativeEngine(EngineCore):
    """The native engine behind :func:`resilient.wrap`. Not thread-safe except where the monitor
    needs it. Collaborators come from ``wiring`` (default: :func:`~resilient.runtime.core.wire`)."""

    engine = "resilient"

    def __init__(
        self,
        cfg: Config,
        checks: Sequence[Check] = (),
        *,
        launch: LaunchEnv | None = None,
        hooks: Sequence[StepHook] = (),
        wiring: Callable[[EngineCore], Wiring] | None = None,
    ) -> None:
        super().__init__(cfg, checks, launch=launch, hooks=hooks, wiring=wiring)
        self.phase = Phase.STARTING
        self._in_save = False
        self._ckpt_due = False  # a durable checkpoint is due after this step (set once a step)
        self._last_nudge = 0.0
        # constructed here without side effects; start() installs and starts them
        self.interrupter = MainThreadInterrupter(cfg.interrupt_signal, self._interruptible)
        self.hard_timer = HardHangTimer()
        self.monitor = Monitor(self, self.t)
        self.listener = FaultListener(self._wait_for_fault, self._on_listened_fault)
        self._remote: dict[int, FaultRecord] = {}
        self._remote_handled: set[int] = set()
        self._remote_lock = threading.Lock()
        self.persist: Persistence | None = None  # durable checkpoints, when checkpoint.dir is set
        self.shm: ShmSnapshot | None = None  # snapshots in /dev/shm, under `resilient launch`
        self.replica: resume.StoreReplica | None = None  # small per-rank state, in the job's store
        self._adoptable: int | None = None  # restored from this rank's own shm snapshot of this step
        self._cleanup = contextlib.ExitStack()  # what start() set up, undone in reverse by close()

    # -- setup / teardown -------------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.freeze_gc:
            # Everything alive now (torch's ~180k import-time objects) leaves the collector's
            # view: the full collection after a fault, which frees the failed generation's model,
            # optimizer state and group before the new ones are built, then scans only what the
            # training function created. Refcounting still frees frozen objects; only cycles
            # among them are kept.
            gc.collect()
            gc.freeze()
        stack = self._cleanup
        stack.callback(self._close_core)  # last: the event log closes after everything else
        w = self._open("")
        self.coord = self._coordinator()
        stack.callback(self.coord.leave_node)  # after the listener stopped (callbacks run in reverse)
        # under `resilient launch` the snapshot is also mirrored where it outlives the process; that
        # copy costs more (shared memory, the store replica) and only a hard fault needs it, so it
        # has its own cadence: the in-memory ring, which every soft fault restores from, is not
        # thinned out by the mirror's cost
        self.mirror_schedule = SnapshotSchedule(
            self.cfg.snapshot, self.rank, self.store, f"{self.ns}/mirror_interval", 1.0 - self._ring_share()
        )
        self.monitor_store = w.side_store(self.t.barrier)
        self.listener_store = w.side_store(coord_mod.FOREVER)
        if self.cfg.checkpoint.dir is not None:
            self.persist = persist = Persistence(
                self.cfg.checkpoint,
                rank=self.rank,
                world_size=self.world_size,
                token=f"{self.run_id}-a{self.launch.attempt}",
                events=self._ev,
                exchange=lambda name, payload: self.coord.exchange(self.generation, name, payload),
                agree=lambda name, payload, how: self.coord.agree(self.generation, name, payload, how),
                signals=self.launch.preempt_signals,
            )
            persist.install()
            stack.callback(self._close_persist, persist)
        self.interrupter.install()
        stack.callback(self.interrupter.uninstall)
        self.hard_timer.install()
        stack.callback(self.hard_timer.uninstall)
        if self.launch.shm_name is not None:  # `resilient launch` keeps it across relaunches
            # keyed by the local rank: a relaunched worker finds its predecessor's snapshot even when
            # the rendezvous renumbered the nodes (each snapshot records the global rank that wrote it)
            self.shm = ShmSnapshot(self.launch.shm_name, self.local_rank)
            self.replica = resume.StoreReplica(
                self.store, f"resilient/{self.run_id}/replica", self.rank, self.cfg.snapshot.replica_max_bytes
            )
        self.monitor.start()
        stack.callback(self.monitor.stop)
        self.listener.start()
        stack.callback(self.listener.stop)
        # Our threads must be finished before the interpreter finalizes: a daemon thread that
        # returns from a store call during finalization is unwound through C++ frames and the
        # process aborts ("terminate called without an active exception"). A listener still
        # blocked on this generation's fault key is released with the closing sentinel (a no-op
        # if a fault was posted; peers of a finished generation have closed it already).
        stack.callback(self._release_listener)

    def _coordinator(self) -> coord_mod.Coordinator:
        """The store protocol, linked to this node's store when the job spans nodes (and why not,
        in the ``node_link`` event, when it could be and is not)."""
        ep = self.launch.endpoint
        blocks, want = node_mod.node_mode(self.cfg.node_aggregation, self.world_size, ep.local_world_size)
        link: node_mod.NodeLink | None = None
        if want:
            got = node_mod.link(
                self.store,
                f"{self.ns}/node/{self.rank - ep.local_rank}",
                self.rank,
                ep.local_rank,
                ep.local_world_size,
                self.t.barrier,
                coord_mod.FOREVER,
            )
            link = got if isinstance(got, node_mod.NodeLink) else None
            self._ev.emit(
                Event.NODE_LINK,
                generation=self.generation,
                step=None,
                linked=link is not None,
                leader=self.rank - ep.local_rank,
                size=ep.local_world_size,
                reason=got if isinstance(got, str) else None,
            )
        return coord_mod.Coordinator(
            self.store,
            self.ns,
            self.rank,
            self.world_size,
            self.t.barrier,
            blocks=blocks,
            node=link,
            on_lost=self._node_lost,
        )

    def _node_lost(self, reason: str) -> None:
        """(any thread) The node's store went away with its host process: this rank goes on alone."""
        logger.warning(
            "rank {}: the node's store is gone ({}); the job's store alone from now on", self.rank, reason
        )
        if self.events is not None:
            self.events.emit(
                Event.NODE_LINK_LOST,
                generation=self.generation,
                step=self.step,
                leader=self.rank - self.launch.endpoint.local_rank,
                reason=reason,
            )

    def _health_store(self) -> dist.Store:
        node = self.coord.node
        return node.store if node is not None and not node.leader else self.store

    def _all_hold(self, name: str, value: str, timeout: float) -> bool:
        coord = getattr(self, "coord", None)  # (at start-up, before it exists: the flat count)
        return super()._all_hold(name, value, timeout) if coord is None else coord.same(name, value, timeout)

    def _release_listener(self) -> None:
        if self.listener.is_alive():
            with contextlib.suppress(Exception):
                self.coord.close_generation(self.generation)

    def _close_persist(self, persist: Persistence) -> None:
        persist.uninstall()
        try:
            persist.ckpt.close()
        except CheckpointError as e:
            logger.error("rank {}: at exit: {}", self.rank, e)

    def close(self) -> None:
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        try:  # every step runs (ExitStack); a failing one must not mask the run's own outcome
            self._cleanup.close()
        except Exception as e:
            logger.error("rank {}: at close: {}: {}", self.rank, type(e).__name__, e)
        self.monitor_store = self.listener_store = None  # type: ignore[assignment]

    # -- the restart loop -------------------------------------------------------------------------
    def run(self, fn: Callable[[], Any]) -> Any:
        try:
            self.start()
            if self.launch.under_launcher:
                # under `resilient launch` a (re)started worker checks its node before it joins:
                # a node that fails here again and again is excluded by its agent
                self._check_health(0, None)
            if self.launch.join_generation is not None:
                self._join_survivors(self.launch.join_generation)
            while True:
                pulled = self._enter_generation()
                try:
                    done, result, exc = (False, None, pulled) if pulled else self._attempt(fn)
                except StepInterrupted as late:  # an interrupt that raced with the except clause
                    self.phase = Phase.RECOVERING
                    done, result, exc = False, None, late
                if done:
                    if self.persist is not None:
                        self.persist.close(self.generation, self.step)
                    self._finished(
                        mirror_interval=self.mirror_schedule.interval if self.shm is not None else None,
                        monitor_wakeups=self.monitor.wakeups,
                        checkpoint_failures=self.persist.failures if self.persist else 0,
                    )
                    return result
                self._recover(exc)
                exc = None  # drop the failed generation (see _recover)
        except Preempted as e:
            self._ev.emit(Event.RUN_PREEMPTED, generation=self.generation, step=e.step, error=str(e))
            raise
        except ResilienceError as e:
            if self.events is not None:
                self.events.emit(Event.RUN_FAILED, generation=self.generation, step=self.step, error=str(e))
            raise
        finally:
            self.close()

    def _attempt(self, fn: Callable[[], Any]) -> tuple[bool, Any, BaseException | None]:
        try:
            result = fn()
            self._settle_at_end()
        except (Exception, StepInterrupted) as exc:
            self.phase = Phase.RECOVERING  # first: a late interrupt must not fire in recovery code
            if isinstance(exc, ResilienceError) and not isinstance(exc, HardFault | SoftFault):
                self.coord.abort_generation(self.generation, f"{type(exc).__name__}: {exc}")
                raise
            return False, None, exc
        self.phase = Phase.FINISHING
        self.hard_timer.arm(self.t.barrier + 10.0)
        if self.coord.finish_barrier(self.generation):
            self.hard_timer.disarm()
            self.coord.close_generation(self.generation)
            return True, result, None
        self.phase = Phase.RECOVERING
        return False, None, None

    def _enter_generation(self) -> StepInterrupted | None:
        """Build this generation's group. ``None``, or the interruption when a peer faulted first."""
        self.hard_timer.arm(self.t.startup + self.t.hard)
        t0 = time.time()
        gc_s = 0.0
        if self.generation > 0:
            gc.collect()  # free the previous generation's group and DDP here, in order, not at exit
            gc_s = time.time() - t0
        try:
            self._new_group(self.generation)
        except Exception as e:
            # a peer that faulted right after building its side closes its connections while this
            # rank still connects: that is its fault to recover from, not a failed rendezvous
            with contextlib.suppress(Exception):
                found = self.coord.primary_fault(self.generation)
                if found is not None:
                    self.phase = Phase.RECOVERING
                    return StepInterrupted(
                        f"peer: rank {found.rank} faulted while the group was built: {found.signature}"
                    )
            raise CoordinationError(
                f"rank {self.rank}: building the process group of generation {self.generation} failed: {e}"
            ) from e
        if self.generation > 0:
            self._ev.emit(
                Event.GROUP_REBUILT,
                generation=self.generation,
                step=self.restore_step,
                duration_s=time.time() - t0,
                gc_s=gc_s,
            )
        self.phase = Phase.RUNNING
        self.listener.watch(self.generation)
        return None

    def _recover(self, exc: BaseException | None) -> None:
        gen, step = self.generation, self.step
        fault_ts = time.time()
        rec: FaultRecord | None = None
        if exc is not None:
            rec = FaultRecord.from_exception(exc, rank=self.rank, generation=gen, step=step)
            tb = "".join(traceback.format_exception(exc))
            # The traceback pins the failed generation's frames, and through them its model, DDP
            # reducer and process group, in a reference cycle. Left to a random GC pass (or to
            # interpreter exit, where gloo's destructors abort the process), they must go now.
            traceback.clear_frames(exc.__traceback__)
            # (a fault this rank already heard of is not asked of the job's store again)
            primary = self.coord.post_fault(rec, known=self.remote_fault(gen))
            if primary.rank == self.rank and primary.kind == rec.kind:  # this rank's own fault
                self._fault_report(rec, tb=tb)
        else:  # we had returned; a peer faulted before everyone finished
            found = self._remote.get(gen) or self.coord.primary_fault(gen)
            if found is None:
                raise HardFault(f"generation {gen} released without a fault record")
            primary = found
        self._fault_detected(gen, step, primary, rec.message if rec else "finished; a peer faulted")
        t0 = time.time()
        n = 0
        if self.group is not None:  # (None: this generation's group was never built)
            n = self.group.abort()
            self.group.destroy()
            self.group = None
        self._ev.emit(
            Event.GROUP_ABORTED, generation=gen, step=step, connections=n, duration_s=time.time() - t0
        )
        if rec is not None and rec.severity == Severity.HARD.value:
            self.coord.abort_generation(gen, f"hard fault: {rec.signature}")
            raise HardFault(f"rank {self.rank} cannot recover in-process: {rec.message}") from exc
        if primary.kind == FaultKind.PREEMPT.value:
            self._preempt(gen, primary)
        self.hard_timer.arm(self.t.barrier + 10.0)
        try:
            delay = self.policy.admit(primary)
        except RestartBudgetExhausted as e:
            try:  # diagnosis only
                seen = "; ".join(f"rank {o['rank']}: {o['message']}" for o in self.coord.observations(gen))
            except Exception as store_gone:
                seen = f"unavailable ({type(store_gone).__name__}: {store_gone})"
            logger.error("rank {}: giving up: {} (last fault as each rank saw it: {})", self.rank, e, seen)
            # every rank reaches the same verdict from the same agreed faults, some later than
            # others: the store's host must not leave while a slower peer still posts its fault
            self._depart(gen)
            raise
        self._check_health(gen, step)
        if delay > 0:
            time.sleep(delay)
        if self.persist is not None:
            # a write still in flight would make this rank alone wait at its next save, a wait its
            # peers see as a hang: finish it here, where the recovery barrier holds them
            self.hard_timer.arm(self.cfg.checkpoint.commit_timeout_s + self.t.barrier + 10.0)
            self.persist.settle(gen, step)
        self._settle_before_restore()
        own: BaseException | None = None
        try:
            restore = self._agree_restore_step(gen, primary)
        except SetupFailed as e:
            self._depart(gen)
            if exc is None or self.rank not in e.ranks or isinstance(exc, StepInterrupted):
                raise  # (a rank pulled out by the culprit: the error names it)
            self._ev.emit(Event.RUN_FAILED, generation=gen, step=step, error=str(e))
            own = exc
        except StateRestoreError as e:
            if not self.launch.under_launcher:
                raise
            # (a replacement whose predecessor's snapshots no survivor holds any more): the whole
            # group restarts, and resumes from shared memory or the checkpoint
            self._depart(gen)
            raise HardFault(f"rank {self.rank}: {e}; the launcher restarts the group") from e
        if own is not None:  # raised outside the handler: the user's exception keeps its own chain
            raise self._own_setup_error(own)
        self._prepare_restore(restore, step, fault_ts)
        if self.persist is not None:  # a rank the fault interrupted before its save must not differ
            self.persist.rebase(restore)
        self.generation = gen + 1

    def _agree_restore_step(self, gen: int, primary: FaultRecord | None = None) -> int:
        return plan_step(self.coord.recovery_barrier(gen, self._held_steps()), primary)

    def _own_mirror_steps(self) -> list[int]:
        """Steps of this rank's own snapshots in this node's shared memory (at this world size)."""
        if self.shm is None:
            return []
        return [
            m["step"] for m in self.shm.slots() if (m["rank"], m["world"]) == (self.rank, self.world_size)
        ]

    def _held_steps(self) -> list[int]:
        """The steps this rank can restore: its ring's and its shared-memory mirror's, which a
        replacement for a dead peer holds too (the ring's own schedule may not have kept them)."""
        return sorted({*self.snapshots.steps(), *self._own_mirror_steps()}, reverse=True)

    def _materialize(self, step: int) -> dict[str, Any]:
        if step in self.snapshots.steps() or self.shm is None:
            state = self.snapshots.materialize(step)
            self._restore_owned = not isinstance(state, MappedState)
            return state
        self._restore_owned = True
        got = self.shm.load(step)
        assert got is not None
        return dict(got[1])

    def _join_survivors(self, gen: int) -> None:
        """A replacement for a dead rank (started by ``resilient launch`` with the dead rank's
        identity): its survivors are in generation ``gen``'s recovery, waiting for this rank. It
        offers the snapshots its predecessor left in this node's shared memory, agrees on the
        step to resume with them, and enters generation ``gen + 1`` as they do."""
        self.generation = gen
        if self.heartbeat is not None:
            self.heartbeat.generation = gen
        base = f"{self.ns}/schedule_base"
        if self.store.check([base]):  # the survivors' schedules count from where their attempt began
            step0 = int(self.store.get(base))
            self.schedule.rebase(step0)
            self.mirror_schedule.rebase(step0)
        if self.persist is not None:
            self.persist.abandon_predecessor()
        shm = self.shm
        if shm is not None:
            for step in self._own_mirror_steps():
                self.snapshots.adopt(step, functools.partial(_shm_state, shm, step))
        self.phase = Phase.RECOVERING
        self._recover(StepInterrupted(f"peer: rank {self.rank} replaced, joins generation {gen}"))

    def _tell_peers(self, gen: int, reason: str) -> None:
        try:
            self.coord.abort_generation(gen, reason)
        except Exception as e:  # the store's host (rank 0) may have exited first, failing its own
            logger.warning(f"rank {self.rank}: could not tell the peers (store unreachable: {e})")

    def _preempt(self, gen: int, primary: FaultRecord) -> None:
        """Every rank left its step: save the newest state all ranks hold, then exit for requeue."""
        self._settle_before_restore()
        step = self._agree_restore_step(gen)
        if self.persist is None:
            self._depart(gen)
            raise Preempted(f"preempted ({primary.message}); no checkpoint.dir, nothing saved", step)
        self.hard_timer.arm(self.cfg.checkpoint.commit_timeout_s + self.t.barrier)
        self.persist.final(step, self.snapshots.materialize(step), gen)
        self._depart(gen)
        raise Preempted(f"preempted ({primary.message}); final checkpoint at step {step} committed", step)

    def _depart(self, gen: int) -> None:
        """Every rank leaves after this generation's last barrier: the store's host last, or it
        resets its peers' connections while they still read."""
        with contextlib.suppress(Exception):
            self.coord.depart(gen, self.launch.endpoint.hosts_store)

    # -- the first entry: resume what a previous process left ---------------------------------------
    def _fresh_start(self, total: int | None) -> int:
        start = self._resume_at_start() if self.generation == 0 and self.step is None else 0
        shm = self.shm
        if shm is not None and self._adoptable == start:
            # just restored from this very snapshot: the ring points at it instead of copying
            self.snapshots.adopt(start, lambda: shm.load(start)[1])  # type: ignore[index]
            if self.replica is not None:
                self._mirror(start, self.registry.capture())  # (held: only the replica posts)
            return start
        state = self.registry.capture()
        self.snapshots.capture(start, state)
        self._mirror(start, state)
        return start

    def _mirror(self, step: int, state: dict[str, Any]) -> None:
        """Under ``resilient launch``: the snapshot also goes where it outlives this process (this
        node's shared memory; its small objects to the job's store, which outlives the node)."""
        if self.shm is None:
            return
        if not self.shm.holds(step, self.rank, self.world_size):  # not when just restored from it
            self.shm.capture(step, state, checksum=False, owner=(self.rank, self.world_size))
        if self.replica is not None:
            try:
                self.replica.publish(step, self.world_size, state)
            except Exception as e:  # the replica is a second line of defence, not a reason to stop
                logger.warning(f"rank {self.rank}: store replica of step {step} not posted: {e}")

    def _resume_at_start(self) -> int:
        """A (re)started worker: the shared-memory snapshot every rank holds, else the newest
        checkpoint that verifies everywhere, else step 0."""
        t0 = time.time()
        newest = self.persist.ckpt.committed()[:1] if self.persist is not None else []
        if self.shm is not None:
            got = resume.restore(
                shm=self.shm,
                rank=self.rank,
                world=self.world_size,
                names=[*self.registry.names(), RNG],
                exchange=lambda n, p: self.coord.exchange(0, n, p),
                replica=self.replica,
                newest_checkpoint=newest[0] if newest else -1,
            )
            if got is not None:
                if set(got.sources.values()) == {"shm"}:  # this rank's own snapshot, as it was
                    self._adoptable = got.step
                return self._apply_restored(
                    got.step, got.state, got.source, t0, world_from=got.world_from, sources=got.sources
                )
        if self.persist is None:
            return 0
        loaded = self.persist.resume(list(live_meshes(self.registry.objects()).values()))
        if loaded is None:
            return 0
        return self._apply_restored(loaded.step, loaded.state, str(loaded.path), t0)

    def _apply_restored(self, step: int, state: dict[str, Any], source: str, t0: float, **detail: Any) -> int:
        held = sorted(k for k in state if k != RNG)
        if set(held) != set(self.registry.names()):
            raise StateRestoreError(
                f"{source} holds {held}, but this run tracks {sorted(self.registry.names())}"
            )
        for name in held:
            self.registry.load(name, state[name])
        restore_rng(state[RNG])
        if self.persist is not None:
            self.persist.rebase(step)
        with contextlib.suppress(Exception):  # (every rank of this attempt writes the same step)
            self.store.set(f"{self.ns}/schedule_base", str(step))
        self.schedule.rebase(step)
        self.mirror_schedule.rebase(step)
        self._ev.emit(
            Event.STATE_RESTORED, generation=0, step=step, objects=held, source=source,
            duration_s=time.time() - t0, world=self.world_size, **detail,
        )  # fmt: skip
        return step

    # -- each completed step ------------------------------------------------------------------------
    def _ring_share(self) -> float:
        return 0.5 if self.launch.under_launcher else 1.0  # the mirror takes the other half

    def _on_step(self, step: int) -> None:
        self.hard_timer.arm(self.t.hard)

    def _mirror_due(self, nxt: int, total: int | None) -> bool:
        p = self.persist
        self._ckpt_due = p is not None and (p.due(nxt) or nxt == total)  # once a step: due() times it
        return (self.shm is not None and self.mirror_schedule.due(nxt, total)) or (
            self._ckpt_due or (p is not None and p.preempt_requested is not None)
        )

    def _after_snapshot(
        self,
        step: int,
        nxt: int,
        total: int | None,
        state: dict[str, Any] | None,
        step_s: float | None,
        now: float,
    ) -> None:
        p = self.persist
        if self.shm is not None:
            mirror_s = None
            # a mirror older than the newest checkpoint is never restored from (the disk is, more
            # slowly): a checkpoint step refreshes it too, with the state already captured
            if self.mirror_schedule.due(nxt, total) or self._ckpt_due:
                t_mirror = self.clock()
                self._mirror(nxt, state if state is not None else self.registry.capture())
                mirror_s = self.clock() - t_mirror
            self.mirror_schedule.observe(nxt, step_s, mirror_s)
        if p is None:
            return
        if self._ckpt_due:
            optimizers = [o for o in self.registry.objects() if isinstance(o, torch.optim.Optimizer)]
            # waiting for the save in flight (on_busy: wait) is not a hang: re-arm around it
            self.hard_timer.arm(self.cfg.checkpoint.commit_timeout_s + self.t.hard)
            self._in_save = True
            try:
                p.save(nxt, self.registry.capture(), self.generation, self.generation, pipeline=optimizers)
            finally:
                self._in_save = False
            self.hard_timer.arm(self.t.hard)
            self._progress = self.clock()
        if p.preempt_requested is not None:
            if nxt not in self.snapshots.steps():  # the state the final checkpoint will hold
                self.snapshots.capture(nxt, state if state is not None else self.registry.capture())
            raise StepInterrupted(f"preempt: {p.preempt_requested} received")

    # -- monitor-thread callbacks (see watchdog.Watched) ------------------------------------------
    def _interruptible(self, generation: int) -> bool:
        return self.phase is Phase.RUNNING and self.generation == generation

    def running_generation(self) -> int | None:
        return self.generation if self.phase is Phase.RUNNING else None

    def last_progress(self) -> tuple[float, bool]:
        if self._in_save:  # waiting for the previous checkpoint's commit is progress, not a hang
            return time.monotonic(), self._stepped
        return self._progress, self._stepped

    def _wait_for_fault(self, generation: int) -> FaultRecord | None:
        return self.coord.wait_fault(generation, self.listener_store)

    def _on_listened_fault(self, generation: int, fault: object) -> None:
        assert isinstance(fault, FaultRecord)
        self._remote[generation] = fault
        if fault.rank != self.rank and self._interruptible(generation):
            self.on_remote_fault(generation, fault)

    def remote_fault(self, generation: int) -> FaultRecord | None:
        f = self._remote.get(generation)  # what the listener heard: no store traffic here
        return f if f is not None and f.rank != self.rank else None

    def on_remote_fault(self, generation: int, fault: object) -> None:
        assert isinstance(fault, FaultRecord)
        with self._remote_lock:  # the listener and the monitor may both report it
            if generation in self._remote_handled:
                return
            self._remote_handled.add(generation)
        group = self.group  # the main thread may drop it concurrently
        if group is not None and group.generation == generation:
            group.abort()
        self.interrupter.interrupt(
            generation, f"peer: rank {fault.rank} faulted at step {fault.step}: {fault.signature}"
        )

    def main_thread_where(self) -> tuple[str, bool]:
        return main_thread_where()

    def on_hang(self, generation: int, idle_s: float) -> None:
        where, _ = self.main_thread_where()
        limit = self.t.hang if self._stepped else self.t.startup
        msg = f"no step progress for {idle_s:.2f}s (limit {limit:g}s); main thread at {where}"
        kind, sig = FaultKind.HANG, "hang: no step progress"
        fp = self.fp
        desync = fp.diagnose(self.monitor_store) if fp is not None else None
        if desync is not None:  # waiting in a collective a neighbour finished the step without
            kind, msg = FaultKind.DESYNC, f"{desync} ({msg})"
            sig = "desync: ranks issued different collectives in a step"
        rec = FaultRecord(
            rank=self.rank,
            generation=generation,
            step=self.step,
            kind=kind.value,
            severity=Severity.SOFT.value,
            signature=sig,
            message=msg,
            latency_s=idle_s,
        )
        self.coord.post_fault(rec, store=self.monitor_store)
        self._fault_report(rec, stacks=all_stacks())  # (before the interrupt moves the main thread)
        group = self.group
        if group is not None and group.generation == generation:
            group.abort()
        self.interrupter.interrupt(generation, f"{kind.value}: {msg}")

    def nudge(self, generation: int) -> None:
        now = time.monotonic()
        if now - self._last_nudge > 0.5:
            self._last_nudge = now
            self.interrupter.resend(generation)


class MappedState(dict[str, Any]):
    """A snapshot whose tensors are views of a shared-memory slot, not copies: each object copies
    what it keeps as it is tracked (see ``Registry.load(owned=False)``)."""


def _shm_state(shm: ShmSnapshot, step: int) -> dict[str, Any]:
    got = shm.load(step, mapped=True)
    if got is None:
        raise StateRestoreError(f"{shm.dir}: the snapshot of step {step} is gone")
    return MappedState(got[1])


def excepthook_exit_codes() -> None:
    """Make an uncaught resilient error end the process with its documented exit code."""
    previous = sys.excepthook
    if getattr(previous, "_resilient", False):
        return

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if previous is sys.__excepthook__:
            # the C hook printed nothing here for exceptions raised out of the restart loop (seen on
            # CPython 3.11); the traceback module always prints the chain
            traceback.print_exception(tp, value, tb, file=sys.stderr)
        else:
            previous(tp, value, tb)
        code = getattr(value, "exit_code", None) or getattr(value, "_resilient_exit_code", None)
        if code is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(code))

    hook._resilient = True  # type: ignore[attr-defined]
    sys.excepthook = hook
