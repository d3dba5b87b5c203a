"""What one generation holds: the state an entry of the training function lives in.

A generation is one life of the process group: built on its own store prefix, entered by the
training function once, ended by a fault or by the function's return. Everything that belongs to
that life is in :class:`Generation` and goes with it (its group is the
:class:`~resilient.runtime.coordination.pg.GroupOwner`'s): the objects the function tracked
in it, its collective count, the restore it resumes from, where ``ctx.epochs`` and ``ctx.steps``
are. The next generation starts with a fresh one; what outlives generations (the snapshot ring,
the schedule, the event log) belongs to the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.detectors.collectives import CollectiveCount
from resilient.errors import StateRestoreError
from resilient.state import Registry
from resilient.state.loader import batches_consumed
from resilient.state.registry import RNG, restore_rng


@dataclass
class PendingRestore:
    """The agreed snapshot, loaded into each object as the re-entered function tracks it."""

    step: int
    state: dict[str, Any]
    owned: bool  # False: its tensors are views of a mapped snapshot, copied as they are loaded
    fault_step: int | None  # the step the fault interrupted (steps re-run: fault_step - step)
    fault_ts: float | None  # when it was detected (the resume events' since_fault_s)
    loaded: set[str] = field(default_factory=set)  # the names tracked (and loaded) so far
    load_s: float = 0.0  # the time those loads took (the restore phase's part in the re-entry)
    load_cpu_s: float = 0.0  # ... of this thread's CPU time
    source: str = "ring"  # where the state came from: live | peer | ring | shm (docs/recovery.md#live-resume)
    send_to: list[int] = field(default_factory=list)  # replacements this rank's live state goes to
    send_only: dict[int, list[str]] = field(default_factory=dict)  # ... of these objects (absent: all)
    since: int | None = None  # a silent fault's first step (FaultRecord.since): later runs were its

    def load(self, registry: Registry, name: str, obj: Any, value: Callable[..., Any]) -> None:
        """Load ``name``'s part (``value(name, obj, self)``: the part as this rank takes it) into
        the object just tracked under it."""
        if name not in self.state:
            raise StateRestoreError(
                f"{name!r} is tracked now but was not in the snapshot of step {self.step} "
                f"(snapshot holds {sorted(k for k in self.state if k != RNG)})"
            )
        t0, cpu0 = time.monotonic(), time.thread_time()
        registry.load(name, value(name, obj, self), owned=self.owned)
        if self.source in ("live", "peer") and isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
            self.state[name] = None  # (the failed generation's tensors go once loaded; the small
            # objects' states stay: the next capture copies them, see live.py)
        self.load_s += time.monotonic() - t0
        self.load_cpu_s += time.thread_time() - cpu0
        self.loaded.add(name)

    def finish(self) -> None:
        """Every object of the snapshot was tracked again and loaded: the RNGs are restored last."""
        missing = [n for n in self.state if n != RNG and n not in self.loaded]
        if missing:
            raise StateRestoreError(f"tracked before the fault but not after the restart: {missing}")
        t0, cpu0 = time.monotonic(), time.thread_time()
        restore_rng(self.state[RNG])
        self.load_s += time.monotonic() - t0
        self.load_cpu_s += time.thread_time() - cpu0

    def described(self, began: float | None) -> dict[str, Any]:
        """The ``state_restored`` event's fields (``began``: when the restored step first began)."""
        return {
            "objects": sorted(self.loaded),
            # (a fault between a step's snapshot and the next step's start restores a step ahead
            # of the loop's count: nothing is re-run, not -1)
            "steps_rerun": max(
                0, (self.fault_step if self.fault_step is not None else self.step) - self.step
            ),
            "source": self.source,
            # (the restored step's start to the fault: the work the fault threw away, replayed now)
            "work_lost_s": None
            if began is None or self.fault_ts is None
            else max(0.0, self.fault_ts - began),
            "since_fault_s": time.time() - (self.fault_ts or time.time()),
            "load_s": self.load_s,
            "cpu_s": time.thread_time(),
            "load_cpu_s": self.load_cpu_s,
        }


class EpochPosition:
    """``ctx.epochs``' position, kept with the tracked state: the epoch, and whether its last batch
    was stepped (a snapshot at an epoch's end resumes at the next epoch, not in an empty pass of
    this one, whose end-of-epoch code would run twice)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.done = False

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.done = bool(state.get("done", False))  # (snapshots from before the flag: not done)


class Generation:
    """One generation's state (see the module docstring). ``progress``: the clock when the last
    step completed (or the generation began), which the hang monitor compares with its limit."""

    def __init__(
        self,
        number: int,
        count: CollectiveCount | None,
        restore: PendingRestore | None,
        now: float,
        restored_step: int | None = None,
    ) -> None:
        self.number = number
        self.count = count  # collective counts per check window (None: the check is off)
        self.registry = Registry()
        self.restore = restore
        # the step this entry resumed at: an in-process restore's, or what a (re)started
        # process restored from shared memory, a peer or a checkpoint
        self.restored_step = restore.step if restore is not None else restored_step
        self.resume_pending = restore is not None  # the first step after the restore: an event
        self.fault_ts = restore.fault_ts if restore is not None else None
        self.begun = False  # the entry's first ctx.steps / ctx.epochs began its steps
        self.epochs: EpochPosition | None = None
        self.deferred: int | None = None  # an epoch's last step, completed when the epoch ends
        self.next_step = 0
        self.open_step: int | None = None  # begun by begin_step (a loop that is not ctx.steps), not ended
        self.progress = now
        self.stepped = False  # a step completed in this generation (hang limit: startup before)
        self.told: set[str] = set()  # the recovery points the hooks were told of (once each)

    def first_at(self, point: str) -> bool:
        """Whether this generation reaches a recovery point (hooks.POINTS) for the first time."""
        first = point not in self.told
        self.told.add(point)
        return first

    def batch(self) -> str | None:
        """The batch being run, where a data position is known (``epoch 2, batch 17 of 'loader'``)."""
        parts = [f"epoch {self.epochs.epoch}"] if self.epochs is not None else []
        registry = self.registry
        for name, obj in zip(registry.names(), registry.objects(), strict=True):
            done = batches_consumed(obj)
            if done:
                parts.append(f"batch {done - 1} of {name!r}")
        return ", ".join(parts) or None

    def resume_from(self, restore: PendingRestore) -> None:
        """A restore agreed once the group was built (``engine: nvrx`` agrees over the group)."""
        self.restore = restore
        self.restored_step = restore.step
        self.resume_pending = True
        self.fault_ts = restore.fault_ts
