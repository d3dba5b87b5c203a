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
import gc
import json
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from resilient.checkpoint.shm import ShmSnapshot
from resilient.config import Config
from resilient.errors import (
    CheckpointError,
    CoordinationError,
    HardFault,
    HealthCheckFailed,
    Preempted,
    ResilienceError,
    RestartBudgetExhausted,
    SoftFault,
    StateRestoreError,
    StepInterrupted,
)
from resilient.events import Event, EventLog
from resilient.launcher.heartbeat import ENV_DIR, Heartbeat, die_with_launcher, unhealthy_path
from resilient.runtime import coordinator as coord_mod
from resilient.runtime import resume
from resilient.runtime.faults import FaultKind, FaultRecord, Severity
from resilient.runtime.fingerprint import CollectiveCount
from resilient.runtime.health import Check, HealthInput, run_checks
from resilient.runtime.persist import Persistence
from resilient.runtime.pg import Group, build_group, resolve_backend
from resilient.runtime.policy import RestartPolicy
from resilient.runtime.schedule import SnapshotSchedule
from resilient.runtime.tracking import Tracking
from resilient.runtime.watchdog import FaultListener, HardHangTimer, MainThreadInterrupter, Monitor
from resilient.state import Registry, SnapshotRing
from resilient.state.registry import RNG, restore_rng

# Files whose frames, innermost on the main thread, mean "blocked waiting for peers".
_COLLECTIVE_MODULES = (
    "torch/distributed/",
    "torch/autograd/",
    "torch/nn/parallel/distributed.py",
    "resilient/runtime/fingerprint.py",  # waiting for a peer's collective count: a victim's wait too
)


class Phase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHING = "finishing"
    CLOSED = "closed"


@dataclass
class _Cost:
    """What the runtime costs the main thread in steady state (reported in ``run_finished``)."""

    steps: int = 0
    snapshots: int = 0
    hook_s: float = 0.0  # time in the per-step hook: progress, timer, snapshot copy


class Runtime(Tracking):
    """Engine behind :func:`resilient.wrap`. Not thread-safe except where the monitor needs it."""

    def __init__(self, cfg: Config, checks: Sequence[Check] = ()) -> None:
        self.cfg = cfg
        self.t = cfg.timeouts
        self.extra_checks = tuple(checks)
        self.ep = coord_mod.endpoint_from_env()
        self.rank, self.world_size, self.local_rank = self.ep.rank, self.ep.world_size, self.ep.local_rank
        self.backend = resolve_backend(cfg.backend)
        self.device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.phase = Phase.STARTING
        self.generation = 0
        self.step: int | None = None
        self.registry = Registry()
        self.snapshots = SnapshotRing()
        self.policy = RestartPolicy(cfg.restart)
        self.group: Group | None = None
        self.restore_step: int | None = None
        self._restore_state: dict[str, Any] | None = None
        self._restored: set[str] = set()
        self._fault_ts: float | None = None
        self._fault_step: int | None = None
        self._resume_pending = False
        self._progress = time.monotonic()
        self._stepped = False
        self._in_save = False
        self._last_nudge = 0.0
        self.cost = _Cost()
        # constructed here without side effects; start() installs and starts them
        self.interrupter = MainThreadInterrupter(cfg.interrupt_signal, self._interruptible)
        self.hard_timer = HardHangTimer()
        self.monitor = Monitor(self, self.t)
        self.listener = FaultListener(self._wait_for_fault, self._on_listened_fault)
        self._remote: dict[int, FaultRecord] = {}
        self._remote_handled: set[int] = set()
        self._remote_lock = threading.Lock()
        self.events: EventLog | None = None  # needs the run id, agreed in start()
        self.persist: Persistence | None = None  # durable checkpoints, when checkpoint.dir is set
        self.shm: ShmSnapshot | None = None  # snapshots in /dev/shm, under `resilient launch`
        self.replica: resume.StoreReplica | None = None  # small per-rank state, in the job's store
        self._adoptable: int | None = None  # restored from this rank's own shm snapshot of this step
        self._chaos: Any = None  # chaos.inject.Injector, when RESILIENT_CHAOS names faults to fire
        self.fp: CollectiveCount | None = None  # this generation's per-step collective counts
        self.run_dir: Path | None = None

    @property
    def _ev(self) -> EventLog:
        assert self.events is not None, "events are available once start() ran"
        return self.events

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
        self.store = coord_mod.connect(self.ep, self.t.barrier)
        self.store_host, self.store_port = self.ep.host, self.store.port
        self.run_id = coord_mod.agree_run_id(self.store)
        # the launch: `resilient launch` passes the rendezvous round, the same on every node;
        # torchrun's restart count can differ between nodes after a peer-triggered restart
        attempt = os.environ.get("RESILIENT_LAUNCH_ROUND") or os.environ.get(
            "TORCHELASTIC_RESTART_COUNT", "0"
        )
        ns = f"resilient/{self.run_id}/a{attempt}"
        self.coord = coord_mod.Coordinator(self.store, ns, self.rank, self.world_size, self.t.barrier)
        self.schedule = SnapshotSchedule(self.cfg.snapshot, self.rank, self.store, f"{ns}/snapshot_interval")
        # under `resilient launch` the snapshot is also mirrored where it outlives the process; that
        # copy costs more (shared memory, the store replica) and only a hard fault needs it, so it
        # has its own cadence: the in-memory ring, which every soft fault restores from, is not
        # thinned out by the mirror's cost
        self.mirror_schedule = SnapshotSchedule(
            self.cfg.snapshot, self.rank, self.store, f"{ns}/mirror_interval"
        )
        self.monitor_store = coord_mod.client(self.store_host, self.store_port, self.t.barrier)
        self.listener_store = coord_mod.client(self.store_host, self.store_port, coord_mod.FOREVER)
        self.run_dir = self.cfg.events.dir / self.run_id
        self.events = events = EventLog(self.run_dir / "events.jsonl", self.rank)
        if self.cfg.checkpoint.dir is not None:
            self.persist = Persistence(
                self.cfg.checkpoint,
                rank=self.rank,
                world_size=self.world_size,
                token=f"{self.run_id}-a{attempt}",
                events=events,
                exchange=lambda name, payload: self.coord.exchange(self.generation, name, payload),
            )
            self.persist.install()
        self.interrupter.install()
        self.hard_timer.install()
        die_with_launcher()
        self._chaos = _chaos_from_env()
        if os.environ.get("RESILIENT_STEP_EVENTS") == "1":  # a certificate's timeline
            events_cfg = self.cfg.events.model_copy(update={"steps": True})
            self.cfg = self.cfg.model_copy(update={"events": events_cfg})
        self.heartbeat = Heartbeat.from_env()  # under `resilient launch`: the agent watches it
        shm_name = os.environ.get("RESILIENT_SHM_NAME")  # set by `resilient launch`, which keeps it
        # keyed by the local rank: a relaunched worker finds its predecessor's snapshot even when
        # the rendezvous renumbered the nodes (each snapshot records the global rank that wrote it)
        self.shm = ShmSnapshot(shm_name, self.local_rank) if shm_name else None
        self.replica = (
            resume.StoreReplica(
                self.store, f"resilient/{self.run_id}/replica", self.rank, self.cfg.snapshot.replica_max_bytes
            )
            if shm_name
            else None
        )
        if self.heartbeat is not None:
            self.heartbeat.start(lambda: self.step)
        self.monitor.start()
        self.listener.start()
        if self.backend == "nccl":
            torch.cuda.set_device(self.local_rank)
        events.emit(
            Event.RUN_STARTED,
            generation=0,
            step=None,
            world_size=self.world_size,
            backend=self.backend,
            hang_timeout=self.t.hang,
            collective_timeout=self.t.collective,
        )

    def close(self) -> None:
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        # Our threads must be finished before the interpreter finalizes: a daemon thread that
        # returns from a store call during finalization is unwound through C++ frames and the
        # process aborts ("terminate called without an active exception"). A listener still
        # blocked on this generation's fault key is released with the closing sentinel (a no-op
        # if a fault was posted; peers of a finished generation have closed it already).
        if self.listener.is_alive() and hasattr(self, "coord"):
            with contextlib.suppress(Exception):
                self.coord.close_generation(self.generation)
        if self.persist is not None:
            self.persist.uninstall()
            try:
                self.persist.ckpt.close()
            except CheckpointError as e:
                logger.error("rank {}: at exit: {}", self.rank, e)
        heartbeat = getattr(self, "heartbeat", None)
        if heartbeat is not None:
            heartbeat.close()
        for stop in (
            self.listener.stop,
            self.monitor.stop,
            self.hard_timer.uninstall,
            self.interrupter.uninstall,
        ):
            try:
                stop()
            except Exception as e:  # start() may have failed half-way
                logger.debug("close: {}", e)
        if self.group is not None:
            self.group.destroy(abort=False)
            self.group = None
        if self.events is not None:
            self.events.close()
        self.store = self.monitor_store = None  # type: ignore[assignment]  # release the connections

    # -- the restart loop -------------------------------------------------------------------------
    def run(self, fn: Callable[[], Any]) -> Any:
        try:
            self.start()
            if self.shm is not None:
                # under `resilient launch` a (re)started worker checks its node before it joins:
                # a node that fails here again and again is excluded by its agent
                self._check_health(0, None)
            while True:
                self._enter_generation()
                try:
                    done, result, exc = self._attempt(fn)
                except StepInterrupted as late:  # an interrupt that raced with the except clause
                    self.phase = Phase.RECOVERING
                    done, result, exc = False, None, late
                if done:
                    if self.persist is not None:
                        self.persist.close(self.generation, self.step)
                    self._save_final_state()
                    self._ev.emit(
                        Event.RUN_FINISHED,
                        generation=self.generation,
                        step=self.step,
                        steps_completed=self.cost.steps,
                        snapshots=self.cost.snapshots,
                        snapshot_interval=self.schedule.interval,
                        mirror_interval=self.mirror_schedule.interval if self.shm is not None else None,
                        runtime_ms_per_step=1e3 * self.cost.hook_s / max(1, self.cost.steps),
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

    def _enter_generation(self) -> None:
        self.hard_timer.arm(self.t.startup + self.t.hard)
        t0 = time.time()
        gc_s = 0.0
        if self.generation > 0:
            gc.collect()  # free the previous generation's group and DDP here, in order, not at exit
            gc_s = time.time() - t0
        try:
            self.group = build_group(
                backend=self.backend,
                store=self.store,
                store_port=self.store_port,
                rank=self.rank,
                world_size=self.world_size,
                generation=self.generation,
                timeout=self.t.collective,
                device_id=self.device if self.backend == "nccl" else None,
                namespace=self.coord.ns,
            )
        except Exception as e:
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
        self.registry.clear()
        self._restored = set()
        if self.cfg.collective_check:
            fp_prefix = f"{self.coord.ns}/g{self.generation}/fp"
            self.fp = CollectiveCount(self.store, fp_prefix, self.rank, self.world_size)
        self._progress, self._stepped = time.monotonic(), False
        self.phase = Phase.RUNNING
        self.listener.watch(self.generation)

    def _recover(self, exc: BaseException | None) -> None:
        gen, step = self.generation, self.step
        self._fault_ts, self._fault_step = time.time(), step
        rec: FaultRecord | None = None
        if exc is not None:
            rec = FaultRecord.from_exception(exc, rank=self.rank, generation=gen, step=step)
            # The traceback pins the failed generation's frames, and through them its model, DDP
            # reducer and process group, in a reference cycle. Left to a random GC pass (or to
            # interpreter exit, where gloo's destructors abort the process), they must go now.
            traceback.clear_frames(exc.__traceback__)
            primary = self.coord.post_fault(rec)
        else:  # we had returned; a peer faulted before everyone finished
            found = self.coord.primary_fault(gen)
            if found is None:
                raise HardFault(f"generation {gen} released without a fault record")
            primary = found
        self._ev.emit(
            Event.FAULT_DETECTED,
            generation=gen,
            step=step,
            kind=primary.kind,
            signature=primary.signature,
            origin_rank=primary.rank,
            origin_step=primary.step,
            origin_ts=primary.ts,
            origin_latency_s=primary.latency_s,
            local=rec.message if rec else "finished; a peer faulted",
        )
        t0 = time.time()
        assert self.group is not None
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
            try:  # diagnosis only: the store's host may already have exited with the same verdict
                seen = "; ".join(f"rank {o['rank']}: {o['message']}" for o in self.coord.observations(gen))
            except Exception as store_gone:
                seen = f"unavailable ({type(store_gone).__name__}: {store_gone})"
            logger.error("rank {}: giving up: {} (last fault as each rank saw it: {})", self.rank, e, seen)
            raise
        self._check_health(gen, step)
        if delay > 0:
            time.sleep(delay)
        self.restore_step = self._agree_restore_step(gen)
        self.snapshots.drop_after(self.restore_step)
        self._restore_state = self.snapshots.materialize(self.restore_step)
        self._resume_pending = True
        self.generation = gen + 1

    def _agree_restore_step(self, gen: int) -> int:
        steps_by_rank = self.coord.recovery_barrier(gen, self.snapshots.steps())
        common = set(steps_by_rank[0]).intersection(*map(set, steps_by_rank[1:]))
        if not common:
            raise StateRestoreError(f"no snapshot step held by every rank: {steps_by_rank}")
        return max(common)

    def _preempt(self, gen: int, primary: FaultRecord) -> None:
        """Every rank left its step: save the newest state all ranks hold, then exit for requeue."""
        step = self._agree_restore_step(gen)
        if self.persist is None:
            raise Preempted(f"preempted ({primary.message}); no checkpoint.dir, nothing saved", step)
        self.hard_timer.arm(self.cfg.checkpoint.commit_timeout_s + self.t.barrier)
        self.persist.final(step, self.snapshots.materialize(step), gen)
        raise Preempted(f"preempted ({primary.message}); final checkpoint at step {step} committed", step)

    def _check_health(self, gen: int, step: int | None) -> None:
        t0 = time.time()
        results = run_checks(HealthInput(self.rank, gen, self.store, self.cfg.health), self.extra_checks)
        failed = [r for r in results if not r.ok]
        self._ev.emit(
            Event.HEALTH_CHECKED,
            generation=gen,
            step=step,
            ok=not failed,
            duration_s=time.time() - t0,
            checks={r.name: {"ok": r.ok, "value": r.value} for r in results},
        )
        if failed:
            f = failed[0]
            logger.error(
                "rank {}: health check {!r} failed: value={} ({})", self.rank, f.name, f.value, f.detail
            )
            hb_dir = os.environ.get(ENV_DIR)
            if hb_dir:  # tell the launcher's agent: a node that keeps failing them is excluded
                with contextlib.suppress(OSError):
                    unhealthy_path(Path(hb_dir), self.local_rank).write_text(
                        json.dumps({"check": f.name, "value": str(f.value), "detail": f.detail})
                    )
            try:
                self.coord.abort_generation(gen, f"health check {f.name!r} failed: {f.value}")
            except Exception as e:  # the store's host (rank 0) may have exited first, failing its own
                logger.warning(f"rank {self.rank}: could not tell the peers (store unreachable: {e})")
            raise HealthCheckFailed(f.name, f.value, f.detail)

    # -- user-facing hooks (called through Context) -----------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        start = self._begin_steps(total)
        for step in range(start, total):
            self.step = step
            if self.heartbeat is not None:  # the step a hard fault hits, exactly, for the agent
                self.heartbeat.beat(step)
            if self.fp is not None:
                self.fp.begin(step)
            if self._chaos is not None:  # a certificate's fault, in this rank at this step
                for where in ("step", "before_collective"):  # (both at the step's start here)
                    self._chaos.maybe_fire(self.rank, step, where, objects=self.registry.objects())
            yield step
            self._complete(step, total)

    def _begin_steps(self, total: int) -> int:
        if self._restore_state is None:
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
        return self._resume_restored(snapshot_interval=self.schedule.interval)

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
        loaded = self.persist.resume()
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
            interval = self.cfg.checkpoint.interval
            self.persist.next_save = step + (interval if isinstance(interval, int) else 1)
        self.schedule.rebase(step)
        self.mirror_schedule.rebase(step)
        self._ev.emit(
            Event.STATE_RESTORED, generation=0, step=step, objects=held, source=source,
            duration_s=time.time() - t0, world=self.world_size, **detail,
        )  # fmt: skip
        return step

    def _complete(self, step: int, total: int) -> None:
        now = time.monotonic()
        step_s = now - self._progress if self._stepped else None
        self._progress, self._stepped = now, True
        self.hard_timer.arm(self.t.hard)
        if self.fp is not None:  # every rank issued the same collectives, or nothing is captured
            self.fp.check(step)
        if self.cfg.events.steps:
            ev = Event.STEP_COMPLETED
            self._ev.emit(ev, generation=self.generation, step=step, step_s=step_s, log=False)
        nxt = step + 1
        capture_s = mirror_s = None
        ring_due = self.schedule.due(nxt, total)
        mirror_due = self.shm is not None and self.mirror_schedule.due(nxt, total)
        if ring_due or mirror_due:
            state = self.registry.capture()
            if ring_due:
                self.snapshots.capture(nxt, state)
                capture_s = time.monotonic() - now
            if mirror_due:
                t_mirror = time.monotonic()
                self._mirror(nxt, state)
                mirror_s = time.monotonic() - t_mirror
        self.schedule.observe(nxt, step_s, capture_s)
        if self.shm is not None:
            self.mirror_schedule.observe(nxt, step_s, mirror_s)
        p = self.persist
        if p is not None:
            if p.due(nxt) or nxt == total:
                optimizers = [o for o in self.registry.objects() if isinstance(o, torch.optim.Optimizer)]
                # waiting for the save in flight (on_busy: wait) is not a hang: re-arm around it
                self.hard_timer.arm(self.cfg.checkpoint.commit_timeout_s + self.t.hard)
                self._in_save = True
                try:
                    state = self.registry.capture()
                    p.save(nxt, state, self.generation, self.generation, pipeline=optimizers)
                finally:
                    self._in_save = False
                self.hard_timer.arm(self.t.hard)
                self._progress = time.monotonic()
            if p.preempt_requested is not None:
                if capture_s is None:  # the state the final checkpoint will hold
                    self.snapshots.capture(nxt, self.registry.capture())
                raise StepInterrupted(f"preempt: {p.preempt_requested} received")
        self.cost.steps += 1
        self.cost.snapshots += capture_s is not None
        self.cost.hook_s += time.monotonic() - now
        if self._resume_pending:
            self._resume_pending = False
            self._ev.emit(
                Event.STEP_RESUMED,
                generation=self.generation,
                step=step,
                since_fault_s=time.time() - (self._fault_ts or time.time()),
            )

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
        """Innermost frame of the main thread, and whether it sits in a collective / backward pass."""
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        if frame is None:
            return "?", False
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        f: types.FrameType | None = frame
        for _ in range(4):  # the innermost Python frames around the blocking C++ call
            if f is None:
                break
            if any(m in f.f_code.co_filename for m in _COLLECTIVE_MODULES):
                return where, True
            f = f.f_back
        return where, False

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
        group = self.group
        if group is not None and group.generation == generation:
            group.abort()
        self.interrupter.interrupt(generation, f"{kind.value}: {msg}")

    def nudge(self, generation: int) -> None:
        now = time.monotonic()
        if now - self._last_nudge > 0.5:
            self._last_nudge = now
            self.interrupter.resend(generation)


def _chaos_from_env() -> Any:
    """``RESILIENT_CHAOS=kind@step[:rank],...`` (chaos/inject.py's plan): the runtime fires those
    faults itself at the start of the step, so any wrapped script can be certified unchanged.
    ``RESILIENT_CHAOS_ATTEMPT=N``: only in launch attempt N (TORCHELASTIC_RESTART_COUNT)."""
    plan = os.environ.get("RESILIENT_CHAOS")
    if not plan:
        return None
    only = os.environ.get("RESILIENT_CHAOS_ATTEMPT")
    if only is not None and only != os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"):
        return None
    from chaos.inject import Injector

    return Injector.parse(plan)


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
        code = getattr(value, "exit_code", None)
        if code is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(code))

    hook._resilient = True  # type: ignore[attr-defined]
    sys.excepthook = hook
