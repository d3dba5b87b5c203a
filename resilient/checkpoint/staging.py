"""Host memory that a checkpoint's tensors are staged into before a background writer persists them.

The train step blocks only for this copy. Buffers are allocated once for a given layout (keys,
shapes, dtypes) and reused by every later save: no allocation, no page faults on the hot path. CUDA
tensors land in pinned memory (one non-blocking copy each, one synchronize). The arena can also be
backed by a file in ``/dev/shm`` so that the staged bytes outlive the process (see ``shm.py``).

Every tensor starts at a 64-byte aligned offset so that the same bytes can be viewed as any dtype.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from resilient.checkpoint.codec import Leaf, dtype_from_name, dtype_name

ALIGN = 64


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one staged tensor lives in the arena."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class StagedBytes(Protocol):
    """Where a writer reads the staged bytes of a slot: the :class:`Arena` itself, or (in the writer
    process) a read-only mapping of its file."""

    def bytes_of(self, slot: Slot) -> memoryview: ...


def plan(leaves: Sequence[Leaf], start: int = 0) -> list[Slot]:
    slots, off = [], aligned(start)
    for leaf in leaves:
        t = leaf.tensor
        n = t.numel() * t.element_size()
        slots.append(Slot(leaf.key, dtype_name(t.dtype), tuple(t.shape), off, n))
        off = aligned(off + n)
    return slots


def extent(slots: Sequence[Slot]) -> int:
    return aligned(max((s.offset + s.nbytes for s in slots), default=0))


def typed_view(buf: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The bytes of ``slot`` in the uint8 tensor ``buf``, viewed with the slot's dtype and shape."""
    raw = buf[slot.offset : slot.offset + slot.nbytes]
    return raw.view(dtype_from_name(slot.dtype)).view(slot.shape)


class Arena:
    """A reused uint8 host buffer; ``stage`` copies leaves into it following a layout."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path  # None: anonymous memory; else a file mapped shared (e.g. in /dev/shm)
        self._mm: mmap.mmap | None = None
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.slots: list[Slot] = []

    @property
    def capacity(self) -> int:
        return self.buf.numel()

    def _reserve(self, size: int, pin: bool) -> None:
        if size <= self.capacity and (not pin or self.buf.is_pinned() or self.path is not None):
            return
        if self.path is None:
            self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            return
        self.release()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        if pin and torch.cuda.is_available():
            torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), size, 0)

    def stage(self, leaves: Sequence[Leaf]) -> list[Slot]:
        """Copy ``leaves`` into the arena (reallocating only when the layout grows)."""
        slots = plan(leaves)
        cuda = any(leaf.tensor.is_cuda for leaf in leaves)
        self._reserve(extent(slots), pin=cuda)
        for leaf, slot in zip(leaves, slots, strict=True):
            typed_view(self.buf, slot).copy_(leaf.tensor, non_blocking=leaf.tensor.is_cuda)
        if cuda:
            torch.cuda.synchronize()
        self.slots = slots
        return slots

    def bytes_of(self, slot: Slot) -> memoryview:
        return self.buf[slot.offset : slot.offset + slot.nbytes].numpy().data.cast("B")

    def release(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a view still exists: unmapped with the last one
                self._mm.close()
            self._mm = None
