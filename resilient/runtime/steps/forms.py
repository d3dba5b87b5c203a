"""The forms a training loop takes, on the step loop's two primitives (a step begins, a step
completes): ``ctx.steps(n)``, ``ctx.epochs(n)`` with a loader's batches as steps
(``ctx.steps_over``), and a loop that is not the runtime's (``ctx.begin_step``/``ctx.end_step``:
a trainer's callbacks). The first of a generation begins its entry (a restore, or step 0)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sized
from types import FrameType
from typing import Any, Protocol

from resilient.errors import ResilienceError
from resilient.runtime.run.generation import EpochPosition, Generation
from resilient.state.loader import batches_consumed, finish_pass
from resilient.state.registry import EPOCHS


class Stepping(Protocol):
    """The step loop's primitives (:class:`~resilient.runtime.steps.loop.StepLoop`)."""

    gen: Generation

    def track(self, objects: dict[str, Any]) -> None: ...

    def ensure_begun(self) -> int:
        """The next step to run; the first call of a generation begins its entry."""
        ...

    def begin_steps(self, total: int | None) -> int: ...

    def step_begins(self, step: int, caller: FrameType | None = None) -> None: ...

    def complete(self, step: int, total: int | None) -> None: ...


class StepForms:
    """See the module docstring; ``loop``'s ``ctx`` methods of those names are these."""

    def __init__(self, loop: Stepping) -> None:
        self.loop = loop

    def epochs(self, total: int) -> Iterator[int]:
        """Epoch numbers up to ``total``, resuming at the epoch of the restored step. Begins the
        run (a relaunched worker restores here), so an epoch loop's body sees its state."""
        progress = EpochPosition()
        self.loop.track({EPOCHS: progress})
        self.loop.gen.epochs = progress
        self.loop.ensure_begun()
        if progress.done:  # restored at an epoch's end: the tracked loaders' next pass is a new one
            for obj in self.loop.gen.registry.objects():
                finish_pass(obj)
        for epoch in range(progress.epoch + progress.done, total):
            progress.epoch, progress.done = epoch, False
            yield epoch
            last, self.loop.gen.deferred = self.loop.gen.deferred, None
            if last is not None:  # the epoch's own code ran: its last step is complete now
                progress.done = True
                self.loop.complete(last, None)
        progress.epoch, progress.done = total, False

    def steps_over(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Each item of ``batches`` is one step; the step count runs on across calls (epochs)."""
        step = self.loop.ensure_begun()
        n = len(batches) if isinstance(batches, Sized) else None  # (a DataLoader: batches per pass)
        for i, item in enumerate(batches):
            self.loop.step_begins(step)
            yield item
            done = batches_consumed(batches)  # (a tracked loader counts skipped batches too)
            if self.loop.gen.epochs is not None and n is not None and (i + 1 if done is None else done) >= n:
                # an epoch's last batch: its step completes (and may be kept) once the code after
                # the batch loop ran too (ctx.epochs resumes), so that code is never lost to a
                # restore nor run twice
                self.loop.gen.deferred = step
            else:
                self.loop.complete(step, None)
            step += 1
            self.loop.gen.next_step = step

    def begin_step(self) -> int:
        """A step of a loop that is not ``ctx.steps`` begins (a trainer's callback, at each
        optimizer step's start): its index, counted on from the restored step. The first call of
        a generation begins the run, as ``ctx.steps`` does (a relaunched worker restores here)."""
        gen = self.loop.gen
        if gen.open_step is not None:
            raise ResilienceError(f"ctx.begin_step(): step {gen.open_step} was begun and not ended")
        step = self.loop.ensure_begun()
        self.loop.step_begins(step, sys._getframe(1))  # (as ctx.steps': the frame of ctx's call)
        gen.open_step = step
        return step

    def end_step(self) -> None:
        """The step :meth:`begin_step` began is complete (its optimizer step applied): the
        progress signal, the checks, and the snapshot where the schedule says so."""
        gen = self.loop.gen
        step, gen.open_step = gen.open_step, None
        if step is None:
            raise ResilienceError("ctx.end_step(): no step was begun (call ctx.begin_step() first)")
        gen.next_step = step + 1
        self.loop.complete(step, None)

    def steps(self, total: int) -> Iterator[int]:
        start = self.loop.begin_steps(total)
        for step in range(start, total):
            self.loop.step_begins(step)
            yield step
            self.loop.complete(step, total)
