"""Faults the step hook fires inside the rank's step: an exception, a hang, a stall before the
collective, a C loop that holds the GIL."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from chaos.faults.base import InjectedFault, InProcess, Undo, Where

if TYPE_CHECKING:
    from chaos.inject import Fault


class RaiseException(InProcess):
    name = "exception"
    in_recovery = True
    summary = "an exception (`InjectedFault`) raised in the step"

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        raise InjectedFault(f"injected exception at step {fault.step} on rank {fault.rank}")


class Hang(InProcess):
    name = "hang"
    in_recovery = True
    summary = "`time.sleep(3600)` in the step: a real hang, only an interrupt ends it"

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        time.sleep(3600)
        return None


class Stall(InProcess):
    """Sleeps before the step's first collective: a peer's collective waits past its timeout."""

    name = "stall"
    summary = (
        "the rank sleeps `arg` s before its collective (a hand-written plan without `=arg`: 5 s): "
        "its peers' collective times out"
    )
    where: ClassVar[Where] = Where.BEFORE_COLLECTIVE
    arg = "seconds"
    default_arg = 30.0
    UNPLANNED_S: ClassVar[float] = 5.0  # a hand-written plan entry without ``=arg`` (``stall@4:1``)

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        time.sleep(fault.arg if fault.arg is not None else self.UNPLANNED_S)
        return None


class GilHang(InProcess):
    name = "gil_hang"
    in_recovery = True
    kills = True  # (the launcher kills a worker that stopped beating)
    summary = (
        "a regular expression backtracking for hours: C code holding the GIL, unreachable by signals "
        "and other Python threads (a hard fault)"
    )

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        re.match(r"(a+)+$", "a" * 64 + "b")
        return None
