"""``engine: nvrx``: the decorated function runs under NVRx's in-process ``Wrapper``.

For users on clusters that already run NVIDIA Resiliency Extension: NVRx owns detection (its
monitor thread and monitor process, soft/hard timeouts, rank heartbeats), the abort, the
restart barriers and the retry budget; this engine keeps what the function sees the same as under
``engine: resilient`` — ``ctx.track`` / ``ctx.steps``, the in-memory snapshot ring, the agreed
restore of every tracked object and RNG, and the event log the certificate reads.

Per NVRx restart iteration ``i`` (= ``ctx.generation``):

    group built on <ns>/g<i>  →  (i > 0) agree the newest snapshot every rank holds, restore it
    →  fn()  →  every completed step: ping NVRx's progress watchdog, snapshot when due

Mapping of the configuration (one knob, as in the native engine): ``hang_timeout`` → NVRx
``soft_timeout``; the derived hard/barrier timeouts → ``hard_timeout`` / ``barrier_timeout`` /
``completion_timeout``; ``restart.max_restarts`` → ``RetryController(max_iterations)``; our
restart policy (same fault at the same step ``max_repeats`` times) runs in NVRx's ``initialize``
and ends the run with :class:`~resilient.errors.FaultRepeats`; the built-in health checks run as
NVRx's ``health_check``.

gloo: NVRx's ``AbortTorchDistributed`` destroys the group, which does not wake a peer blocked in
a gloo collective (torch 2.13). The abort here first shuts down the group's peer sockets (as the
native engine does), so a blocked all-reduce fails at once instead of waiting out its timeout.

Not wired under this engine: durable checkpoints (``checkpoint.dir``; configuring it is an error
that says so) and the shared-memory snapshot of ``resilient launch``: a hard fault restarts the
job from step 0. The per-step collective count check runs as under the native engine; a rank left
waiting in a collective its peer skipped is interrupted by NVRx's soft timeout and the fault is
diagnosed as a desync from the counts.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from loguru import logger

from resilient.config import Config
from resilient.errors import ConfigError, ResilienceError, RestartBudgetExhausted, StateRestoreError
from resilient.events import Event, EventLog
from resilient.launcher.heartbeat import Heartbeat, die_with_launcher
from resilient.runtime import coordinator as coord_mod
from resilient.runtime.faults import FaultKind, FaultRecord, Severity
from resilient.runtime.fingerprint import CollectiveCount
from resilient.runtime.health import Check, HealthInput, run_checks
from resilient.runtime.pg import Group, build_group, resolve_backend
from resilient.runtime.policy import RestartPolicy
from resilient.runtime.schedule import SnapshotSchedule
from resilient.runtime.tracking import Tracking
from resilient.state import Registry, SnapshotRing

S = datetime.timedelta


def wrapper_kwargs(cfg: Config) -> dict[str, Any]:
    """NVRx ``Wrapper`` timing arguments derived from ours (NVRx requires soft < hard < barrier,
    every interval below the soft timeout, heartbeat interval < heartbeat timeout < barrier)."""
    t = cfg.timeouts
    tick = min(1.0, t.hang / 8.0)
    return {
        "soft_timeout": S(seconds=t.hang),
        "hard_timeout": S(seconds=t.hard),
        "barrier_timeout": S(seconds=t.barrier),
        "completion_timeout": S(seconds=t.barrier),
        "heartbeat_timeout": S(seconds=t.hard),
        "heartbeat_interval": S(seconds=min(1.0, t.hard / 4.0)),
        "monitor_thread_interval": S(seconds=tick),
        # NVRx's monitor process checks the timeouts only when its queue stays empty for this
        # long; the progress watchdog posts a timestamp every `progress_watchdog_interval`, so with
        # equal intervals the check can starve (a sleep hang then goes unnoticed until a
        # collective times out). Half the watchdog's interval keeps it running.
        "monitor_process_interval": S(seconds=tick / 2),
        "progress_watchdog_interval": S(seconds=tick),
        "last_call_wait": S(seconds=min(1.0, t.hang / 20.0)),
        "termination_grace_time": S(seconds=min(5.0, t.hard)),
    }


class NvrxRuntime(Tracking):
    """Engine behind ``resilient.wrap(engine="nvrx")``; the same surface :class:`Context` uses."""

    def __init__(self, cfg: Config, checks: Sequence[Check] = ()) -> None:
        if cfg.checkpoint.dir is not None:
            raise ConfigError(
                "engine: nvrx does not write durable checkpoints (checkpoint.dir is set): use "
                "engine: resilient, or NVRx's own checkpointing beside this engine"
            )
        self.cfg = cfg
        self.t = cfg.timeouts
        self.extra_checks = tuple(checks)
        self.ep = coord_mod.endpoint_from_env()
        self.rank, self.world_size, self.local_rank = self.ep.rank, self.ep.world_size, self.ep.local_rank
        self.backend = resolve_backend(cfg.backend)
        self.device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.generation = 0
        self.step: int | None = None
        self.restore_step: int | None = None
        self.registry = Registry()
        self.snapshots = SnapshotRing()
        self.policy = RestartPolicy(cfg.restart)
        self.group: Group | None = None
        self.events: EventLog | None = None
        self.run_dir: Any = None
        self._restore_state: dict[str, Any] | None = None
        self._restored: set[str] = set()
        self._fault: FaultRecord | None = None
        self._resume_pending = False
        self._cw: Any = None
        self._chaos: Any = None
        self.heartbeat: Heartbeat | None = None
        self.fp: CollectiveCount | None = None  # this iteration's per-step collective counts
        self._t_step: float | None = None
        self._fault_step: int | None = None
        self._fault_ts = 0.0
        self._signal: signal.Signals | None = None
        self._in_fn: int | None = None  # the iteration whose training function is running
        self._aborted: tuple[int, float] = (-1, 0.0)  # (iteration, time) NVRx's abort last ran

    @property
    def _ev(self) -> EventLog:
        assert self.events is not None
        return self.events

    # -- setup ------------------------------------------------------------------------------------
    def _start(self) -> None:
        from resilient.runtime.engine import _chaos_from_env

        self.store = coord_mod.connect(self.ep, self.t.barrier)
        self.store_port = self.store.port
        self.run_id = coord_mod.agree_run_id(self.store)
        # NVRx's monitor thread runs the abort: it gets a store connection of its own
        self.monitor_store = coord_mod.client(self.ep.host, self.store_port, self.t.barrier)
        # the launch attempt: after a relaunch the agent's store still holds the dead attempt's keys
        attempt = os.environ.get("RESILIENT_LAUNCH_ROUND") or os.environ.get(
            "TORCHELASTIC_RESTART_COUNT", "0"
        )
        self.ns = f"resilient/{self.run_id}/nvrx/a{attempt}"
        self.nvrx_port = self._nvrx_store_port()
        self.schedule = SnapshotSchedule(
            self.cfg.snapshot, self.rank, self.store, f"{self.ns}/snapshot_interval"
        )
        self.run_dir = self.cfg.events.dir / self.run_id
        self.events = EventLog(self.run_dir / "events.jsonl", self.rank)
        self._chaos = _chaos_from_env()
        if os.environ.get("RESILIENT_STEP_EVENTS") == "1":  # a certificate's timeline
            events_cfg = self.cfg.events.model_copy(update={"steps": True})
            self.cfg = self.cfg.model_copy(update={"events": events_cfg})
        # under `resilient launch`: its agent watches this heartbeat (a stopped or GIL-bound
        # process stops it; NVRx handles the Python-level hangs in-process meanwhile)
        die_with_launcher()
        self.heartbeat = Heartbeat.from_env()
        if self.heartbeat is not None:
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
            engine="nvrx",
        )

    def _nvrx_store_port(self) -> int:
        """NVRx keeps its barriers and records in a store of its own, with no namespace for the
        launch attempt: a relaunched job meeting the previous attempt's keys fails NVRx's initial
        barrier. Each attempt gets a fresh NVRx store, hosted by rank 0 on a free port it posts."""
        key = f"{self.ns}/nvrx_store_port"
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            self.store.set(key, str(port))
            return port
        return int(self.store.get(key))

    def _wrapper(self, inprocess: Any) -> Any:
        rt = self

        class Unblock(inprocess.abort.Abort):
            """Wake a main thread blocked in a gloo collective (destroying the group does not) or
            in a sleep (NVRx's asynchronous exception is only delivered when the main thread runs
            Python code: the interrupt signal's no-op handler is such code)."""

            def __call__(self, state: Any) -> Any:
                rt._aborted = (rt.generation, time.time())
                rt._post_diagnosis()  # before the group is gone: it reads the group's sequence number
                group = rt.group
                if group is not None:
                    group.abort()
                rt._nudge()
                return state

        class Admit(inprocess.initialize.Initialize):
            """Our restart policy at the start of every restart iteration: a fault that repeats at
            the same step ends the run, diagnosed, instead of looping."""

            def __call__(self, state: Any) -> Any:
                if state.iteration > 0:
                    fault = rt._previous_fault(state.iteration - 1)
                    try:
                        rt.policy.admit(fault)
                    except RestartBudgetExhausted as e:
                        rt._verdict = e
                        raise inprocess.exception.RestartAbort(str(e)) from e
                return state

        class Checks(inprocess.health_check.HealthCheck):
            def __call__(self, state: Any) -> Any:
                if state.iteration > 0:
                    rt._check_health(state.iteration - 1)
                return state

        abort = inprocess.Compose(inprocess.abort.AbortTorchDistributed(), Unblock())
        initialize = inprocess.Compose(
            Admit(), inprocess.initialize.RetryController(max_iterations=self.cfg.restart.max_restarts + 1)
        )
        logfile = self.run_dir / f"nvrx_monitor_{self.rank}.log"
        return inprocess.Wrapper(
            store_factory=inprocess.store.TCPStore,
            store_kwargs={
                "host_name": self.ep.host,
                "port": self.nvrx_port,
                "timeout": S(seconds=self.t.barrier),
            },
            initialize=initialize,
            abort=abort,
            health_check=Checks(),
            monitor_process_logfile=str(logfile.absolute()),
            **wrapper_kwargs(self.cfg),
        )

    # -- the run ----------------------------------------------------------------------------------
    def run(self, fn: Callable[[], Any]) -> Any:
        try:
            import nvidia_resiliency_ext.inprocess as inprocess
        except ImportError as e:
            raise ConfigError(f"engine: nvrx needs nvidia-resiliency-ext importable: {e}") from e
        self._verdict: ResilienceError | None = None
        self._start()
        self._install_interrupt()
        wrapped = self._wrapper(inprocess)

        def attempt(call_wrapper=None):
            return self._attempt(fn, call_wrapper)

        # NVRx passes its CallWrapper to the parameter annotated Optional[CallWrapper]; postponed
        # annotations are strings here, so the real type is set explicitly
        attempt.__annotations__ = {"call_wrapper": Optional[inprocess.CallWrapper]}  # noqa: UP045
        try:
            result = wrapped(attempt)()
            self._save_final_state()
            self._ev.emit(
                Event.RUN_FINISHED,
                generation=self.generation,
                step=self.step,
                snapshot_interval=self.schedule.interval,
                engine="nvrx",
            )
            return result
        except BaseException as e:  # NVRx's RestartAbort is one; recorded, then raised on
            err = self._verdict or e
            self._ev.emit(Event.RUN_FAILED, generation=self.generation, step=self.step, error=str(err))
            if self._verdict is not None:
                raise self._verdict from e
            raise
        finally:
            self._close()  # the event log last: run_finished / run_failed are written first

    def _install_interrupt(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._signal = signal.Signals[self.cfg.interrupt_signal]
            signal.signal(self._signal, lambda *_: None)  # running it delivers NVRx's pending exception

    def _nudge(self) -> None:
        """From NVRx's monitor thread, just before it raises in the main thread: signal the main
        thread every 50 ms until it has left the training function (the first signal may come
        before the exception is set)."""
        if self._signal is None or self._in_fn is None:
            return
        gen, main = self._in_fn, threading.main_thread().ident
        assert main is not None

        def repeat() -> None:
            deadline = time.monotonic() + self.t.hard
            while self._in_fn == gen and time.monotonic() < deadline:
                signal.pthread_kill(main, self._signal)  # type: ignore[arg-type]
                time.sleep(0.05)

        threading.Thread(target=repeat, name="resilient-nvrx-nudge", daemon=True).start()

    def _close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self._signal is not None:
            signal.signal(self._signal, signal.SIG_DFL)
        if self.group is not None:
            self.group.destroy(abort=False)
            self.group = None
        if self.events is not None:
            self.events.close()
        self.store = self.monitor_store = None  # type: ignore[assignment]

    def _attempt(self, fn: Callable[[], Any], cw: Any) -> Any:
        it = cw.iteration
        self._cw = cw
        t0 = time.time()
        if it > 0:
            gc.collect()  # the failed iteration's model, DDP and group, in order, not at exit
        self.generation = it
        self.group = build_group(
            backend=self.backend,
            store=self.store,
            store_port=self.store_port,
            rank=self.rank,
            world_size=self.world_size,
            generation=it,
            timeout=self.t.collective,
            device_id=self.device if self.backend == "nccl" else None,
            namespace=self.ns,
        )
        if it > 0:
            self._prepare_restore(it, t0)
        if self.cfg.collective_check:
            self.fp = CollectiveCount(self.store, f"{self.ns}/g{it}/fp", self.rank, self.world_size)
        self.registry.clear()
        self._restored = set()
        self._t_step = None
        self._in_fn = it
        try:
            return fn()
        except BaseException as exc:  # NVRx's interrupt (RankShouldRestart) is one; always re-raised
            self._in_fn = None
            # a fault of its own, not NVRx's interrupt nor what the abort did to this rank
            if type(exc).__name__ != "RankShouldRestart" and self._aborted[0] != it:
                rec = FaultRecord.from_exception(exc, rank=self.rank, generation=it, step=self.step)
                if rec.kind == FaultKind.COLLECTIVE.value:  # timed out waiting for a skipped one?
                    rec = self._desync(self.store) or rec
                self.store.compare_set(f"{self.ns}/g{it}/fault", "", rec.to_json())
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            self._in_fn = None
            self.group = None  # NVRx's abort destroyed it (or it finished); the next gc frees it

    def _previous_fault(self, gen: int) -> FaultRecord:
        """The first fault any rank posted for iteration ``gen``; a hang posts none (NVRx's soft
        timeout interrupted every rank), so it is recorded as one at the step this rank was in."""
        if self._fault is not None and self._fault.generation == gen:
            return self._fault
        key = f"{self.ns}/g{gen}/fault"
        raw = self.store.get(key) if self.store.check([key]) else b""
        if raw:
            rec = FaultRecord.from_json(raw)
        else:  # NVRx interrupted every rank before any raised: its progress timeout (a hang)
            aborted = self._aborted[1] if self._aborted[0] == gen else time.time()
            rec = FaultRecord(
                rank=-1, generation=gen, step=self.step, kind=FaultKind.HANG.value,
                severity=Severity.SOFT.value, signature="hang: NVRx soft timeout",
                message="no rank raised: NVRx's progress timeout interrupted the ranks", ts=aborted,
            )  # fmt: skip
        self._fault = rec
        return rec

    def _post_diagnosis(self) -> None:
        """From NVRx's monitor thread, at the abort: a rank waiting in a collective that its
        neighbour finished the step without (fewer collectives counted) posts a desync record,
        so every rank restarts knowing the cause instead of "no progress"."""
        if self._in_fn is None:
            return
        rec = self._desync(self.monitor_store)
        if rec is not None:
            with contextlib.suppress(Exception):
                self.monitor_store.compare_set(f"{self.ns}/g{rec.generation}/fault", "", rec.to_json())

    def _desync(self, store: dist.Store) -> FaultRecord | None:
        """A desync record if this rank waits in a collective its neighbour finished the step
        without (fewer collectives counted), else None. Needs the group: before the abort."""
        if self.fp is None:
            return None
        try:
            why = self.fp.diagnose(store)
        except Exception as e:  # no diagnosis: the fault stays what it looked like
            logger.debug("rank {}: no desync diagnosis: {}", self.rank, e)
            return None
        if why is None:
            return None
        return FaultRecord(
            rank=self.rank, generation=self.generation, step=self.fp.step, kind=FaultKind.DESYNC.value,
            severity=Severity.SOFT.value, signature="desync: collective count", message=why,
        )  # fmt: skip

    def _check_health(self, gen: int) -> None:
        results = run_checks(HealthInput(self.rank, gen, self.store, self.cfg.health), self.extra_checks)
        failed = [r for r in results if not r.ok]
        self._ev.emit(
            Event.HEALTH_CHECKED,
            generation=gen,
            step=self.step,
            ok=not failed,
            checks={r.name: {"ok": r.ok, "value": r.value} for r in results},
        )
        if failed:
            f = failed[0]
            raise RuntimeError(f"health check {f.name!r} failed: value={f.value} ({f.detail})")

    def _prepare_restore(self, it: int, t0: float) -> None:
        primary = self._previous_fault(it - 1)
        self._ev.emit(
            Event.FAULT_DETECTED,
            generation=it - 1,
            step=self.step,
            kind=primary.kind,
            signature=primary.signature,
            origin_rank=primary.rank,
            origin_step=primary.step,
            origin_ts=primary.ts,
            origin_latency_s=primary.latency_s,
            local="nvrx restart iteration",
        )
        self._ev.emit(Event.GROUP_REBUILT, generation=it, step=None, duration_s=time.time() - t0)
        held: list[list[int]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(held, self.snapshots.steps())
        common = set(held[0]).intersection(*map(set, held[1:]))
        if not common:
            raise StateRestoreError(f"no snapshot step held by every rank: {held}")
        self.restore_step = max(common)
        self.snapshots.drop_after(self.restore_step)
        self._restore_state = self.snapshots.materialize(self.restore_step)
        self._fault_step, self._fault_ts = self.step, primary.ts
        self._resume_pending = True

    # -- what Context calls -----------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        start = self._begin(total)
        for step in range(start, total):
            self.step = step
            if self.fp is not None:
                self.fp.begin(step)
            if self._chaos is not None:
                for where in ("step", "before_collective"):
                    self._chaos.maybe_fire(self.rank, step, where, objects=self.registry.objects())
            yield step
            self._complete(step, total)

    def _begin(self, total: int) -> int:
        if self._restore_state is None:
            self.snapshots.capture(0, self.registry.capture())
            return 0
        return self._resume_restored()

    def _complete(self, step: int, total: int) -> None:
        if self.fp is not None:  # every rank issued the same collectives, or nothing is captured
            self.fp.check(step)
        if self._cw is not None:
            self._cw.ping()  # NVRx's progress timeout starts with the first ping of an iteration
        now = time.monotonic()
        step_s = now - self._t_step if self._t_step is not None else None
        self._t_step = now
        if self.cfg.events.steps:
            self._ev.emit(
                Event.STEP_COMPLETED, generation=self.generation, step=step, step_s=step_s, log=False
            )
        nxt = step + 1
        capture_s = None
        if self.schedule.due(nxt, total):
            self.snapshots.capture(nxt, self.registry.capture())
            capture_s = time.monotonic() - now
        self.schedule.observe(nxt, step_s, capture_s)
        if self._resume_pending:
            self._resume_pending = False
            self._ev.emit(
                Event.STEP_RESUMED,
                generation=self.generation,
                step=step,
                since_fault_s=time.time() - (self._fault_ts or time.time()),
            )
            logger.info(
                "rank {}: resumed under NVRx at step {} (iteration {})", self.rank, step, self.generation
            )
