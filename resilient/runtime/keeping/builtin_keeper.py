"""The built-in engine's :class:`~resilient.runtime.steps.loop.Keeper`: where state goes besides the ring.

- Under ``resilient launch`` each snapshot is also mirrored where it outlives the process: this
  node's shared memory, and its small objects to the job's store (which outlives the node). That
  copy costs more and only a hard fault needs it, so it has its own cadence (``mirror_schedule``):
  the ring, which every soft fault restores from, is not thinned out by the mirror's cost.
- With ``checkpoint.dir`` the state is also saved as durable checkpoints (:mod:`durable`), and a
  preemption signal turns into a final checkpoint at the next step boundary.
- A (re)started process's first entry resumes what a previous one left: the shared-memory
  snapshot every rank holds, else the newest checkpoint that verifies everywhere, else step 0.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from loguru import logger

from resilient.checkpoint import flushed
from resilient.checkpoint.shm import ShmSnapshot
from resilient.errors import CheckpointError, StateRestoreError, StepInterrupted
from resilient.events import Event
from resilient.launch_env import LaunchEnv
from resilient.runtime.coordination.coordinator import Coordinator
from resilient.runtime.keeping import buddy as buddy_mod
from resilient.runtime.keeping import resume
from resilient.runtime.keeping.buddy import Buddy
from resilient.runtime.keeping.durable import Persistence
from resilient.runtime.run.generation import Generation
from resilient.runtime.run.schedule import SnapshotSchedule
from resilient.runtime.run.session import Session
from resilient.state import Registry, SnapshotRing, layout
from resilient.state.digest import Leaf
from resilient.state.dtensor import live_meshes
from resilient.state.registry import RNG, restore_rng


class MappedState(dict[str, Any]):
    """A snapshot whose tensors are views of a shared-memory slot, not copies: each object copies
    what it keeps as it is tracked (see ``Registry.load(owned=False)``)."""


def shm_state(shm: ShmSnapshot, step: int, *, mapped: bool = False) -> dict[str, Any]:
    """The state of ``step`` in this node's shared memory; its slot may have been evicted since
    (a newer snapshot took it), or it no longer matches its sums: then :class:`StateRestoreError`,
    naming it."""
    try:
        got = shm.load(step, mapped=mapped)
    except CheckpointError as e:
        raise StateRestoreError(f"{shm.dir}: the snapshot of step {step} is not restored: {e}") from e
    if got is None:
        raise StateRestoreError(f"{shm.dir}: the snapshot of step {step} is gone")
    return MappedState(got[1]) if mapped else dict(got[1])


class BuiltinKeeper:
    """See the module docstring. ``arm``: the hard-hang timer's (a save in flight re-arms it)."""

    def __init__(
        self,
        session: Session,
        ring: SnapshotRing,
        coord: Coordinator,
        *,
        persist: Persistence | None,
        shm: ShmSnapshot | None,
        store_copy: resume.StoreCopy | None,
        arm: Callable[[float], None],
        buddy: Buddy | None = None,
    ) -> None:
        self.session = session
        self.ring = ring
        self.coord = coord
        self.persist = persist
        self.shm = shm
        self.store_copy = store_copy
        self.buddy = buddy  # each mirrored snapshot also goes to a rank on another node
        self._arm = arm
        s = session
        self.mirror_schedule = SnapshotSchedule(
            s.cfg.snapshot, s.rank, s.store, f"{s.ns}/mirror_interval", 1.0 - ring_share(s.launch)
        )
        self.in_save = False  # waiting for a durable save: progress, not a hang
        self._ckpt_due = False  # a durable checkpoint is due after this step (set once a step)
        self._adoptable: int | None = None  # restored from this rank's own shm snapshot of this step
        # (step, rank, world) of each shared-memory slot, newest first, as this process last saw or
        # wrote them (it alone writes its slots): a recovery offers them without parsing the slots'
        # descriptions again, and a mirror step asks nothing of them (None: read them)
        self._slots: list[tuple[int, int | None, int | None]] | None = None

    # -- the first entry ---------------------------------------------------------------------------------
    def first_step(self, gen: Generation, total: int | None, fresh: bool) -> tuple[int, bool]:
        start, restored = self._resume_at_start(gen.registry) if fresh else (0, False)
        shm = self.shm
        if shm is not None and self._adoptable == start:
            # just restored from this very snapshot: the ring points at it instead of copying
            self.ring.adopt(start, functools.partial(shm_state, shm, start))
            if self.store_copy is not None:
                self.mirror(start, gen.registry.capture())  # (held: only the store copy posts)
            return start, restored
        state = gen.registry.capture()
        self.ring.capture(start, state)
        self.mirror(start, state)
        return start, restored

    def resumable(self) -> bool:
        """A snapshot of this job in this node's shared memory, one its agents flushed, or a
        committed checkpoint that ``checkpoint.resume`` would load."""
        if self.shm is not None and self.shm.steps():
            return True
        ck = self.session.cfg.checkpoint
        if ck.flush_on_death and ck.dir is not None and any(flushed.root(ck.dir).glob("*/*")):
            return True
        return self.persist is not None and ck.resume and bool(self.persist.ckpt.committed())

    def _resume_at_start(self, registry: Registry) -> tuple[int, bool]:
        """A (re)started worker: the shared-memory snapshot every rank holds, else the newest
        checkpoint that verifies everywhere, else step 0 (and whether it restored anything)."""
        t0 = time.time()
        s = self.session
        newest = self.persist.ckpt.committed()[:1] if self.persist is not None else []
        if self.shm is not None:
            got = resume.restore(
                shm=self.shm,
                rank=s.rank,
                world=s.world_size,
                names=[*registry.names(), RNG],
                exchange=lambda n, p: self.coord.exchange(0, n, p),
                store_copy=self.store_copy,
                newest_checkpoint=newest[0] if newest else -1,
                flushed=self._flushed(),
            )
            if got is not None:
                if set(got.sources.values()) == {"shm"}:  # this rank's own snapshot, as it was
                    self._adoptable = got.step
                step = self._apply_restored(
                    registry,
                    got.step,
                    got.state,
                    got.source,
                    t0,
                    world_from=got.world_from,
                    sources=got.sources,
                )
                return step, True
        if self.persist is None:
            return 0, False
        loaded = self.persist.resume(list(live_meshes(registry.objects()).values()))
        if loaded is None:
            return 0, False
        return self._apply_restored(registry, loaded.step, loaded.state, str(loaded.path), t0), True

    def _flushed(self) -> Callable[[int], ShmSnapshot] | None:
        """Where the agents flushed dead workers' snapshots (``checkpoint.flush_on_death``)."""
        ck = self.session.cfg.checkpoint
        if not ck.flush_on_death or ck.dir is None:
            return None
        return functools.partial(flushed.copy_of, flushed.root(ck.dir))

    def _apply_restored(
        self, registry: Registry, step: int, state: dict[str, Any], source: str, t0: float, **detail: Any
    ) -> int:
        s = self.session
        held = sorted(k for k in state if k != RNG)
        if set(held) != set(registry.names()):
            raise StateRestoreError(f"{source} holds {held}, but this run tracks {sorted(registry.names())}")
        layout.check(dict(zip(registry.names(), registry.objects(), strict=True)), state, source)
        for name in held:
            registry.load(name, state[name])
        restore_rng(state[RNG])
        if self.persist is not None:
            self.persist.rebase(step)
        with contextlib.suppress(Exception):  # (every rank of this attempt writes the same step)
            s.store.set(f"{s.ns}/schedule_base", str(step))
        s.schedule.rebase(step)
        self.mirror_schedule.rebase(step)
        s.events.emit(
            Event.STATE_RESTORED,
            generation=0,
            step=step,
            objects=held,
            source=source,
            duration_s=time.time() - t0,
            world=s.world_size,
            **detail,
        )
        return step

    def adopt_predecessor(self) -> None:
        """A replacement for a dead rank: its schedules count from where its survivors' attempt
        began, its predecessor's unfinished saves are given up, and the snapshots it left in
        this node's shared memory are offered (held by reference, loaded if agreed on)."""
        s = self.session
        base = f"{s.ns}/schedule_base"
        if s.store.check([base]):
            step0 = int(s.store.get(base))
            s.schedule.rebase(step0)
            self.mirror_schedule.rebase(step0)
        if self.persist is not None:
            self.persist.abandon_predecessor()
        shm = self.shm
        if shm is not None:
            for step in self.own_mirror_steps():
                self.ring.adopt(step, functools.partial(shm_state, shm, step, mapped=True))

    # -- what a recovery restores from --------------------------------------------------------------------
    def shm_slots(self) -> list[tuple[int, int | None, int | None]]:
        """(step, global rank, world size) of each snapshot in this rank's shared memory."""
        if self.shm is None:
            return []
        if self._slots is None:
            self._slots = [(m["step"], m["rank"], m["world"]) for m in self.shm.slots()]
        return self._slots

    def own_mirror_steps(self) -> list[int]:
        """Steps of this rank's own snapshots in this node's shared memory (at this world size)."""
        s = self.session
        return [step for step, rank, world in self.shm_slots() if (rank, world) == (s.rank, s.world_size)]

    def held_steps(self) -> list[int]:
        """The steps this rank can restore: its ring's and its shared-memory mirror's, which a
        replacement for a dead peer holds too (the ring's own schedule may not have kept them)."""
        return sorted({*self.ring.steps(), *self.own_mirror_steps()}, reverse=True)

    def drop_after(self, step: int) -> None:
        """A replica that passed its neighbour's comparison may still hold what a corrupt peer's
        gradients made of it (found by the next pair's comparison): a mirror of a step after the
        roll-back is never restored, nor skipped as already written when the replay gets there."""
        s = self.session
        if self.shm is not None and any(held > step for held, _, _ in self.shm_slots()):
            self._slots = None
            for gone in self.shm.drop_after(step):
                logger.debug("rank {}: shared-memory snapshot of step {} dropped (rolled back)", s.rank, gone)
        if self.store_copy is not None:
            with contextlib.suppress(Exception):  # (the store copy is a second line of defence)
                self.store_copy.drop_after(step)
        if self.buddy is not None:
            self.buddy.drop_after(step)

    def materialize(self, step: int) -> tuple[dict[str, Any], bool]:
        if step in self.ring.steps() or self.shm is None:
            state = self.ring.materialize(step)
            return state, not isinstance(state, MappedState)
        return shm_state(self.shm, step), True

    # -- each completed step -------------------------------------------------------------------------------
    def due(self, nxt: int, total: int | None) -> bool:
        p = self.persist
        self._ckpt_due = p is not None and (p.due(nxt) or nxt == total)  # once a step: due() times it
        return (self.shm is not None and self.mirror_schedule.due(nxt, total)) or self._ckpt_due

    def stopping(self) -> bool:
        return self.persist is not None and self.persist.preempt_requested is not None

    def keep(
        self,
        gen: Generation,
        nxt: int,
        total: int | None,
        state: dict[str, Any] | None,
        step_s: float | None,
        sums: dict[str, Leaf] | None = None,
    ) -> None:
        p, registry = self.persist, gen.registry
        if p is not None and p.preempt_requested is not None:  # (kept in the ring: see stopping)
            if nxt not in self.ring.steps():  # (the signal came after the step loop asked)
                self.ring.capture(nxt, state if state is not None else registry.capture())
            raise StepInterrupted(f"preempt: {p.preempt_requested} received")
        if self.shm is not None:
            mirror_s = None
            # a mirror older than the newest checkpoint is never restored from (the disk is, more
            # slowly): a checkpoint step refreshes it too, with the state already captured
            if self.mirror_schedule.due(nxt, total) or self._ckpt_due:
                clock = self.session.clock
                t_mirror = clock()
                if state is None:
                    state, sums = registry.capture(), None
                self.mirror(nxt, state, sums)
                if self.buddy is not None and self.mirror_schedule.calibrating(nxt):
                    # auto measures the buddy copy as if it were on the critical path: its
                    # interval then fits the budget even where the copy competes with the step
                    self.buddy.settled(buddy_mod.WAIT_S)
                mirror_s = clock() - t_mirror
            self.mirror_schedule.observe(nxt, step_s, mirror_s)
        if p is None:
            return
        if self._ckpt_due:
            hard = self.session.t.hard
            optimizers = [o for o in registry.objects() if isinstance(o, torch.optim.Optimizer)]
            # waiting for the save in flight (on_busy: wait) is not a hang: re-arm around it
            self._arm(self.session.cfg.checkpoint.commit_timeout_s + hard)
            self.in_save = True
            try:
                g = self.session.generation
                p.save(nxt, registry.capture(), g, g, pipeline=optimizers)
            finally:
                self.in_save = False
            self._arm(hard)
            gen.progress = self.session.clock()

    def mirror(self, step: int, state: dict[str, Any], sums: dict[str, Leaf] | None = None) -> None:
        """Under ``resilient launch``: the snapshot also goes where it outlives this process (this
        node's shared memory; its small objects to the job's store, which outlives the node)."""
        if self.shm is None:
            return
        s = self.session
        mine = (step, s.rank, s.world_size)
        slots = self.shm_slots()
        if mine not in slots:  # not when just restored from it
            if self.buddy is not None and slots:  # (the capture takes the older slot)
                self.buddy.before_capture(slots[0][0])
            self._slots = None  # (unknown if the copy fails half-way)
            self.shm.capture(step, state, checksum=False, owner=(s.rank, s.world_size), sums=sums)
            # the capture took the older slot (or a free one): the newest other stays
            self._slots = sorted([mine, *slots[:1]], key=lambda m: -m[0])
        if self.store_copy is not None:
            try:
                self.store_copy.publish(step, s.world_size, state)
            except Exception as e:  # the store copy is a second line of defence, not a reason to stop
                logger.warning(f"rank {s.rank}: store copy of step {step} not posted: {e}")
                return
            if self.buddy is not None:  # (after the store copy: its fingerprints vouch for the copy)
                self.buddy.send(step)

    def close(self) -> None:
        """At exit: the buddy copy's threads and the preemption handlers go, the last save is
        flushed."""
        if self.buddy is not None:
            self.buddy.close()
        if self.persist is None:
            return
        self.persist.uninstall()
        try:
            self.persist.ckpt.close()
        except CheckpointError as e:
            logger.error("rank {}: at exit: {}", self.session.rank, e)


def ring_share(launch: LaunchEnv) -> float:
    """The in-memory ring's part of the snapshot budget: under ``resilient launch`` the mirror
    takes the other half."""
    return 0.5 if launch.under_launcher else 1.0
