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
replica posts, with every mirrored snapshot, a fingerprint of each large object
(``resume.StoreReplica``). A survivor whose posted fingerprints of the same snapshot step equal
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

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from loguru import logger

from resilient.errors import CheckpointError
from resilient.runtime.keeping.resume import StoreReplica, fingerprint, pack, recv_tree, send_tree, unpack
from resilient.runtime.steps.generation import PendingRestore
from resilient.runtime.steps.live import LiveResume, _Capture, _Later
from resilient.state.registry import RNG, Registry

FILE = "live-capture.bin"


@dataclass
class Mirrored:
    """A dead rank's last step-start capture, as its mirror file holds it."""

    step: int
    seq: int
    generation: int
    pid: int  # the process that wrote it
    large: list[str]  # the models and optimizers, whose state a survivor sends
    small: dict[str, Any]  # the other tracked objects' states
    buffers: dict[str, dict[str, Any]]  # each model's own buffers (and extra state)
    groups: dict[str, list[dict[str, Any]]]  # each optimizer's own hyperparameters
    rng: dict[str, Any]


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


class LiveMirror:
    """This rank's step-start captures, written to ``directory`` (a file replaced whole)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE
        self._tmp = directory / f".{FILE}.tmp"
        self._warned = False

    def write(self, cap: _Capture, generation: int) -> None:
        record = _record(cap)
        meta: dict[str, Any] = {"step": cap.step, "seq": cap.seq, "generation": generation}
        meta["pid"] = os.getpid()
        body = b""
        if isinstance(record, str):
            meta["refused"] = record
        else:
            large, tree = record
            try:
                header, buf = pack(tree)
            except CheckpointError as e:  # (an object the codec does not take: a module's extra state)
                meta["refused"] = f"not mirrored: {e}"
            else:
                meta.update(large=large, **header)
                body = buf.numpy().tobytes()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._tmp, "wb") as f:
                f.write(json.dumps(meta).encode() + b"\n" + body)
            os.replace(self._tmp, self.path)
        except OSError as e:  # (a second line of defence: training goes on without it)
            if not self._warned:
                self._warned = True
                logger.warning(f"the live capture is not mirrored to {self.path}: {e}")

    def read(self) -> Mirrored | str:
        """The capture, or why there is none to offer."""
        try:
            raw = self.path.read_bytes()
        except OSError:
            return f"its predecessor left no live capture in {self.path.parent}"
        head, _, body = raw.partition(b"\n")
        try:
            meta = json.loads(head)
            if "refused" in meta:
                return f"its predecessor's capture of step {meta['step']}: {meta['refused']}"
            tree = unpack(meta, body, str(self.path))
            return Mirrored(
                int(meta["step"]), int(meta["seq"]), int(meta["generation"]), int(meta["pid"]),
                list(meta["large"]), tree["small"], tree["buffers"], tree["groups"], _native_rng(tree["rng"]),
            )  # fmt: skip
        except (CheckpointError, ValueError, KeyError, TypeError, RecursionError) as e:
            return f"its predecessor's live capture does not parse: {e}"


def _record(cap: _Capture) -> tuple[list[str], dict[str, Any]] | str:
    """The small part of a capture (and the names of the large objects), or why it is not enough."""
    if cap.refused:
        return cap.refused
    small: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    large: list[str] = []
    for name, kept in cap.objects.items():
        if kept.state is not None:
            if isinstance(kept.state, _Later):  # (read back from the device only at a restore)
                return f"{name!r}: a device GradScaler is not mirrored at each step"
            small[name] = kept.state
        elif kept.groups is not None:
            groups[name] = kept.groups
            large.append(name)
        else:
            if kept.grads is not None:
                return f"{name!r}: its pending accumulated gradients are the rank's own"
            if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in kept.buffers.values()):
                return f"{name!r}: its buffers live on the device (not read back at each step)"
            buffers[name] = kept.buffers
            large.append(name)
    return large, {"small": small, "buffers": buffers, "groups": groups, "rng": _packable_rng(cap.rng)}


def _packable_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """Python's generator state with its 625 words in one array: the codec walks a tuple of ints
    word by word, at every step."""
    version, words, gauss = rng["python"].value
    return {**rng, "python": [version, np.asarray(words, dtype=np.int64), gauss]}


def _native_rng(rng: dict[str, Any]) -> dict[str, Any]:
    version, words, gauss = rng["python"]
    return {**rng, "python": (version, tuple(int(w) for w in words), gauss)}


class Handover:
    """The loop's side of a live resume across a hard fault (see the module docstring). Off
    (``mirror`` None) outside ``resilient launch``, alone, or without a store replica."""

    def __init__(
        self, rank: int, mirror: LiveMirror | None = None, replica: StoreReplica | None = None
    ) -> None:
        self.rank = rank
        self.mirror = mirror if replica is not None and replica.max_bytes > 0 else None
        self.replica = replica
        self.since: int | None = None  # where this process's large state last came from elsewhere
        self.joined: Mirrored | None = None  # a replacement's predecessor's capture, once offered

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
        if self.mirror is None or "step" not in offer or self.since is None:
            return offer
        large = [
            n for n, o in zip(registry.names(), registry.objects(), strict=True)
            if isinstance(o, torch.nn.Module | torch.optim.Optimizer)
        ]  # fmt: skip
        return {**offer, "vouch": {"since": self.since, "prints": self._prints(large)}}

    def replacement_offer(self, generation: int, predecessor: int | None) -> dict[str, Any]:
        """A replacement's offer: its predecessor's last capture (``predecessor``: its pid)."""
        why = "not under resilient launch with a store replica"
        got = self.mirror.read() if self.mirror is not None else why
        if isinstance(got, str):
            return {"why": f"a replacement: {got}"}
        if predecessor is not None and got.pid != predecessor:
            return {"why": f"a replacement: the live capture was written by pid {got.pid}, not {predecessor}"}
        if got.generation != generation:
            why = f"its predecessor's last capture was in generation {got.generation}, not {generation}"
            return {"why": f"a replacement: {why}"}
        self.joined = got
        return {"step": got.step, "seq": got.seq, "mirrored": {"prints": self._prints(got.large)}}

    def _prints(self, names: list[str]) -> dict[str, dict[str, str]]:
        """{snapshot step: {name: fingerprint}} of what this rank (or its predecessor) posted."""
        assert self.replica is not None
        out: dict[str, dict[str, str]] = {}
        try:
            for step in self.replica.own_steps():
                got = self.replica.read(self.rank, step)
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
            for dst in r.send_to:
                send_tree({name: v}, dst, device=_device())
        return v


def _device() -> str:
    """Where the generation's group takes the tensors it sends from."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"
