"""The engine core: what every engine does with a generation, a step and a fault, written once.

An engine (the native one, :mod:`resilient.runtime.native`; NVRx's Wrapper,
:mod:`resilient.runtime.nvrx`) decides *how* ranks leave a failed generation and meet again; the
core holds what happens around that, the same under both:

- start-up: the run's store, id, event log and heartbeat (a :class:`Wiring`, built from the launch
  contract by :func:`wire`, or from fakes by a test), ``run_started``, the hooks;
- a generation: the process group built on its own store prefix, the tracked objects registered
  afresh, the collective count of its steps;
- a step: the heartbeat, the hooks, the collective check, the in-memory snapshot when due;
- a fault: the ``fault_detected`` event, the health checks (an unhealthy rank tells its
  launcher's agent), the newest snapshot step every rank holds, its restore into the objects
  tracked on re-entry;
- the end: the hooks' ``on_finish`` and ``run_finished``.

Engines extend the core at named points: ``_fresh_start`` (the first entry's state),
``_on_step`` (each completed step, before the snapshot), ``_after_snapshot`` (mirror, durable
checkpoint) and ``_tell_peers`` (a rank that cannot go on).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from loguru import logger

from resilient.config import Config
from resilient.contract import Heartbeat, die_with_launcher, mark_unhealthy, run_namespace
from resilient.errors import CoordinationError, ExitCode, HealthCheckFailed, SetupFailed, StateRestoreError
from resilient.events import Event, EventLog
from resilient.launch_env import LaunchEnv, Var
from resilient.runtime import coordinator as coord_mod
from resilient.runtime.collective_check import CollectiveCount, CollectiveDesync
from resilient.runtime.faults import FaultRecord
from resilient.runtime.health import Check, HealthInput, run_checks
from resilient.runtime.hooks import RunInfo, StepHook
from resilient.runtime.pg import Group, build_group, resolve_backend
from resilient.runtime.policy import RestartPolicy
from resilient.runtime.schedule import SnapshotSchedule
from resilient.state import Registry, SnapshotRing
from resilient.state.ddp import BucketLayouts
from resilient.state.loader import finish_pass
from resilient.state.registry import EPOCHS, RNG, restore_rng

DDP_BUCKETS = "ddp-buckets.json"  # in the run directory: DDP's rebuilt layouts, for relaunched workers

# Files whose frames, innermost on the main thread, mean "blocked waiting for peers".
_COLLECTIVE_MODULES = (
    "torch/distributed/",
    "torch/autograd/",
    "torch/nn/parallel/distributed.py",
    "resilient/runtime/collective_check.py",  # waiting for a peer's collective count: a victim's wait too
)

GroupBuilder = Callable[[int, str], Group]  # (generation, namespace) -> that generation's group


@dataclass
class Wiring:
    """The collaborators of one run: connections, identity agreed with the peers, sinks."""

    store: dist.Store  # the main thread's connection to the job's store
    side_store: Callable[[float], dist.Store]  # another connection (a thread's own), given a timeout
    run_id: str
    events: EventLog
    build_group: GroupBuilder
    heartbeat: Heartbeat | None = None
    clock: Callable[[], float] = time.monotonic  # step progress; wall time stays time.time
    on_close: list[Callable[[], None]] = field(default_factory=list)


def wire(cfg: Config, launch: LaunchEnv, *, backend: str, device: torch.device) -> Wiring:
    """The real collaborators: the job's TCPStore (rank 0 hosts it without an agent store), the run
    id agreed over it, the run's event log, groups built with ``backend``, the launcher's heartbeat."""
    ep, t = launch.endpoint, cfg.timeouts
    store = coord_mod.connect(ep, t.barrier)
    run_id = launch.run_id or coord_mod.agree_run_id(store, {})
    port = store.port

    def group(generation: int, namespace: str) -> Group:
        return build_group(
            backend=backend,
            store=store,
            store_port=port,
            rank=ep.rank,
            world_size=ep.world_size,
            generation=generation,
            timeout=t.collective,
            device_id=device if backend == "nccl" else None,
            namespace=namespace,
        )

    return Wiring(
        store=store,
        side_store=lambda timeout: coord_mod.client(ep.host, port, timeout),
        run_id=run_id,
        events=EventLog(cfg.events.dir / run_id / "events.jsonl", ep.rank, attempt=launch.attempt),
        build_group=group,
        heartbeat=Heartbeat.for_worker(launch),
    )


class _Epochs:
    """``ctx.epochs``' position, kept with the tracked state: the epoch, and whether its last batch
    was stepped (a snapshot at an epoch's end resumes at the next epoch, not in an empty pass of
    this one, whose end-of-epoch code would run twice)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.done = False

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.done = bool(state.get("done", False))  # (snapshots from before the flag: not done)


def common_restore_step(steps_by_rank: Sequence[Sequence[int]], primary: FaultRecord | None = None) -> int:
    """The newest snapshot step every rank holds. A rank holding none failed before its first
    step: :class:`SetupFailed`, naming it (and the fault, when it is that rank's)."""
    return plan_step(
        json.loads(coord_mod.restore_plan([json.dumps(list(s)) for s in steps_by_rank])), primary
    )


def plan_step(plan: dict[str, Any], primary: FaultRecord | None = None) -> int:
    """The step of a recovery barrier's :func:`~resilient.runtime.coordinator.restore_plan`, or
    the error every rank raises alike."""
    if plan.get("malformed"):
        raise CoordinationError(
            f"ranks {plan['malformed']} posted malformed snapshot lists to the recovery barrier"
        )
    empty = plan["empty"]
    if empty:  # (a peer pulled out before its own first step holds none either: the fault names who)
        if primary is not None and primary.rank in empty:
            raise SetupFailed(f"rank {primary.rank} failed before the first step: {primary.message}", empty)
        raise SetupFailed(f"ranks {empty} hold no snapshot: they failed before the first step", empty)
    if plan["step"] is None:
        raise StateRestoreError(f"no snapshot step held by every rank: {plan.get('held')}")
    return int(plan["step"])


def all_stacks(limit: int = 16000) -> str:
    """The Python stack of every thread of this process, main thread first (a fault report's)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
    parts = []
    for ident, frame in frames:
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    text = "\n".join(parts)
    return text if len(text) <= limit else text[:limit] + "\n... (cut)"


def main_thread_where() -> tuple[str, bool]:
    """Innermost frame of the main thread, and whether it sits in a collective / backward pass
    (a victim waiting for a peer) rather than in the rank's own code (a culprit, when it hangs)."""
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


@dataclass
class Cost:
    """What the runtime costs the main thread in steady state (reported in ``run_finished``)."""

    steps: int = 0
    snapshots: int = 0
    hook_s: float = 0.0  # time in the per-step hook: progress, timer, snapshot copy


class EngineCore:
    """State and logic both engines share; see the module docstring for the extension points."""

    engine: ClassVar[str] = "resilient"

    def __init__(
        self,
        cfg: Config,
        checks: Sequence[Check] = (),
        *,
        launch: LaunchEnv | None = None,
        hooks: Sequence[StepHook] = (),
        wiring: Callable[[EngineCore], Wiring] | None = None,
    ) -> None:
        self.cfg = cfg
        self.t = cfg.timeouts
        self.extra_checks = tuple(checks)
        self.launch = launch if launch is not None else LaunchEnv.from_environ()
        self.ep = self.launch.endpoint
        self.rank, self.world_size, self.local_rank = self.ep.rank, self.ep.world_size, self.ep.local_rank
        self.backend = resolve_backend(cfg.backend)
        self.device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.hooks = list(hooks)
        self._wire = wiring or (
            lambda core: wire(core.cfg, core.launch, backend=core.backend, device=core.device)
        )
        self.generation = 0
        self.step: int | None = None
        self.restore_step: int | None = None
        self.registry = Registry()
        self.snapshots = SnapshotRing()
        self.policy = RestartPolicy(cfg.restart)
        self.group: Group | None = None
        self.events: EventLog | None = None  # needs the run id, agreed at start-up
        self.run_dir: Path | None = None
        self.heartbeat: Heartbeat | None = None
        self.fp: CollectiveCount | None = None  # this generation's per-step collective counts
        self.cost = Cost()
        self._restore_state: dict[str, Any] | None = None
        self._restore_owned = True  # False: its tensors are views of a mapped snapshot, copied on load
        self._restored: set[str] = set()
        self.ddp_layouts = BucketLayouts()
        self._layouts_applied = contextlib.ExitStack()  # while the function re-enters after a fault
        self._fault_step: int | None = None
        self._fault_ts: float | None = None
        self._resume_pending = False
        self._progress_at: tuple[float, int] | None = None  # (clock, steps) of the last progress event
        self._begun = False
        self._epochs: _Epochs | None = None  # the entry's ctx.epochs position, once it has one
        self._deferred: int | None = None  # an epoch's last step, completed when the epoch ends
        self._next_step = 0
        self._stepped = False
        self._progress = 0.0
        self.clock: Callable[[], float] = time.monotonic

    @property
    def _ev(self) -> EventLog:
        assert self.events is not None, "events are available once the run started"
        return self.events

    # -- start-up and end -------------------------------------------------------------------------
    def _open(self, namespace_tail: str) -> Wiring:
        """Connect (through the wiring), name this launch attempt's keys, start the event log, the
        heartbeat and the hooks. Engine-specific start-up comes after."""
        # first: a launcher killed while this worker connects (or stopped before it got further)
        # must still take the worker with it
        die_with_launcher(self.launch.launcher_pid)
        w = self._wire(self)
        self.wiring = w
        self.store = w.store
        self.clock = w.clock
        self.run_id = w.run_id
        self.ns = run_namespace(w.run_id, self.launch.attempt, namespace_tail)
        self.events = w.events
        self.run_dir = w.events.path.parent if w.events.path is not None else self.cfg.events.dir / w.run_id
        self.schedule = SnapshotSchedule(
            self.cfg.snapshot, self.rank, self.store, f"{self.ns}/snapshot_interval", self._ring_share()
        )
        self.heartbeat = w.heartbeat
        if self.heartbeat is not None:  # under `resilient launch`: the agent watches it
            self.heartbeat.start(lambda: self.step)
        if self.backend == "nccl":
            torch.cuda.set_device(self.local_rank)
        self._ev.emit(
            Event.RUN_STARTED,
            generation=0,
            step=None,
            world_size=self.world_size,
            backend=self.backend,
            hang_timeout=self.t.hang,
            collective_timeout=self.t.collective,
            engine=self.engine,
            max_restarts=self.cfg.restart.max_restarts,
            restart_window_s=self.cfg.restart.window_s,
        )
        self._serve_metrics(w)
        # relaunched: DDP starts with the buckets it had rebuilt, if every rank has the same ones
        # (a replacement for one rank agrees with its survivors at their recovery instead)
        self.ddp_layouts.load(self.run_dir / DDP_BUCKETS)
        if self.launch.join_generation is None:
            same = self._all_hold(
                "ddp_layout/start", self.ddp_layouts.digest(), self.t.startup + self.t.barrier
            )
            if same and len(self.ddp_layouts):
                self._layouts_applied.enter_context(self.ddp_layouts.applied())
        info = RunInfo(self.rank, self.world_size, self.engine, self.cfg, self.launch, self._ev, self.run_dir)
        for h in self.hooks:
            h.on_start(info)
        return w

    def _serve_metrics(self, w: Wiring) -> None:
        """Under plain torchrun, local rank 0 serves the run's metrics (``metrics.port``); under
        ``resilient launch --metrics-port`` the agent does, reading the same log."""
        m = self.cfg.metrics
        if m.port is None or self.local_rank != 0 or os.environ.get(Var.METRICS_BY_AGENT):
            return
        log = self.events.path if self.events is not None else None
        if log is None:
            return
        from resilient.metrics.exporter import Exporter, RunMetrics

        metrics = RunMetrics(log, run_id=self.run_id, refresh_s=m.refresh_s)
        ex = Exporter(metrics, m.port, m.addr, poll_s=min(1.0, m.refresh_s))
        if ex.start():
            w.on_close.append(ex.close)

    def _all_hold(self, name: str, value: str, timeout: float) -> bool:
        """Whether every rank holds ``value``: each counts itself under its value, then under the
        arrivals; the last to arrive releases the others. A few store calls per rank at any size."""
        base = f"{self.ns}/{name}"
        mine = f"{base}/v/{value or '-'}"
        self.store.add(mine, 1)  # before the arrival: once all arrived, every count is final
        if self.store.add(f"{base}/n", 1) == self.world_size:
            self.store.set(f"{base}/done", "1")
        self.store.wait([f"{base}/done"], timedelta(seconds=timeout))
        return self.store.add(mine, 0) == self.world_size

    def _close_core(self) -> None:
        """Release what :meth:`_open` acquired, the event log last; safe after a partial start."""
        self._layouts_applied.close()
        with contextlib.ExitStack() as stack:
            if self.events is not None:
                stack.callback(self.events.close)
            wiring = getattr(self, "wiring", None)
            for fn in reversed(wiring.on_close if wiring is not None else []):
                stack.callback(fn)
            if self.group is not None:
                group, self.group = self.group, None
                stack.callback(group.destroy, abort=False)
            if self.heartbeat is not None:
                stack.callback(self.heartbeat.close)
        self.store = None  # type: ignore[assignment]  # release the connection

    def _finished(self, **detail: Any) -> None:
        """Every rank returned: the hooks see the final state, then ``run_finished``."""
        for h in self.hooks:
            h.on_finish(lambda: {k: v for k, v in self.registry.capture().items() if k != RNG})
        self._ev.emit(
            Event.RUN_FINISHED,
            generation=self.generation,
            step=self.step,
            steps_completed=self.cost.steps,
            snapshots=self.cost.snapshots,
            snapshot_interval=self.schedule.interval,
            runtime_ms_per_step=1e3 * self.cost.hook_s / max(1, self.cost.steps),
            engine=self.engine,
            **detail,
        )

    # -- a generation -----------------------------------------------------------------------------
    def _new_group(self, generation: int) -> Group:
        """Build ``generation``'s group; the function's next entry tracks its objects afresh."""
        self.group = self.wiring.build_group(generation, self.ns)
        if self.heartbeat is not None:  # the generation a replacement for this rank would join
            self.heartbeat.generation = generation
        self.registry.clear()
        self._restored = set()
        self._begun = False  # (the entry's first ctx.epochs / ctx.steps over batches begins it)
        self._epochs, self._deferred = None, None
        if self.cfg.collective_check:
            self.fp = CollectiveCount(
                self.store,
                f"{self.ns}/g{generation}/fp",
                self.rank,
                self.world_size,
                getattr(self, "coord", None),
            )
        self._progress, self._stepped = self.clock(), False
        return self.group

    def _fault_detected(self, gen: int, step: int | None, primary: FaultRecord, local: str) -> None:
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
            local=local,
        )

    def _fault_report(self, rec: FaultRecord, *, tb: str | None = None, stacks: str | None = None) -> None:
        """What the rank a fault happened to saw: its traceback, or (a hang) every thread's stack,
        where the main thread was, and how many collectives the group had issued."""
        from resilient.runtime.collective_check import _seq

        where, in_collective = main_thread_where()
        self._ev.emit(
            Event.FAULT_REPORT, generation=rec.generation, step=rec.step, kind=rec.kind,
            signature=rec.signature, message=rec.message, where=where, in_collective=in_collective,
            collectives_issued=_seq(), traceback=tb, stacks=stacks, log=False,
        )  # fmt: skip

    def _check_health(self, gen: int, step: int | None) -> None:
        """The built-in and the caller's checks; a failure is told to the launcher's agent (a node
        that keeps failing them is excluded) and to the peers, then raised."""
        t0 = time.time()
        results = run_checks(
            HealthInput(self.rank, gen, self._health_store(), self.cfg.health), self.extra_checks
        )
        failed = [r for r in results if not r.ok]
        self._ev.emit(
            Event.HEALTH_CHECKED,
            generation=gen,
            step=step,
            ok=not failed,
            duration_s=time.time() - t0,
            checks={r.name: {"ok": r.ok, "value": r.value} for r in results},
        )
        if not failed:
            return
        f = failed[0]
        logger.error("rank {}: health check {!r} failed: value={} ({})", self.rank, f.name, f.value, f.detail)
        if self.launch.heartbeat_dir is not None:
            mark_unhealthy(self.launch.heartbeat_dir, self.local_rank, f.name, f.value, f.detail)
        self._tell_peers(gen, f"health check {f.name!r} failed: {f.value}")
        raise HealthCheckFailed(f.name, f.value, f.detail)

    def _health_store(self) -> dist.Store:
        """The store whose round trip the ``store`` health check times: the one this rank uses."""
        return self.store

    def _tell_peers(self, gen: int, reason: str) -> None:
        """This rank cannot go on in generation ``gen`` (the engine's way to release its peers)."""

    def _prepare_restore(self, step: int, fault_step: int | None, fault_ts: float | None) -> None:
        """The agreed ``step``'s snapshot is loaded into each object as the function tracks it."""
        self.restore_step = step
        self.ddp_layouts.observe(self.registry.objects())  # (the objects of the generation that ended)
        self._layouts_applied.close()
        # DDP rebuilt its buckets after the first step: a rebuilt DDP resumes with them, on every
        # rank or on none (ranks whose buckets differ would add up unrelated gradients)
        same = self._all_hold(f"ddp_layout/g{self.generation}", self.ddp_layouts.digest(), self.t.barrier)
        if step > 0 and same and len(self.ddp_layouts):
            self._layouts_applied.enter_context(self.ddp_layouts.applied())
        self._restore_state = self._materialize(step)
        self.snapshots.drop_after(step)
        self._fault_step, self._fault_ts = fault_step, fault_ts
        self._resume_pending = True

    # -- what Context calls -----------------------------------------------------------------------
    def track(self, objects: dict[str, Any]) -> None:
        for name, obj in objects.items():
            self.registry.add(name, obj)
            if self._restore_state is not None:
                if name not in self._restore_state:
                    raise StateRestoreError(
                        f"{name!r} is tracked now but was not in the snapshot of step {self.restore_step} "
                        f"(snapshot holds {sorted(k for k in self._restore_state if k != RNG)})"
                    )
                self.registry.load(name, self._restore_state[name], owned=self._restore_owned)
                self._restored.add(name)

    def epochs(self, total: int) -> Iterator[int]:
        """Epoch numbers up to ``total``, resuming at the epoch of the restored step. Begins the
        run (a relaunched worker restores here), so an epoch loop's body sees its state."""
        progress = _Epochs()
        self.track({EPOCHS: progress})
        self._epochs = progress
        self._ensure_begun()
        if progress.done:  # restored at an epoch's end: the tracked loaders' next pass is a new one
            for obj in self.registry.objects():
                finish_pass(obj)
        for epoch in range(progress.epoch + progress.done, total):
            progress.epoch, progress.done = epoch, False
            yield epoch
            last, self._deferred = self._deferred, None
            if last is not None:  # the epoch's own code ran: its last step is complete now
                progress.done = True
                self._complete(last, None)
        progress.epoch, progress.done = total, False

    def steps_over(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Each item of ``batches`` is one step; the step count runs on across calls (epochs)."""
        step = self._ensure_begun()
        n = len(batches) if isinstance(batches, Sized) else None  # (a DataLoader: batches per pass)
        pos = getattr(batches, "_resilient_pos", None)  # a tracked loader counts skipped batches too
        for i, item in enumerate(batches):
            self._step_begins(step)
            yield item
            if self._epochs is not None and n is not None and (pos.consumed if pos else i + 1) >= n:
                # an epoch's last batch: its step completes (and may be kept) once the code after
                # the batch loop ran too (ctx.epochs resumes), so that code is never lost to a
                # restore nor run twice
                self._deferred = step
            else:
                self._complete(step, None)
            step += 1
            self._next_step = step

    def _ensure_begun(self) -> int:
        """The next step to run; the first call of a generation begins it (restore or step 0)."""
        if not self._begun:
            self._next_step = self._begin_steps(None)
            self._begun = True
        return self._next_step

    def steps(self, total: int) -> Iterator[int]:
        start = self._begin_steps(total)
        for step in range(start, total):
            self._step_begins(step)
            yield step
            self._complete(step, total)

    def _step_begins(self, step: int) -> None:
        self.step = step
        self.registry.step_begins()
        if self.heartbeat is not None:  # the step a hard fault hits, exactly, for the agent
            self.heartbeat.beat(step)
        if self.fp is not None:
            self.fp.begin(step)
        if self.hooks:
            objects = self.registry.objects()
            for h in self.hooks:
                h.before_step(step, objects)

    def _begin_steps(self, total: int | None) -> int:
        self._layouts_applied.close()  # (every tracked DDP is built by now)
        if self._restore_state is None:
            return self._fresh_start(total)
        return self._resume_restored()

    def _fresh_start(self, total: int | None) -> int:
        """The first entry: snapshot the initial state as step 0."""
        self.snapshots.capture(0, self.registry.capture())
        return 0

    def _resume_restored(self) -> int:
        """At ``ctx.steps`` after a restart: every object of the snapshot was tracked again and
        loaded; the RNGs are restored last, and the step to resume at is returned."""
        assert self._restore_state is not None
        self._layouts_applied.close()
        missing = [n for n in self._restore_state if n != RNG and n not in self._restored]
        if missing:
            raise StateRestoreError(f"tracked before the fault but not after the restart: {missing}")
        restore_rng(self._restore_state[RNG])
        step = self.restore_step
        assert step is not None
        self._ev.emit(
            Event.STATE_RESTORED,
            generation=self.generation,
            step=step,
            objects=sorted(self._restored),
            steps_rerun=(self._fault_step if self._fault_step is not None else step) - step,
            since_fault_s=time.time() - (self._fault_ts or time.time()),
            snapshot_interval=self.schedule.interval,
        )
        self._restore_state = None
        self.step = step
        return step

    def _complete(self, step: int, total: int | None) -> None:
        now = self.clock()
        step_s = now - self._progress if self._stepped else None
        self._progress, self._stepped = now, True
        self._on_step(step)
        nxt = step + 1
        capture_s = None
        state: dict[str, Any] | None = None
        fp = self.fp
        if fp is not None and fp.pending is not None:  # the last kept snapshot, verified now
            self._verified(fp.settle, False)
        ring_due = self.schedule.due(nxt, total)
        leaves = self._mirror_due(nxt, total) or nxt == total  # (the last: returned to the caller)
        if ring_due or leaves:
            if fp is not None:  # every rank issued the same collectives, or nothing is kept
                # state that leaves the process is verified first; the ring's, at the next step
                self._verified(fp.check if leaves else fp.close_window, step)
            state = self.registry.capture()
            if self.ddp_layouts.observe(self.registry.objects()) and self.run_dir is not None:
                with contextlib.suppress(OSError):  # (a relaunched worker then starts as DDP did)
                    self.ddp_layouts.dump(self.run_dir / DDP_BUCKETS)
            if ring_due:
                self.snapshots.capture(nxt, state)
                capture_s = self.clock() - now
        self.schedule.observe(nxt, step_s, capture_s)
        if self.cfg.events.steps:
            self._ev.emit(
                Event.STEP_COMPLETED, generation=self.generation, step=step, step_s=step_s, log=False
            )
        for h in self.hooks:
            h.after_step(self.generation, step, step_s)
        self._after_snapshot(step, nxt, total, state, step_s, now)
        self.cost.steps += 1
        self.cost.snapshots += capture_s is not None
        self.cost.hook_s += self.clock() - now
        last = self._progress_at
        if last is None or now - last[0] >= self.cfg.events.progress_s:
            self._progress_at = (now, self.cost.steps)
            self._ev.emit(
                Event.PROGRESS, generation=self.generation, step=step, first=last is None,
                steps_completed=self.cost.steps,
                step_s=None if last is None else (now - last[0]) / max(1, self.cost.steps - last[1]),
                runtime_ms_per_step=1e3 * self.cost.hook_s / self.cost.steps,
                snapshot_interval=self.schedule.interval, log=False,
            )  # fmt: skip
        if self._resume_pending:
            self._resume_pending = False
            self._ev.emit(
                Event.STEP_RESUMED,
                generation=self.generation,
                step=step,
                since_fault_s=time.time() - (self._fault_ts or time.time()),
            )

    def _own_setup_error(self, exc: BaseException) -> BaseException:
        """The user's exception raised before this rank's first step, to be raised as itself
        (its own type and traceback) once every rank knows: nothing to restore, not retried.
        The process then ends with ``FATAL``, the exit code of an error a relaunch repeats."""
        exc.add_note(
            f"resilient: rank {self.rank} raised this before its first step; there is no state to "
            f"restore and a retry would repeat it (exit code {int(ExitCode.FATAL)}, not relaunched)"
        )
        exc._resilient_exit_code = ExitCode.FATAL  # type: ignore[attr-defined]
        return exc

    def _verified(self, compare: Callable[[Any], Any], arg: Any) -> None:
        """Run a comparison of collective counts; on a desync, the snapshot kept after the
        window that differs is dropped before the fault is raised."""
        try:
            compare(arg)
        except CollectiveDesync as e:
            self.snapshots.drop_after(e.window_end)
            raise

    def _settle_at_end(self) -> None:
        """The function returned (perhaps leaving ``ctx.steps`` early): no unverified state may
        stand as its result."""
        fp = self.fp
        if fp is not None and fp.pending is not None:
            self._verified(fp.settle, True)

    def _settle_before_restore(self) -> None:
        """A fault came while the newest snapshot was unverified: compare now if the neighbour's
        count is there, else drop that snapshot (nothing proves it good)."""
        fp = self.fp
        if fp is None or fp.pending is None:
            return
        end = fp.pending
        try:
            if fp.settle(block=False):
                return
        except CollectiveDesync:
            pass
        except Exception as e:  # the store may be what failed: no proof either way
            logger.debug("rank {}: collective count not compared: {}", self.rank, e)
        self.snapshots.drop_after(end)

    def _materialize(self, step: int) -> dict[str, Any]:
        """A fresh copy of the state of ``step``, one of the steps this rank offered to restore."""
        self._restore_owned = True
        return self.snapshots.materialize(step)

    def _ring_share(self) -> float:
        """The in-memory ring's part of the snapshot budget (the rest: the engine's mirror)."""
        return 1.0

    def _on_step(self, step: int) -> None:
        """``step`` completed (before anything is captured)."""

    def _mirror_due(self, nxt: int, total: int | None) -> bool:
        """Whether the engine keeps the state after ``nxt`` steps somewhere besides the ring."""
        return False

    def _after_snapshot(
        self,
        step: int,
        nxt: int,
        total: int | None,
        state: dict[str, Any] | None,
        step_s: float | None,
        now: float,
    ) -> None:
        """After the ring's snapshot (``state``: what was captured, if anything was)."""
