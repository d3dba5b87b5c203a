"""A live resume across a hard fault: a replacement for a dead data-parallel rank resumes the step
its predecessor died in, not the predecessor's snapshot from steps back.

What a live resume needs of each rank (live.py) is its small state at the step's start and its
large state as it was then. A dead rank's large state died with it, but in data-parallel training
every survivor holds an equal copy; its small state (RNGs, data position, buffers) is its own, and
small. So under ``resilient launch`` (a node-local shared-memory directory that outlives the
worker) each rank also writes its step-start capture's small part there, at every step
(:class:`LiveMirror`, one file replaced atomically). A replacement offers that capture to the
recovery barrier; the survivors offer their live state as for a soft fault.

A survivor's copy stands in for the dead rank's only where it is shown equal: each rank's store
store_copy posts, with every mirrored snapshot, a fingerprint of each large object
(``resume.StoreCopy``). A survivor whose posted fingerprints of the same snapshot step equal
the dead rank's, at a step after training began (equal because trained alike, not because
started alike), donates: from there both applied the same all-reduced updates. The recovery
barrier's plan names the donor (``live_donors``, from ``agreement.donors``); in the next
generation, as each model and optimizer is tracked again, the donor sends its live state and the
replacement loads it under its predecessor's own buffers and hyperparameters. Anything else (no
mirror, a capture of another step or generation, accumulated gradients, a sharded state whose
fingerprints differ, a node lost with its shared memory) falls back to the ring, and the event
says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from resilient.runtime.keeping import buddy as buddy_mod
from resilient.runtime.keeping.buddy import Buddy
from resilient.runtime.keeping.resume import StoreCopy, fingerprint, recv_tree, send_tree
from resilient.runtime.run.generation import PendingRestore
from resilient.runtime.steps.live import LiveResume
from resilient.runtime.steps.mirror import LiveMirror, Mirrored
from resilient.state.registry import RNG, Registry


@dataclass
class FromPeer:
    """A model's or an optimizer's state, to come from ``donor`` as it is tracked again."""

    donor: int
    buffers: dict[str, Any] | None
    groups: list[dict[str, Any]] | None

    def under_own(self, got: dict[str, Any]) -> dict[str, Any]:
        """The donor's state under the dead rank's own small parts."""
        if self.groups is not None:
            groups = [dict(g, **h) for g, h in zip(got["param_groups"], self.groups, strict=True)]
            return {**got, "param_groups": groups}
        return {**got, **(self.buffers or {})}


class Handover:
    """The loop's side of a live resume across a hard fault (see the module docstring). Off
    (``mirror`` None) outside ``resilient launch``, alone, or without a store copy."""

    def __init__(
        self,
        rank: int,
        mirror: LiveMirror | None = None,
        store_copy: StoreCopy | None = None,
        buddy: Buddy | None = None,
    ) -> None:
        self.rank = rank
        self.buddy = buddy  # the copies this rank holds of another node's rank (keeping/buddy.py)
        self.mirror = mirror if store_copy is not None and store_copy.max_bytes > 0 else None
        self.store_copy = store_copy
        self.since: int | None = None  # where this process's large state last came from elsewhere
        self.joined: Mirrored | None = None  # a replacement's predecessor's capture, once offered
        # a replacement with no predecessor on its node (its node was lost): its predecessor's
        # store copies by snapshot step, (small objects, fingerprints of the others)
        self.stored: dict[int, tuple[dict[str, Any], dict[str, str]]] = {}

    def captured(self, live: LiveResume, generation: int) -> None:
        if self.mirror is not None and live.enabled and live.cap is not None:
            self.mirror.write(live.cap, generation)

    def started(self, step: int) -> None:
        """The process's state was set at ``step`` by a start, a checkpoint or a peer's copy."""
        self.since = step

    # -- the offers ---------------------------------------------------------------------------------
    def vouch(self, offer: dict[str, Any], symptom: str | None, registry: Registry) -> dict[str, Any]:
        """A survivor's offer, with its posted fingerprints for a replacement's: a peer's death
        may be seen first as a broken collective or a hang, so they go with every live offer."""
        if self.mirror is None or self.since is None:
            return {**offer, **self.held()}  # (vouched with a refused offer too: see below)
        large = [
            n
            for n, o in zip(registry.names(), registry.objects(), strict=True)
            if isinstance(o, torch.nn.Module | torch.optim.Optimizer)
        ]
        return {**offer, "vouch": {"since": self.since, "prints": self._prints(large)}, **self.held()}

    def held(self) -> dict[str, Any]:
        """The buddy copies this rank offers for a replacement whose state no replica holds."""
        if self.buddy is None:
            return {}
        try:
            return {"buddy": self.buddy.held()}
        except OSError as e:  # (a second line of defence: the checkpoint)
            logger.warning(f"rank {self.rank}: buddy copies not offered: {e}")
            return {}

    def replacement_offer(self, generation: int, predecessor: int | None) -> dict[str, Any]:
        """A replacement's offer: its predecessor's last capture (``predecessor``: its pid)."""
        why = "not under resilient launch with a store copy"
        got = self.mirror.read() if self.mirror is not None else why
        if isinstance(got, str):
            return {"why": f"a replacement: {got}", "replacement": True, **self._stored_offer()}
        if predecessor is not None and got.pid != predecessor:
            return {"why": f"a replacement: the live capture was written by pid {got.pid}, not {predecessor}"}
        if got.generation != generation:
            why = f"its predecessor's last capture was in generation {got.generation}, not {generation}"
            return {"why": f"a replacement: {why}"}
        self.joined = got
        return {"step": got.step, "seq": got.seq, "mirrored": {"prints": self._prints(got.large)}}

    def _stored_offer(self) -> dict[str, Any]:
        """A replacement without its predecessor's capture (a new node, the lost one's memory
        gone): the snapshot steps its predecessor posted to the store copy with every RNG, offered
        for the ring's step: the small objects from there, the others from a survivor whose
        posted fingerprints equal them (``agreement.stored_donors``)."""
        if self.store_copy is None or self.store_copy.max_bytes <= 0:
            return {}
        try:
            for step in self.store_copy.own_steps():
                got = self.store_copy.read(self.rank, step)
                if got is not None and RNG in got[0]:
                    self.stored[step] = got
        except Exception as e:  # (the store copy is a second line of defence: the checkpoint)
            logger.warning(f"rank {self.rank}: its predecessor's store copy not read: {e}")
            self.stored = {}
        if not self.stored:
            return {}
        return {"stored": {str(k): prints for k, (_, prints) in self.stored.items()}}

    def stored_steps(self) -> list[int]:
        """The snapshot steps a replacement can restore from the store copy and a peer."""
        return sorted(self.stored, reverse=True)

    def stored_state(
        self, step: int, donor: int | None, holder: tuple[str, int] | None = None
    ) -> dict[str, Any]:
        """A replacement's state of ``step``: its predecessor's small objects from the store copy,
        the others from its buddy copy at ``holder`` (read now, each object checked against the
        fingerprint its predecessor posted), else to come from ``donor``'s snapshot of that step
        as each is tracked again."""
        small, prints = self.stored[step]
        state: dict[str, Any] = dict(small)
        if holder is not None:
            state.update(buddy_mod.fetch(holder, self.rank, step, prints))
        else:
            for name in prints:
                assert donor is not None  # (the plan names one wherever a fingerprint was posted)
                state[name] = FromPeer(donor, None, None)
        self.started(step)
        return state

    def _prints(self, names: list[str]) -> dict[str, dict[str, str]]:
        """{snapshot step: {name: fingerprint}} of what this rank (or its predecessor) posted."""
        assert self.store_copy is not None
        out: dict[str, dict[str, str]] = {}
        try:
            for step in self.store_copy.own_steps():
                got = self.store_copy.read(self.rank, step)
                if got is None:
                    continue
                small, prints = got
                have = {n: prints.get(n) or (fingerprint(small[n]) if n in small else None) for n in names}
                if all(have.values()):
                    out[str(step)] = {n: str(f) for n, f in have.items()}
        except Exception as e:  # (the store is a second line of defence: no vouch, the ring)
            logger.warning(f"rank {self.rank}: posted fingerprints not read: {e}")
        return out

    # -- the restore --------------------------------------------------------------------------------
    def replacement_state(self, donor: int) -> dict[str, Any]:
        m = self.joined
        assert m is not None
        state: dict[str, Any] = dict(m.small)
        for name in m.large:
            state[name] = FromPeer(donor, m.buffers.get(name), m.groups.get(name))
        state[RNG] = m.rng
        self.started(m.step)
        return state

    def value(self, name: str, obj: Any, r: PendingRestore) -> Any:
        """What ``name`` loads in the next generation: a donor sends its live state on, a
        replacement receives it."""
        v = r.state[name]
        if isinstance(v, FromPeer):
            got = recv_tree(v.donor, device=_device())
            v = r.state[name] = v.under_own(got[name])
        elif r.send_to and isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
            for dst in [d for d in r.send_to if d not in r.send_only or name in r.send_only[d]]:
                send_tree({name: v}, dst, device=_device())
        return v


def _device() -> str:
    """Where the generation's group takes the tensors it sends from."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"
