"""When to take the in-memory snapshot: a fixed interval, or ``auto`` (calibrated once).

The schedule must be the same function of the step index on every rank — otherwise two ranks
could hold no common snapshot step after a fault. ``auto`` therefore snapshots every step until
step ``ADOPT_AT``; rank 0 measures the copy time against the step time at ``CALIBRATE_AT`` and
publishes the smallest interval within ``max_overhead``; every rank adopts that one value at
``ADOPT_AT`` (by then rank 0 has long passed ``CALIBRATE_AT``: each step holds a collective).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from resilient.config import SnapshotConfig

CALIBRATE_AT = 5
ADOPT_AT = 10


class SnapshotSchedule:
    def __init__(self, cfg: SnapshotConfig, rank: int, store: dist.Store, key: str) -> None:
        self.fixed = cfg.interval if isinstance(cfg.interval, int) else None
        self.max_overhead = cfg.max_overhead
        self.rank = rank
        self._store = store
        self._key = key
        self.interval: int | None = self.fixed
        self._step_s: list[float] = []
        self._capture_s: list[float] = []
        self.base = 0  # the step this process started at (a resumed checkpoint's step)

    def rebase(self, step: int) -> None:
        """Calibrate relative to ``step``: a run resumed from a checkpoint starts there."""
        self.base = step

    def due(self, nxt: int, total: int) -> bool:
        """Whether the state after ``nxt`` completed steps is snapshotted."""
        if nxt == total:
            return True
        if self.fixed is not None:
            return nxt % self.fixed == 0
        k = nxt - self.base
        if k <= ADOPT_AT or self.interval is None:
            return True
        return (k - ADOPT_AT) % self.interval == 0

    def observe(self, nxt: int, step_s: float | None, capture_s: float | None) -> None:
        k = nxt - self.base
        if self.fixed is not None or k > ADOPT_AT:
            return
        if k > 1 and step_s is not None:  # the first step carries warm-up
            self._step_s.append(step_s)
        if capture_s is not None:
            self._capture_s.append(capture_s)
        if k == CALIBRATE_AT and self.rank == 0:
            self._store.compare_set(self._key, "", str(self.choose()))
        if k == ADOPT_AT and self.interval is None:
            self.interval = int(self._store.get(self._key))

    def choose(self) -> int:
        """Smallest interval whose snapshot cost per step fits ``max_overhead`` of a step."""
        if not self._step_s or not self._capture_s:
            return 1
        step = sorted(self._step_s)[len(self._step_s) // 2]
        cap = sorted(self._capture_s)[len(self._capture_s) // 2]
        return max(1, math.ceil(cap / (self.max_overhead * max(step, 1e-9))))
