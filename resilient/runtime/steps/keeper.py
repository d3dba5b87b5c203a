"""The engines' one seam in a step: a :class:`Keeper`, where state goes besides the in-memory ring,
and how a process's first entry starts. The built-in engine's is
:class:`~resilient.runtime.keeping.builtin_keeper.BuiltinKeeper` (shared memory, the store copy,
checkpoints, resume at start); ``engine: nvrx`` keeps the ring alone (:class:`RingOnly`)."""

from __future__ import annotations

from typing import Any, Protocol

from resilient.runtime.run.generation import Generation
from resilient.state import SnapshotRing
from resilient.state.digest import Leaf


class Keeper(Protocol):
    """Where an engine keeps state besides the in-memory ring (see the module docstring)."""

    def first_step(self, gen: Generation, total: int | None, fresh: bool) -> tuple[int, bool]:
        """The step a ``ctx.steps`` with nothing to restore starts at, its state kept; and whether
        it was restored (``fresh``: the process's first entry, which may resume a predecessor)."""
        ...

    def resumable(self) -> bool:
        """Whether a process's first entry finds state a previous one left (shared memory, a
        checkpoint): asked before anything is tracked, so it does not say that it loads."""
        ...

    def due(self, nxt: int, total: int | None) -> bool:
        """Whether the state after ``nxt`` completed steps is kept somewhere besides the ring."""
        ...

    def keep(
        self,
        gen: Generation,
        nxt: int,
        total: int | None,
        state: dict[str, Any] | None,
        step_s: float | None,
        sums: dict[str, Leaf] | None = None,
    ) -> None:
        """After each step (``state``: what was captured for the ring, if anything was; ``sums``:
        its tensor leaves' byte sums, where the replica digests took them)."""
        ...

    def materialize(self, step: int) -> tuple[dict[str, Any], bool]:
        """A fresh copy of the state of ``step``, and whether its tensors are its own (False:
        views of a mapped snapshot, copied as each object loads them)."""
        ...

    def stopping(self) -> bool:
        """A stop was asked for (a preemption signal): the step just completed is the run's last,
        its state kept in the ring for the final checkpoint (``keep`` then ends the step)."""
        ...

    def drop_after(self, step: int) -> None:
        """The ranks rolled back to ``step``: what was kept of later steps goes (their replay
        keeps them afresh; the state before the roll-back may be what the fault corrupted)."""
        ...


class RingOnly:
    """The keeper of an engine that keeps its snapshots in the ring alone."""

    def __init__(self, ring: SnapshotRing) -> None:
        self.ring = ring

    def first_step(self, gen: Generation, total: int | None, fresh: bool) -> tuple[int, bool]:
        self.ring.capture(0, gen.registry.capture())
        return 0, False

    def resumable(self) -> bool:
        return False

    def due(self, nxt: int, total: int | None) -> bool:
        return False

    def keep(
        self,
        gen: Generation,
        nxt: int,
        total: int | None,
        state: dict[str, Any] | None,
        step_s: float | None,
        sums: dict[str, Leaf] | None = None,
    ) -> None:
        return None

    def materialize(self, step: int) -> tuple[dict[str, Any], bool]:
        return self.ring.materialize(step), True

    def stopping(self) -> bool:
        return False

    def drop_after(self, step: int) -> None:
        return None
