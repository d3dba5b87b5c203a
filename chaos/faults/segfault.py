"""A real segmentation fault inside the step: the rank's process reads address 0 and the kernel
kills it with SIGSEGV, as a crashing C extension or a bad kernel launch would. Nothing in Python
can catch it; ``resilient launch`` must see the dead worker and replace it, like a SIGKILLed one."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import TYPE_CHECKING

from chaos.faults.base import InProcess, Undo

if TYPE_CHECKING:
    from chaos.inject import Fault


class Segfault(InProcess):
    name = "segfault"
    in_recovery = True
    kills = True
    summary = "the rank reads address 0 (`ctypes.string_at(0)`) in the step: it dies of a real SIGSEGV"

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        ctypes.string_at(0)  # the process dies here
        raise AssertionError("reading address 0 did not fault")  # pragma: no cover
