"""In-memory snapshots of the last good steps, copied into reused host buffers.

A ring of two slots: the newest complete snapshot is never overwritten while the next one is
being written, so an interrupt in the middle of a copy leaves the previous snapshot intact. Ranks
can be one snapshot apart after a fault (rank 0 finished step k, rank 1 failed inside it); the
runtime restores the newest step that *every* rank holds, which is why two slots are kept.

Tensor leaves are copied into host buffers allocated once per (path, shape, dtype) and reused:
no allocation per snapshot. CUDA tensors land in pinned buffers (non-blocking copy, then one
synchronize), so a CUDA fault cannot take the snapshot with it.

A snapshot may carry the exact sum of each tensor leaf's bytes, taken from the live tensors it was
copied from (``sdc``: :mod:`resilient.state.digest`); it is then verified against its copy before
it is restored, and a copy that no longer matches (a flipped bit in host memory) is never loaded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.errors import SnapshotError, StateRestoreError
from resilient.state.digest import Leaf, tensor_sums
from resilient.state.tree import map_leaves, map_with_path


@dataclass(frozen=True)
class _Ref:
    """Placeholder for a tensor leaf in a snapshot tree."""

    path: str
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class Frozen:
    """A leaf kept by reference: the producer guarantees it is a fresh object nobody mutates
    (``random.getstate()``, ``np.random.get_state()``), which saves walking 625-tuples each step."""

    value: Any


@dataclass
class _Slot:
    step: int = -1
    valid: bool = False
    tree: Any = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    loader: Callable[[], dict[str, Any]] | None = None  # adopted: the state lives elsewhere
    sums: dict[str, Leaf] | None = None  # each tensor leaf's byte sum when captured, if taken
    verified: bool = False  # the copy was found to match ``sums`` since it was captured


class CorruptSnapshot(StateRestoreError):
    """A snapshot's copy no longer matches the sums taken when it was captured."""


class SnapshotRing:
    """Two-slot ring of host snapshots keyed by the step they resume at."""

    def __init__(self, slots: int = 2) -> None:
        self._slots = [_Slot() for _ in range(slots)]
        self.nbytes = 0

    def steps(self) -> list[int]:
        return sorted((s.step for s in self._slots if s.valid), reverse=True)

    def adopt(self, step: int, loader: Callable[[], dict[str, Any]]) -> None:
        """Hold ``step`` without copying it: ``loader()`` returns a fresh copy of its state. Used
        right after a restore from a shared-memory snapshot, which stays whole at least as long
        as this ring keeps the step (both keep the two newest, captured together): the 1 GB copy
        that would delay the first step after a relaunch is not made."""
        if any(s.valid and s.step == step for s in self._slots):
            return
        slot = min(self._slots, key=lambda s: (s.valid, s.step))
        slot.step, slot.tree, slot.loader, slot.valid, slot.sums = step, None, loader, True, None

    def capture(self, step: int, state: dict[str, Any], sums: dict[str, Leaf] | None = None) -> None:
        """Copy ``state`` (nested dicts/lists with tensor leaves) as the snapshot for ``step``;
        ``sums``: each tensor leaf's byte sum, by path, taken from ``state`` (verified on restore)."""
        if any(s.valid and s.step == step for s in self._slots):
            return
        slot = min(self._slots, key=lambda s: (s.valid, s.step))  # an empty slot, else the oldest
        slot.valid = False
        slot.loader = None
        slot.sums, slot.verified = sums, False
        cuda_copies = False
        at = ""  # the leaf being copied, for the error

        def copy_tensor(obj: torch.Tensor, path: str) -> _Ref:
            nonlocal cuda_copies, at
            at = path
            src = obj.detach()
            buf = slot.buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                old = slot.buffers.get(path)
                if old is not None:
                    self.nbytes -= old.numel() * old.element_size()
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                slot.buffers[path] = buf
                self.nbytes += buf.numel() * buf.element_size()  # counted on allocation only
            buf.copy_(src, non_blocking=src.is_cuda)
            cuda_copies |= src.is_cuda
            return _Ref(path, str(src.device), obj.requires_grad)

        def copy_other(obj: Any, path: str) -> Any:
            nonlocal at
            at = path
            return obj if isinstance(obj, Frozen) else copy.deepcopy(obj)

        try:
            slot.tree = map_with_path(copy_other, state, typed=(torch.Tensor, copy_tensor))
        except Exception as e:
            name, _, leaf = at.lstrip("/").partition("/")
            raise SnapshotError(
                f"snapshot of step {step}: tracked object {name!r}, leaf {leaf or '(root)'!r}: "
                f"{type(e).__name__}: {e}"
            ) from e
        if cuda_copies:
            torch.cuda.synchronize()
        slot.step = step
        slot.valid = True

    def materialize(self, step: int) -> dict[str, Any]:
        """A fresh copy of the snapshot for ``step``: tensors cloned back to their original device.

        Cloning matters: ``Optimizer.load_state_dict`` keeps the tensors it is given, so handing it
        our buffers would let the next optimizer step write into the snapshot.
        """
        slot = next((s for s in self._slots if s.valid and s.step == step), None)
        if slot is None:
            raise StateRestoreError(f"no snapshot for step {step}; held: {self.steps()}")
        why = self._check(slot)
        if why is not None:
            slot.valid = False
            raise CorruptSnapshot(f"the snapshot of step {step} is corrupt and is not restored: {why}")
        if slot.loader is not None:
            try:
                return slot.loader()
            except Exception as e:
                raise StateRestoreError(f"adopted snapshot of step {step} does not load: {e}") from e

        def restore_tensor(ref: _Ref) -> torch.Tensor:
            t = slot.buffers[ref.path].to(ref.device, copy=True)
            return t.requires_grad_(ref.requires_grad) if t.is_floating_point() else t

        def restore_other(obj: Any) -> Any:
            return obj.value if isinstance(obj, Frozen) else copy.deepcopy(obj)

        return dict(map_leaves(restore_other, slot.tree, typed=(_Ref, restore_tensor)))

    def _check(self, slot: _Slot) -> str | None:
        """Why ``slot``'s copy does not match the sums taken at capture (None: it does, or none
        were taken). One pass over the host copy, once per capture."""
        if slot.sums is None or slot.verified or slot.loader is not None:
            return None
        paths = [p for p in slot.sums if p in slot.buffers]
        now = tensor_sums([slot.buffers[p] for p in paths])
        for p, total in zip(paths, now, strict=True):
            if total != slot.sums[p][0]:
                return f"leaf {p!r}: byte sum {total:#x}, {slot.sums[p][0]:#x} when captured"
        missing = sorted(set(slot.sums) - set(paths))
        if missing:
            return f"leaves {missing[:3]} were captured but have no copy"
        slot.verified = True
        return None

    def drop_corrupt(self) -> list[tuple[int, str]]:
        """Verify every snapshot held (see :meth:`_check`) and drop those that fail: ``(step, why)``."""
        dropped = []
        for slot in self._slots:
            if slot.valid and (why := self._check(slot)) is not None:
                slot.valid = False
                dropped.append((slot.step, why))
        return dropped

    def drop_after(self, step: int) -> None:
        """Invalidate snapshots newer than ``step`` (after restoring an older one)."""
        for s in self._slots:
            if s.valid and s.step > step:
                s.valid = False
