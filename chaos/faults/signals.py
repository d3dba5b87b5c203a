"""Signals the harness sends to the rank's process: SIGKILL (dead at once: the launcher replaces
it) and SIGSTOP (frozen: its heartbeat stops)."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, ClassVar

from chaos.faults.base import ByHarness

if TYPE_CHECKING:
    from chaos.inject import Fault
    from chaos.runner import Runner
    from chaos.schedule import Planned


class Signal(ByHarness):
    signum: ClassVar[signal.Signals]
    kills = True  # (SIGSTOP too: the launcher kills a silent worker)

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        os.kill(pid, self.signum)
        run.record(self.name, f.rank, done + 1, pid=pid)
        return None


class Sigkill(Signal):
    name = "sigkill"
    summary = "SIGKILL sent to the rank's process (at a recovery's point: by the rank to itself)"
    signum = signal.SIGKILL
    in_recovery = True

    def at_point(self, fault: Fault) -> None:
        # (the rank itself, where its recovery reached: the harness cannot see a phase's start)
        os.kill(os.getpid(), signal.SIGKILL)


class Sigstop(Signal):
    name = "sigstop"
    summary = "SIGSTOP sent to the rank's process: alive, silent (its heartbeat stops)"
    signum = signal.SIGSTOP
