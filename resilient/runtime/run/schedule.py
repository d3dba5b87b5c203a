"""When to keep the state: a fixed interval, or ``auto`` (calibrated once, early in the run).

The schedule must be the same function of the step index on every rank — otherwise two ranks
could hold no common snapshot step after a fault. ``auto`` therefore keeps the state at a few
fixed sample steps (``SAMPLES``: the first step carries warm-up, so it is not one); rank 0
measures what keeping it cost against the step time up to ``CALIBRATE_AT`` and publishes the
smallest interval within its budget; every rank adopts that one value at ``ADOPT_AT`` (a blocking
read: a rank that gets there first waits for rank 0's value).

The budget is ``snapshot.max_overhead`` times ``share``: the in-memory ring and, under
``resilient launch``, the shared-memory mirror each get half, so together they stay within it.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from resilient.config import SnapshotConfig

SAMPLES = (2, 3, 4, 5)  # steps since the start (or resume) at which auto keeps the state to measure it
CALIBRATE_AT = SAMPLES[-1]
ADOPT_AT = 8


class SnapshotSchedule:
    def __init__(
        self, cfg: SnapshotConfig, rank: int, store: dist.Store, key: str, share: float = 1.0
    ) -> None:
        self.fixed = cfg.interval if isinstance(cfg.interval, int) else None
        self.budget = cfg.max_overhead * share
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

    def due(self, nxt: int, total: int | None) -> bool:
        """Whether the state after ``nxt`` completed steps is kept."""
        if nxt == total:
            return True
        if self.fixed is not None:
            return nxt % self.fixed == 0
        k = nxt - self.base
        if k < ADOPT_AT:
            return k in SAMPLES
        if self.interval is None:  # (observe() normally adopted it one step earlier)
            self.interval = self._adopt()
        return (k - ADOPT_AT) % self.interval == 0

    def calibrating(self, nxt: int) -> bool:
        """Whether the state kept after ``nxt`` completed steps is one ``auto`` measures."""
        return self.fixed is None and nxt - self.base in SAMPLES

    def observe(self, nxt: int, step_s: float | None, capture_s: float | None) -> None:
        k = nxt - self.base
        if self.fixed is not None or k > ADOPT_AT:
            return
        if k > 1 and step_s is not None:  # the first step carries warm-up
            self._step_s.append(step_s)
        if capture_s is not None and k in SAMPLES:
            self._capture_s.append(capture_s)
        if k == CALIBRATE_AT and self.rank == 0:
            self._store.compare_set(self._key, "", str(self.choose()))
        if k == ADOPT_AT - 1 and self.interval is None:  # in force from the next step on
            self.interval = self._adopt()

    def _adopt(self) -> int:
        """Take rank 0's interval. Rank 0 proposes again first (a no-op when it did at
        CALIBRATE_AT): a peer's fault can interrupt rank 0's step between its snapshot and this
        schedule's observation of it, and a restore to a later step then skips CALIBRATE_AT; every
        rank, rank 0 too, would wait for a key no one writes."""
        if self.rank == 0:
            self._store.compare_set(self._key, "", str(self.choose()))
        return int(self._store.get(self._key))

    def choose(self) -> int:
        """Smallest interval whose cost per step fits the budget (a share of a step's time)."""
        if not self._step_s or not self._capture_s:
            return 1
        step = sorted(self._step_s)[len(self._step_s) // 2]
        cap = sorted(self._capture_s)[len(self._capture_s) // 2]
        return max(1, math.ceil(cap / (self.budget * max(step, 1e-9))))
