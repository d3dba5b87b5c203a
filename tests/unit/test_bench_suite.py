"""The peer benchmark's own arithmetic: seeded schedules and recovery figures from progress lines."""

from __future__ import annotations

import itertools
import math

from benchmarks import suite


def test_schedule_is_deterministic_spaced_and_covers_every_kind() -> None:
    a, b = suite.schedule(7, 600, 5), suite.schedule(7, 600, 5)
    assert a == b and suite.schedule(8, 600, 5) != a
    plan, kills, planned = a
    steps = [s for s, _ in planned]
    assert all(y - x >= 40 for x, y in itertools.pairwise(steps))
    assert {k for _, k in planned} == {"exception", "hang", "sigkill"}
    assert len(plan.split(",")) + len(kills) == 5  # in-process faults in the plan, kills by the driver


def _p(t: float, step: int, rank: int, pid: int = 1) -> dict:
    return {"t": t, "step": step, "rank": rank, "pid": pid, "attempt": 0}


def test_recovery_catch_up_and_steps_lost_from_progress() -> None:
    # both ranks step every 0.1 s to step 9; fault at t=1.05; resumed from step 6 at t=2.0 (rank 0)
    # and t=2.2 (rank 1), back at step 9 at t=2.3 / 2.5
    prog = [_p(0.1 * s, s, r) for s in range(10) for r in range(2)]
    prog += [_p(2.0 + 0.1 * (s - 6), s, 0, 2) for s in range(6, 12)]
    prog += [_p(2.2 + 0.1 * (s - 6), s, 1, 3) for s in range(6, 12)]
    run = {"progress": prog, "nproc": 2, "faults": [{"ts": 1.05, "kind": "sigkill"}]}
    (rec,) = suite.recoveries(run)
    assert math.isclose(rec["recover_s"], 2.2 - 1.05)
    assert math.isclose(rec["catchup_s"], 2.5 - 1.05)
    assert rec["lost"] == 4  # steps 6..9 ran twice


def test_a_fault_nobody_recovered_from_is_nan_not_a_number() -> None:
    prog = [_p(0.1 * s, s, r) for s in range(10) for r in range(2)]
    (rec,) = suite.recoveries({"progress": prog, "nproc": 2, "faults": [{"ts": 5.0, "kind": "hang"}]})
    assert math.isnan(rec["recover_s"])


def test_ratio_rows_say_who_is_ahead() -> None:
    assert suite._row("t", "p", 1.0, 3.0, lower_better=True)["ahead"] is True
    assert suite._row("g", "p", 0.9, 0.95, lower_better=False)["ahead"] is False
    assert suite._row("t", "p", None, 3.0, lower_better=True)["ahead"] is None


def test_zero_is_ahead_of_any_count_without_a_ratio() -> None:
    row = suite._row("steps run again", "p", 0, 5, lower_better=True)
    assert row["ratio"] is None and row["ahead"] is True
