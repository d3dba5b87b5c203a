"""In-memory snapshots of the last good steps, copied into reused host buffers.

A ring of two slots: the newest complete snapshot is never overwritten while the next one is
being written, so an interrupt in the middle of a copy leaves the previous snapshot intact. Ranks
can be one snapshot apart after a fault (rank 0 finished step k, rank 1 failed inside it); the
runtime restores the newest step that *every* rank holds, which is why two slots are kept.

Tensor leaves are copied into host buffers allocated once per (path, shape, dtype) and reused:
no allocation per snapshot. CUDA tensors land in pinned buffers (non-blocking copy, then one
synchronize), so a CUDA fault cannot take the snapshot with it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.errors import SnapshotError, StateRestoreError
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
        slot.step, slot.tree, slot.loader, slot.valid = step, None, loader, True

    def capture(self, step: int, state: dict[str, Any]) -> None:
        """Copy ``state`` (nested dicts/lists with tensor leaves) as the snapshot for ``step``."""
        if any(s.valid and s.step == step for s in self._slots):
            return
        slot = min(self._slots, key=lambda s: (s.valid, s.step))  # an empty slot, else the oldest
        slot.valid = False
        slot.loader = None
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

    def drop_after(self, step: int) -> None:
        """Invalidate snapshots newer than ``step`` (after restoring an older one)."""
        for s in self._slots:
            if s.valid and s.step > step:
                s.valid = False
