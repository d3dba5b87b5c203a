"""State the runtime cannot see, named before it costs a run: the step loop's side of
:class:`~resilient.state.untracked.UntrackedScan`.

At the start of a process's first steps (its first generation, under ``ctx.steps`` or
``ctx.epochs``, not a trainer's loop that calls ``ctx.begin_step``, whose integration tracks
what the trainer keeps) the frame that iterates the steps is sampled; once the scan decides, each
value that changes every step and is neither tracked nor carried is named once: an
``untracked_state`` event on every rank, a warning in rank 0's log, and the first of the causes a
``replay_diverged`` names. A fault before the scan decided ends it: a re-entry's frame is another
frame of the same code, and the findings of a run cut short would not be trusted.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from loguru import logger

from resilient.events import Event
from resilient.runtime.run.generation import Generation
from resilient.state.carry import CARRY, Carried
from resilient.state.untracked import Finding, UntrackedScan, message

SAMPLES = 3  # step starts sampled: two changes in a row are "every step"


class UntrackedWatch:
    """One per process (see the module docstring). ``enabled``: off for a replacement, which
    starts in its predecessor's generation (the predecessor's scan spoke for the rank)."""

    def __init__(self, rank: int, emit: Callable[..., Any], enabled: bool = True) -> None:
        self.rank = rank
        self.emit = emit
        self.findings: list[Finding] = []
        self._scan: UntrackedScan | None = UntrackedScan(SAMPLES) if enabled else None
        self._generation: int | None = None
        self.cost_s = 0.0  # what the scan took, all its samples together

    @property
    def active(self) -> bool:
        return self._scan is not None

    def at_start(self, caller: FrameType | None, gen: Generation, step: int) -> None:
        """``step`` begins; ``caller``: the frame that called the loop's step start (the steps
        generator's, whose caller is the training function's frame)."""
        scan = self._scan
        if scan is None:
            return
        if self._generation is None:
            self._generation = gen.number
        # (a fault came first, or the step began in ctx.begin_step, a trainer's loop: no scan)
        stepping = caller is not None and caller.f_code.co_flags & inspect.CO_GENERATOR
        if gen.number != self._generation or not stepping:
            self._scan = None
            return
        assert caller is not None
        frame = caller.f_back
        if frame is None:
            return
        t0 = time.perf_counter()
        objects = dict(zip(gen.registry.names(), gen.registry.objects(), strict=True))
        found = scan.observe(frame, objects.values(), _fields(objects.get(CARRY)))
        self.cost_s += time.perf_counter() - t0
        if found is None:
            return
        self._scan = None
        self.findings = found
        self._report(gen.number, step)

    def _report(self, generation: int, step: int) -> None:
        if not self.findings:
            return
        self.emit(
            Event.UNTRACKED_STATE,
            generation=generation,
            step=step,
            findings=[
                {"name": f.name, "kind": f.kind, "type": f.type_name, "fix": f.fix} for f in self.findings
            ],
            scan_s=round(self.cost_s, 6),
            log=False,
        )
        if self.rank == 0:
            logger.warning("rank 0: {}", message(self.findings))

    def causes(self) -> list[str]:
        """The findings as likely causes of a replay that diverged, first among them."""
        return [
            f"{f.name} ({f.type_name}) changes every step and is not tracked: {f.fix}" for f in self.findings
        ]


def _fields(carried: Any) -> list[str]:
    """``ctx.carry``'s field names (its values are restored: a local of the same name is too)."""
    return list(object.__getattribute__(carried, "_values")) if isinstance(carried, Carried) else []
