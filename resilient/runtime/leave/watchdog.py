"""Two background threads: one blocks on the store for faults of other ranks, one watches the
step clock for hangs. Neither polls: the listener sleeps in a store ``wait`` that returns the
moment any rank posts the generation's fault; the monitor sleeps until the next hang deadline.
In steady state they cost nothing per step.

Both end the same way for this rank's main thread: the group is aborted (so a blocked collective
fails now, here and on the peers) and the main thread is interrupted with a signal whose handler
raises :class:`StepInterrupted` — ``time.sleep`` and most blocking calls return early for it.
Code that holds the GIL in C never lets this thread run; for that case a ``SIGALRM`` interval
timer, re-armed at every step, kills the process after ``faulthandler`` dumped every stack.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from loguru import logger

from resilient.config import Timeouts
from resilient.errors import StepInterrupted


class Watched(Protocol):
    """What the monitor needs from the runtime (kept narrow so tests can drive it)."""

    def running_generation(self) -> int | None: ...

    def last_progress(self) -> tuple[float, bool]: ...

    def remote_fault(self, generation: int) -> object | None: ...

    def on_remote_fault(self, generation: int, fault: object) -> None: ...

    def on_hang(self, generation: int, idle_s: float) -> None: ...

    def nudge(self, generation: int) -> None: ...

    def main_thread_where(self) -> tuple[str, bool]: ...

    # (optional) a step check waiting on a peer: what it waits for, and the report of a long wait
    # def peer_wait(self) -> PeerWait | None: ...
    # def on_peer_wait(self, generation: int, wait: PeerWait) -> None: ...


class Monitor(threading.Thread):
    """Background thread; ``stop()`` is idempotent and joins."""

    def __init__(self, target: Watched, timeouts: Timeouts, clock: Callable[[], float] = time.monotonic):
        super().__init__(name="resilient-monitor", daemon=True)
        self._t = target
        self._timeouts = timeouts
        self._clock = clock
        self._halt = threading.Event()
        self._handled: set[int] = set()
        self.wakeups = 0

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)

    def poll(self) -> float:
        """One round of checks (the loop body; callable directly from tests).

        Returns how long the thread may sleep before the next round is needed.
        """
        short = self._timeouts.monitor_interval
        gen = self._t.running_generation()
        if gen is None:
            return short  # recovering or finishing: look again soon for the next generation
        if gen in self._handled:
            self._t.nudge(gen)  # the main thread has not left the step yet: signal it again
            return short
        fault = self._t.remote_fault(gen)
        if fault is not None:
            self._handled.add(gen)
            self._t.on_remote_fault(gen, fault)
            return short
        last, started = self._t.last_progress()
        limit = self._timeouts.progress_limit(started)
        idle = self._clock() - last
        if idle > limit:
            # A rank blocked inside a collective is usually the victim of a peer that hangs
            # elsewhere; give the culprit a moment to post first so the diagnosis names it.
            _, in_collective = self._t.main_thread_where()
            if in_collective and idle < limit + self._timeouts.victim_grace:
                return short
            self._handled.add(gen)
            self._t.on_hang(gen, idle)
            return short
        report = self._timeouts.peer_report
        wait = getattr(self._t, "peer_wait", lambda: None)()
        if wait is not None and not wait.reported and self._clock() - wait.since >= report:
            wait.reported = True
            self._t.on_peer_wait(gen, wait)  # type: ignore[attr-defined]
        # asleep until the hang deadline; a quarter of hang_timeout at most, since the deadline
        # moves earlier when the first step of a generation completes (startup → hang limit), and
        # ``peer_report`` at most, so that a step check's long wait for a peer is said in time
        return max(short, min(limit - idle, self._timeouts.hang / 4, report))

    def run(self) -> None:
        delay = self._timeouts.monitor_interval
        while not self._halt.wait(delay):
            self.wakeups += 1
            try:
                delay = self.poll()
            except Exception as e:  # the store went away: nothing to watch any more
                logger.debug("monitor poll failed: {}", e)
                delay = self._timeouts.monitor_interval


class FaultListener(threading.Thread):
    """Blocks on the store until a fault of the watched generation is posted, then reports it.

    ``wait`` on a store key returns for every waiter as soon as any rank sets it, so every rank
    learns of a fault within one store round trip, with no polling traffic in between. The
    connection is the listener's own (a blocked ``wait`` holds it) and never times out: a wait
    that times out on a TCPStore client leaves the connection out of step with the server.
    """

    def __init__(
        self, wait_for_fault: Callable[[int], object], on_fault: Callable[[int, object], None]
    ) -> None:
        super().__init__(name="resilient-fault-listener", daemon=True)
        self._wait_for_fault = wait_for_fault
        self._on_fault = on_fault
        self._cond = threading.Condition()
        self._watch: int | None = None
        self._closed = False

    def watch(self, generation: int) -> None:
        """Start listening for faults of ``generation`` (called when it starts running)."""
        with self._cond:
            self._watch = generation
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)  # released by the closing sentinel (see BuiltinEngine.close)

    def run(self) -> None:
        last = -1
        while True:
            with self._cond:
                seen = last
                self._cond.wait_for(lambda: self._closed or (self._watch is not None and self._watch > seen))  # noqa: B023
                if self._closed:
                    return
                gen = self._watch
            assert gen is not None
            last = gen
            try:
                fault = self._wait_for_fault(gen)
            except Exception as e:  # the store went away: nothing to listen to any more
                logger.debug("fault listener stopped: {}", e)
                return
            if fault is None:  # the generation closed without a fault
                continue
            try:
                self._on_fault(gen, fault)
            except Exception as e:
                logger.warning("handling a remote fault failed: {}", e)


class MainThreadInterrupter:
    """Raises :class:`StepInterrupted` in the main thread, but only while a step may be interrupted.

    ``arm(generation, reason)`` records what to raise; the signal handler raises only if
    ``is_current(generation)`` still holds, so a late signal can never hit recovery code.
    """

    def __init__(self, signame: str, is_current: Callable[[int], bool]) -> None:
        self.signum = getattr(signal, signame)
        self._is_current = is_current
        self._pending: tuple[int, str] | None = None
        self._main_ident = threading.main_thread().ident
        self._installed = False
        self._previous: object = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live there
            raise RuntimeError("resilient.wrap must run in the main thread (it installs a signal handler)")
        self._previous = signal.signal(self.signum, self._handler)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)  # type: ignore[arg-type]
            self._installed = False

    def _handler(self, signum: int, frame: object) -> None:
        pending = self._pending
        if pending is not None and self._is_current(pending[0]):
            self._pending = None
            raise StepInterrupted(pending[1])

    def interrupt(self, generation: int, reason: str) -> None:
        self._pending = (generation, reason)
        if self._main_ident is not None:
            signal.pthread_kill(self._main_ident, self.signum)

    def still_pending(self, generation: int) -> bool:
        return self._pending is not None and self._pending[0] == generation

    def resend(self, generation: int) -> bool:
        """Signal again if the interrupt for ``generation`` was not raised yet (the main thread
        may have been in C code when it arrived, and left it into a frame that swallowed nothing)."""
        if not self.still_pending(generation):
            return False
        if self._main_ident is not None:
            signal.pthread_kill(self._main_ident, self.signum)
        return True


class HardHangTimer:
    """``SIGALRM`` backstop for hangs no Python thread can reach (C code holding the GIL).

    The handler is faulthandler's C handler (no GIL needed): it dumps every thread's stack to
    stderr, then re-raises with the default action, so the process dies by ``SIGALRM``.
    """

    def __init__(self) -> None:
        self._armed = False
        self._installed = False
        self._previous: Any = signal.SIG_DFL

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGALRM, signal.SIG_DFL)
        self._installed = True
        faulthandler.register(signal.SIGALRM, file=sys.stderr, all_threads=True, chain=True)

    def arm(self, seconds: float) -> None:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        self._armed = True

    def disarm(self) -> None:
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._armed = False

    def uninstall(self) -> None:
        self.disarm()
        if self._installed:
            faulthandler.unregister(signal.SIGALRM)
            signal.signal(signal.SIGALRM, self._previous)
            self._installed = False
