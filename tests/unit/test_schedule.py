"""The snapshot schedule: every rank keeps the same steps; auto measures a few samples, then keeps
the state at the smallest interval within its share of the budget."""

from __future__ import annotations

import torch.distributed as dist

from resilient.config import SnapshotConfig
from resilient.runtime.run.schedule import ADOPT_AT, SAMPLES, SnapshotSchedule


def _run(sched: SnapshotSchedule, total: int, step_s: float, capture_s: float) -> list[int]:
    kept = []
    for step in range(total):
        nxt = step + 1
        due = sched.due(nxt, total)
        kept += [nxt] if due else []
        sched.observe(nxt, step_s, capture_s if due else None)
    return kept


def test_auto_samples_a_few_steps_then_keeps_the_budgeted_interval() -> None:
    store = dist.HashStore()
    cfg = SnapshotConfig(max_overhead=0.01)
    kept = _run(SnapshotSchedule(cfg, 0, store, "iv"), 60, step_s=0.05, capture_s=0.002)
    # 2 ms per kept state against 1% of a 50 ms step: every 4th step
    assert kept[: len(SAMPLES)] == list(SAMPLES)
    assert kept[len(SAMPLES) :] == [*range(ADOPT_AT, 60, 4), 60][: len(kept) - len(SAMPLES)]
    assert kept[-1] == 60  # the last step is always kept


def test_every_rank_keeps_the_same_steps_as_rank_0_chose() -> None:
    store = dist.HashStore()
    cfg = SnapshotConfig(max_overhead=0.01)
    r0 = _run(SnapshotSchedule(cfg, 0, store, "iv"), 40, step_s=0.05, capture_s=0.002)
    r1 = _run(SnapshotSchedule(cfg, 1, store, "iv"), 40, step_s=0.05, capture_s=0.02)  # slower: ignored
    assert r0 == r1


def test_a_half_share_doubles_the_interval() -> None:
    cfg = SnapshotConfig(max_overhead=0.01)
    full = SnapshotSchedule(cfg, 0, dist.HashStore(), "iv")
    half = SnapshotSchedule(cfg, 0, dist.HashStore(), "iv", share=0.5)
    _run(full, 20, 0.05, 0.002)
    _run(half, 20, 0.05, 0.002)
    assert (full.interval, half.interval) == (4, 8)


def test_a_fixed_interval_needs_no_calibration() -> None:
    kept = _run(SnapshotSchedule(SnapshotConfig(interval=5), 0, dist.HashStore(), "iv"), 22, 0.05, 0.01)
    assert kept == [5, 10, 15, 20, 22]


def test_rank_0_missing_its_calibration_step_still_decides() -> None:
    """A peer's fault interrupted rank 0 between a snapshot and its observation at CALIBRATE_AT;
    the restore then resumes past it. Rank 0 and a peer adopt the same interval, no one waits."""
    store = dist.HashStore()
    store.set_timeout(__import__("datetime").timedelta(seconds=2))  # a wait for a missing key fails
    cfg = SnapshotConfig(max_overhead=0.01)
    ranks = [SnapshotSchedule(cfg, r, store, "iv") for r in (0, 1)]
    for nxt in range(2, ADOPT_AT + 3):
        for r, sched in enumerate(ranks):
            if r == 0 and nxt == SAMPLES[-1]:
                continue  # rank 0 never observed CALIBRATE_AT
            sched.due(nxt, None)
            sched.observe(nxt, 0.05, 0.002 if nxt in SAMPLES else None)
    assert ranks[0].interval == ranks[1].interval is not None
