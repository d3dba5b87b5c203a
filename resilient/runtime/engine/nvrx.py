"""``engine: nvrx``: the decorated function runs under NVRx's in-process ``Wrapper``.

For users on clusters that already run NVIDIA Resiliency Extension: NVRx owns detection (its
monitor thread and monitor process, soft/hard timeouts, rank heartbeats), the abort, the
restart barriers and the retry budget; this engine keeps what the function sees the same as under
``engine: resilient`` — ``ctx.track`` / ``ctx.steps``, the in-memory snapshot ring, the agreed
restore of every tracked object and RNG, and the event log the certificate reads.

Per NVRx restart iteration ``i`` (= ``ctx.generation``):

    group built on <ns>/g<i>  →  (i > 0) agree the newest snapshot every rank holds, restore it
    →  fn()  →  every completed step: ping NVRx's progress watchdog, snapshot when due

Mapping of the configuration (one knob, as in the built-in engine): ``hang_timeout`` → NVRx
``soft_timeout``; the derived hard/barrier timeouts → ``hard_timeout`` / ``barrier_timeout`` /
``completion_timeout``; ``restart.max_recoveries`` → ``RetryController(max_iterations)``; our
restart policy (same fault at the same step ``max_repeats`` times) runs in NVRx's ``initialize``
and ends the run with :class:`~resilient.errors.FaultRepeats`; the built-in health checks run as
NVRx's ``health_check``.

gloo: NVRx's ``AbortTorchDistributed`` destroys the group, which does not wake a peer blocked in
a gloo collective (torch 2.13). The abort here first shuts down the group's peer sockets (as the
built-in engine does), so a blocked all-reduce fails at once instead of waiting out its timeout.

Not wired under this engine: durable checkpoints (``checkpoint.dir``; configuring it is an error
that says so) and the shared-memory snapshot of ``resilient launch``: a hard fault restarts the
job from step 0. The per-step collective count check runs as under the built-in engine; a rank left
waiting in a collective its peer skipped is interrupted by NVRx's soft timeout and the fault is
diagnosed as a desync from the counts.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist
from loguru import logger

from resilient.config import Config
from resilient.contract import die_with_launcher
from resilient.errors import ConfigError, ResilienceError, RestartBudgetExhausted, SetupFailed
from resilient.events import Event
from resilient.runtime.coordination import pg
from resilient.runtime.coordination.agreement import common_restore_step
from resilient.runtime.faults.records import FaultRecord, Severity, Symptom
from resilient.runtime.faults.stacks import main_thread_where
from resilient.runtime.recovery.policy import RestartPolicy
from resilient.runtime.run.session import Session
from resilient.runtime.run.wiring import Setup, WiringFactory, wire
from resilient.runtime.steps.keeper import RingOnly
from resilient.runtime.steps.loop import StepLoop
from resilient.state import SnapshotRing

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


class NvrxEngine:
    """Engine behind ``resilient.wrap(engine="nvrx")``: ``run(fn)`` calls ``fn(loop)`` once per
    NVRx restart iteration, as the built-in engine does once per generation."""

    name = "nvrx"

    def __init__(self, setup: Setup, *, wiring: WiringFactory = wire) -> None:
        if setup.cfg.checkpoint.dir is not None:
            raise ConfigError(
                "engine: nvrx does not write durable checkpoints (checkpoint.dir is set): use "
                "engine: resilient, or NVRx's own checkpointing beside this engine"
            )
        self.inprocess = nvrx_inprocess()
        self.setup = setup
        self._wire = wiring

    def run(self, fn: Callable[[StepLoop], Any]) -> Any:
        inprocess = self.inprocess
        die_with_launcher(self.setup.launch.launcher_pid)
        w = self._wire(self.setup)
        session = Session(self.setup, w, engine=self.name, namespace="nvrx/")
        # NVRx's monitor thread runs the abort: it gets a store connection of its own
        return NvrxRun(session, w.side_store(session.t.barrier)).run(fn, inprocess)


def nvrx_inprocess() -> Any:
    """NVRx's in-process module, from the ``nvrx`` extra; its absence is a one-line error naming it."""
    try:
        import nvidia_resiliency_ext.inprocess as inprocess
    except ImportError as e:
        raise ConfigError(
            f"engine: nvrx needs nvidia-resiliency-ext ({e}): pip install 'resilient[nvrx]'"
        ) from None
    return inprocess


class NvrxRun:
    """One run under NVRx's ``Wrapper``: the session, the step loop (the ring alone keeps
    snapshots), our restart policy and health checks as NVRx strategies."""

    def __init__(self, session: Session, monitor_store: dist.Store) -> None:
        self.session = s = session
        self.t = s.t
        self.ring = SnapshotRing()
        self.groups = pg.GroupOwner(lambda generation: s.wiring.build_group(generation, s.ns))
        self.loop = StepLoop(s, RingOnly(self.ring), self.ring, liveness=self._ping, groups=self.groups)
        self.policy = RestartPolicy(s.cfg.restart)
        self.monitor_store = monitor_store
        self.nvrx_port = -1  # NVRx's own store, hosted by rank 0 (see _nvrx_store_port)
        self._verdict: ResilienceError | None = None
        self._fault: FaultRecord | None = None
        self._cw: Any = None
        self._signal: signal.Signals | None = None
        self._in_fn: int | None = None  # the iteration whose training function is running
        self._aborted: tuple[int, float] = (-1, 0.0)  # (iteration, time) NVRx's abort last ran

    # -- setup ------------------------------------------------------------------------------------
    def _start(self) -> None:
        s = self.session
        s.open(lambda: self.loop.step)
        self.loop.start(joining=s.launch.join_generation is not None)
        self.nvrx_port = self._nvrx_store_port()
        pg.protect_store_port(self.nvrx_port)  # NVRx's monitor opens store clients while groups are built

    def _nvrx_store_port(self) -> int:
        """NVRx keeps its barriers and records in a store of its own, with no namespace for the
        launch attempt: a relaunched job meeting the previous attempt's keys fails NVRx's initial
        barrier. Each attempt gets a fresh NVRx store, hosted by rank 0 on a free port it posts."""
        s = self.session
        key = f"{s.ns}/nvrx_store_port"
        if s.rank == 0:
            with socket.socket() as sock:
                sock.bind(("", 0))
                port = sock.getsockname()[1]
            s.store.set(key, str(port))
            return port
        return int(s.store.get(key))

    def _wrapper(self, inprocess: Any) -> Any:
        rt, s = self, self.session

        class Unblock(inprocess.abort.Abort):
            """Wake a main thread blocked in a gloo collective (destroying the group does not) or
            in a sleep (NVRx's asynchronous exception is only delivered when the main thread runs
            Python code: the interrupt signal's no-op handler is such code)."""

            def __call__(self, state: Any) -> Any:
                rt._aborted = (rt.session.generation, time.time())
                rt._post_diagnosis()  # before the group is gone: it reads the group's sequence number
                rt.groups.abort()
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
                    s = rt.session
                    s.checkup.run(state.iteration - 1, rt.loop.step, s.store, lambda gen, why: None)
                return state

        abort = inprocess.Compose(inprocess.abort.AbortTorchDistributed(), Unblock())
        initialize = inprocess.Compose(
            Admit(), inprocess.initialize.RetryController(max_iterations=s.cfg.restart.max_recoveries + 1)
        )
        logfile = s.run_dir / f"nvrx_monitor_{s.rank}.log"
        return inprocess.Wrapper(
            store_factory=inprocess.store.TCPStore,
            store_kwargs={
                "host_name": s.launch.endpoint.host,
                "port": self.nvrx_port,
                "timeout": S(seconds=self.t.barrier),
            },
            initialize=initialize,
            abort=abort,
            health_check=Checks(),
            monitor_process_logfile=str(logfile.absolute()),
            **wrapper_kwargs(s.cfg),
        )

    # -- the run ----------------------------------------------------------------------------------
    def run(self, fn: Callable[[StepLoop], Any], inprocess: Any) -> Any:
        s = self.session
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
            self.loop.finished()
            return result
        except BaseException as e:  # NVRx's RestartAbort is one; recorded, then raised on
            err = self._verdict or e
            s.events.emit(Event.RUN_FAILED, generation=s.generation, step=self.loop.step, error=str(err))
            if self._verdict is not None:
                raise self._verdict from e
            raise
        finally:
            self._close()  # the event log last: run_finished / run_failed are written first

    def _install_interrupt(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._signal = signal.Signals[self.session.cfg.interrupt_signal]
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
        if self._signal is not None:
            signal.signal(self._signal, signal.SIG_DFL)
        self.loop.close()
        self.session.close()  # the event log last: run_finished / run_failed are written first
        self.monitor_store = None  # type: ignore[assignment]  # release the connection

    def _attempt(self, fn: Callable[[StepLoop], Any], cw: Any) -> Any:
        s, loop = self.session, self.loop
        it = cw.iteration
        self._cw = cw
        t0 = time.time()
        if it > 0:
            gc.collect()  # the failed iteration's model, DDP and group, in order, not at exit
        s.generation = it
        if it > 0:
            loop.restorer.settle()  # the failed iteration's counts, before they are replaced
        loop.begin_generation(it, None)
        if it > 0:
            try:
                self._restore_agreed(it, t0)
            except SetupFailed as e:  # nothing to restore: not a fault to restart from
                from nvidia_resiliency_ext.inprocess.exception import RestartAbort

                self._verdict = e
                raise RestartAbort(str(e)) from e
        self._in_fn = it
        try:
            result = fn(loop)
            loop.settle_at_end()
            return result
        except BaseException as exc:  # NVRx's interrupt (RankShouldRestart) is one; always re-raised
            self._in_fn = None
            # a fault of its own, not NVRx's interrupt nor what the abort did to this rank
            if type(exc).__name__ != "RankShouldRestart" and self._aborted[0] != it:
                rec = FaultRecord.from_exception(exc, rank=s.rank, generation=it, step=loop.step)
                if rec.kind == Symptom.COLLECTIVE.value:  # timed out waiting for a skipped one?
                    rec = self._desync(s.store) or rec
                # a collective that timed out is a victim's view: the peer it waited for may be
                # the one that hangs, and that rank's record (posted at NVRx's abort) comes first
                weak = rec.kind == Symptom.COLLECTIVE.value
                s.store.compare_set(self._fault_key(it, weak), "", rec.to_json())
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            self._in_fn = None
            self.groups.forget()  # NVRx's abort destroyed it (or it finished); the next gc frees it

    def _previous_fault(self, gen: int) -> FaultRecord:
        """The first fault any rank posted for iteration ``gen``; a hang posts none (NVRx's soft
        timeout interrupted every rank), so it is recorded as one at the step this rank was in."""
        if self._fault is not None and self._fault.generation == gen:
            return self._fault
        raw = b""
        store = self.session.store
        for key in (self._fault_key(gen, weak=False), self._fault_key(gen, weak=True)):
            if store.check([key]):
                raw = store.get(key)
                break
        if raw:
            rec = FaultRecord.parse(raw, gen)
        else:  # NVRx interrupted every rank before any raised: its progress timeout (a hang)
            aborted = self._aborted[1] if self._aborted[0] == gen else time.time()
            rec = FaultRecord(
                rank=-1,
                generation=gen,
                step=self.loop.step,
                kind=Symptom.HANG.value,
                severity=Severity.SOFT.value,
                signature="hang: NVRx soft timeout",
                message="no rank raised: NVRx's progress timeout interrupted the ranks",
                ts=aborted,
            )
        self._fault = rec
        return rec

    def _fault_key(self, gen: int, weak: bool) -> str:
        """Where iteration ``gen``'s fault is posted; the first post wins. A weak record (a victim's
        collective timeout) is read only when no rank posted a strong one."""
        return f"{self.session.ns}/g{gen}/fault" + ("/weak" if weak else "")

    def _post_diagnosis(self) -> None:
        """From NVRx's monitor thread, at the abort, so every rank restarts knowing the cause:
        a rank waiting in a collective that its neighbour finished without (fewer collectives
        counted) posts a desync; a rank that made no progress for the hang timeout outside any
        collective (in its own code: the culprit, not a victim) posts a hang."""
        if self._in_fn is None:
            return
        rec = self._desync(self.monitor_store) or self._own_hang()
        if rec is not None:
            with contextlib.suppress(Exception):
                self.monitor_store.compare_set(self._fault_key(rec.generation, weak=False), "", rec.to_json())

    def _own_hang(self) -> FaultRecord | None:
        s, gen = self.session, self.loop.gen
        idle = s.clock() - gen.progress
        limit = self.t.progress_limit(gen.stepped)
        where, in_collective = main_thread_where()
        if in_collective or idle < limit:
            return None
        return FaultRecord.hang(
            rank=s.rank, generation=s.generation, step=self.loop.step, idle_s=idle, limit_s=limit, where=where
        )

    def _desync(self, store: dist.Store) -> FaultRecord | None:
        """A desync record if this rank waits in a collective its neighbour finished the step
        without (fewer collectives counted), else None. Needs the group: before the abort."""
        s, count = self.session, self.loop.gen.count
        if count is None:
            return None
        try:
            why = count.diagnose(store)
        except Exception as e:  # no diagnosis: the fault stays what it looked like
            logger.debug("rank {}: no desync diagnosis: {}", s.rank, e)
            return None
        if why is None:
            return None
        return FaultRecord.desync(
            rank=s.rank, generation=s.generation, step=count.step, message=why, since=count.window_start
        )

    def _restore_agreed(self, it: int, t0: float) -> None:
        s, loop = self.session, self.loop
        primary = self._previous_fault(it - 1)
        s.record.detected(it - 1, loop.step, primary, "nvrx restart iteration")
        s.events.emit(Event.GROUP_REBUILT, generation=it, step=None, duration_s=time.time() - t0)
        held: list[list[int]] = [[] for _ in range(s.world_size)]
        dist.all_gather_object(held, self.ring.steps())
        step = common_restore_step(held, primary)
        pending = loop.restorer.prepare(it, step, loop.step, primary.ts, s.all_hold, since=primary.since)
        loop.gen.resume_from(pending)

    # -- each completed step ------------------------------------------------------------------------
    def _ping(self, step: int) -> None:
        if self._cw is not None:
            self._cw.ping()  # NVRx's progress timeout starts with the first ping of an iteration
