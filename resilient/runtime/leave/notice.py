"""Fault detection for the built-in engine: how a rank learns that its step must end.

Three ways, all ending alike for the main thread (the generation's group is aborted so a blocked
collective fails now, here and on the peers; the main thread is interrupted with a signal whose
handler raises :class:`~resilient.errors.StepInterrupted`):

- a peer's fault: the listener thread hears it from the store the moment it is posted;
- a hang of this rank (or a wait for a peer that never comes): the monitor thread sees no step
  completed for ``hang_timeout``, diagnoses it (a collective a neighbour never issued is a
  desync), posts it and reports every thread's stack;
- a hang that holds the GIL, which no thread can reach: the ``SIGALRM`` timer the step loop
  re-arms at every step kills the process, for the launcher.

:class:`Detection` owns those threads and the interrupter, and answers the monitor
(:class:`~resilient.runtime.leave.watchdog.Watched`). The engine tells it which generation may be
interrupted (``running``); the step loop tells it where the step is.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from loguru import logger

from resilient.detectors import REGISTRY as DETECTORS
from resilient.detectors.collectives import PeerWait
from resilient.events import Event
from resilient.runtime.coordination.coordinator import Coordinator
from resilient.runtime.coordination.pg import GroupOwner
from resilient.runtime.faults.records import FaultRecord, Symptom
from resilient.runtime.faults.stacks import all_stacks, main_thread_where
from resilient.runtime.leave.watchdog import FaultListener, HardHangTimer, MainThreadInterrupter, Monitor
from resilient.runtime.run.session import Session
from resilient.runtime.steps.loop import StepLoop

# how long a rank past its optimizer's update may take to finish its step after a peer's fault
# (its state is then kept for a live resume); a tail that blocks or runs on is interrupted
TAIL_GRACE_S = 0.5
# the faults a rank finishes its step's tail for: raised in a peer's step, that peer alive and in
# its recovery. Not a failed collective or a death (a dead peer's saves and counts never come: the
# tail would wait out its grace in them), nor a fault that casts doubt on the state (live.py); a
# detector's fault says so itself (``peers_finish_step``)
TAIL_KINDS = {Symptom.EXCEPTION.value, Symptom.OOM.value, Symptom.HANG.value} | DETECTORS.symptoms(
    lambda f: f.peers_finish_step
)


class Detection:
    """See the module docstring. ``running()``: the generation whose step may be interrupted now
    (None while recovering or finishing); ``busy()``: the main thread waits on purpose (a save in
    flight), which is progress, not a hang."""

    def __init__(
        self,
        session: Session,
        coord: Coordinator,
        loop: StepLoop,
        groups: GroupOwner,
        hard_timer: HardHangTimer,
        *,
        running: Callable[[], int | None],
        busy: Callable[[], bool],
        monitor_store: dist.Store,
        listener_store: dist.Store,
    ) -> None:
        self.session = session
        self.t = session.t
        self.coord = coord
        self.loop = loop
        self.groups = groups
        self.hard_timer = hard_timer
        self._running = running
        self._busy = busy
        self.monitor_store = monitor_store
        self.listener_store = listener_store
        # constructed without side effects; start() installs and starts them
        self.interrupter = MainThreadInterrupter(session.cfg.interrupt_signal, self._interruptible)
        self.monitor = Monitor(self, self.t)
        self.listener = FaultListener(self._wait_for_fault, self._on_listened_fault)
        self._remote: dict[int, FaultRecord] = {}
        self._heard_at: dict[int, float] = {}  # when the listener heard each generation's fault
        self._remote_handled: set[int] = set()
        self._remote_lock = threading.Lock()
        self._last_nudge = 0.0

    # -- lifecycle -----------------------------------------------------------------------------------------
    def install(self, stack: contextlib.ExitStack) -> None:
        """The signal handlers (main thread only); ``stack`` undoes them."""
        self.interrupter.install()
        stack.callback(self.interrupter.uninstall)
        self.hard_timer.install()
        stack.callback(self.hard_timer.uninstall)

    def start(self, stack: contextlib.ExitStack) -> None:
        """The monitor and listener threads; ``stack`` stops them."""
        self.monitor.start()
        stack.callback(self.monitor.stop)
        self.listener.start()
        stack.callback(self.listener.stop)

    def release(self) -> None:
        """Our threads must be finished before the interpreter finalizes: a daemon thread that
        returns from a store call during finalization is unwound through C++ frames and the
        process aborts ("terminate called without an active exception"). A listener still blocked
        on this generation's fault key is released with the closing sentinel (a no-op if a fault
        was posted; peers of a finished generation have closed it already)."""
        if self.listener.is_alive():
            with contextlib.suppress(Exception):
                self.coord.close_generation(self.session.generation)

    def watch(self, generation: int) -> None:
        """``generation`` runs: listen for its faults."""
        self.listener.watch(generation)

    def heard(self, generation: int) -> FaultRecord | None:
        """The fault of ``generation`` the listener heard, if any (no store traffic)."""
        return self._remote.get(generation)

    def heard_at(self, generation: int) -> float | None:
        """When (``time.time()``) the listener heard the fault of ``generation``, if it did."""
        return self._heard_at.get(generation)

    # -- the listener's ---------------------------------------------------------------------------------
    def _wait_for_fault(self, generation: int) -> FaultRecord | None:
        return self.coord.wait_fault(generation, self.listener_store)

    def _on_listened_fault(self, generation: int, fault: object) -> None:
        assert isinstance(fault, FaultRecord)
        self._heard_at.setdefault(generation, time.time())  # (the recovery's detection phase ends here)
        self._remote[generation] = fault
        if fault.rank != self.session.rank and self._interruptible(generation):
            self.on_remote_fault(generation, fault)

    def _interruptible(self, generation: int) -> bool:
        return self._running() == generation

    # -- the monitor's (watchdog.Watched) ----------------------------------------------------------------
    def running_generation(self) -> int | None:
        return self._running()

    def last_progress(self) -> tuple[float, bool]:
        gen = self.loop.gen
        if self._busy():  # waiting for the previous checkpoint's commit is progress, not a hang
            return time.monotonic(), gen.stepped
        return gen.progress, gen.stepped

    def remote_fault(self, generation: int) -> FaultRecord | None:
        f = self._remote.get(generation)  # what the listener heard: no store traffic here
        return f if f is not None and f.rank != self.session.rank else None

    def on_remote_fault(self, generation: int, fault: object) -> None:
        assert isinstance(fault, FaultRecord)
        with self._remote_lock:  # the listener and the monitor may both report it
            if generation in self._remote_handled:
                return
            self._remote_handled.add(generation)
        reason = f"peer: rank {fault.rank} faulted at step {fault.step}: {fault.signature}"
        finish = fault.kind in TAIL_KINDS
        mine = self.loop.step
        # (the peer raised in the next step: it completed this one, so this rank's step has no
        # collective left; interrupted here it would vouch for a step the peer has left behind)
        behind = finish and fault.step is not None and mine is not None and fault.step == mine + 1
        self.leave(generation, reason, finish_tail=finish, behind=behind)

    def leave(self, generation: int, reason: str, *, finish_tail: bool = False, behind: bool = False) -> None:
        """(any thread) The one way a step of ``generation`` is ended from outside the main thread
        (a peer's fault, this rank's hang): the group aborted, so that a blocked collective fails
        here and on the peers, then the main thread interrupted. ``finish_tail``: a rank past its
        optimizer's update may first finish its step (its state is then kept for a live resume),
        for ``TAIL_GRACE_S`` at most; ``behind`` (the peer faulted in the next step): wherever this
        rank is in its step, with its group left alone until the grace (a step's time) is over,
        since a collective it issued may still be completing."""
        if not behind:
            self.groups.abort(generation)
        live = self.loop.live
        if finish_tail and live.leave_at_step_end(generation, self.loop.gen.number, reason, behind=behind):
            grace = max(TAIL_GRACE_S, self._step_s()) if behind else TAIL_GRACE_S
            timer = threading.Timer(grace, self._tail_expired, (generation, reason))
            timer.daemon = True
            timer.start()
            return
        self.groups.abort(generation)  # (idempotent)
        self.interrupter.interrupt(generation, reason)

    def _step_s(self) -> float:
        """The last completed step's wall time (0: none yet), the most a step's remainder takes."""
        began = self.loop.began_at
        step = self.loop.step
        if step is None or step - 1 not in began or step not in began:
            return 0.0
        return max(0.0, began[step] - began[step - 1])

    def _tail_expired(self, generation: int, reason: str) -> None:
        if self.loop.live.take_leaving(generation):  # (the step did not end in time: interrupted where it is)
            self.groups.abort(generation)
            self.interrupter.interrupt(generation, reason)

    def main_thread_where(self) -> tuple[str, bool]:
        return main_thread_where()

    def peer_wait(self) -> PeerWait | None:
        count = self.loop.gen.count
        return count.wait if count is not None else None

    def on_peer_wait(self, generation: int, wait: PeerWait) -> None:
        """(the monitor thread) A step check has waited ``peer_report`` for a peer's count."""
        now, bound = time.monotonic(), self.t.peer_report
        logger.warning("rank {}: {}", self.session.rank, wait.describe(now, bound))
        self.session.events.emit(
            Event.PEER_WAIT,
            generation=generation,
            step=self.loop.step,
            cause=wait.cause(now, bound),
            **wait.fields(now - wait.since),
            request_in_flight_s=None if wait.request_since is None else round(now - wait.request_since, 4),
        )

    def on_hang(self, generation: int, idle_s: float) -> None:
        rec = self._hang_record(generation, idle_s)
        self.coord.post_fault(rec, store=self.monitor_store)
        self.session.record.report(rec, stacks=all_stacks())  # (before the interrupt moves the main thread)
        self.leave(generation, f"{rec.kind}: {rec.message}")

    def _hang_record(self, generation: int, idle_s: float) -> FaultRecord:
        """This rank's hang, or the desync its collective count diagnoses."""
        where, blocked = self.main_thread_where()
        gen = self.loop.gen
        rank, step = self.session.rank, self.loop.step
        limit = self.t.progress_limit(gen.stepped)
        rec = FaultRecord.hang(
            rank=rank, generation=generation, step=step, idle_s=idle_s, limit_s=limit, where=where
        )
        wait = self.peer_wait()
        if wait is not None:  # (a step check's wait: the peer's, or the store's)
            rec.message += f"; it {wait.describe(time.monotonic(), self.t.peer_report)}"
        count = gen.count
        # (a rank blocked on its peers waits a moment for theirs: a deadlock shows in both posts)
        grace = self.t.victim_grace if blocked else 0.0
        desync = count.diagnose(self.monitor_store, blocked, grace) if count is not None else None
        if count is not None:
            # a hang may be a skipped collective the count did not diagnose (the peer had not
            # closed its window yet): the state since the window's start is no replay's reference
            rec.since = count.window_start
        if desync is None or count is None:
            return rec
        # in a collective a neighbour's step lacked
        msg = f"{desync} ({rec.message})"
        return FaultRecord.desync(
            rank=rank, generation=generation, step=step, message=msg, since=count.window_start, idle_s=idle_s
        )

    def nudge(self, generation: int) -> None:
        now = time.monotonic()
        if now - self._last_nudge > 0.5:
            self._last_nudge = now
            self.interrupter.resend(generation)
