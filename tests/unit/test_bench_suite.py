"""The peer benchmark's own arithmetic: seeded schedules and recovery figures from progress lines."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

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


def test_goodput_counts_each_step_once_and_not_the_wait_for_a_recovery() -> None:
    # launched at 0, steps of 0.1 s from t=1.0; a fault at t=1.45 (in step 5); the same process
    # resumes live at step 5, completed at t=2.5 (the recovery's wait in that gap), then on
    prog = [_p(1.0 + 0.1 * s, s, 0) for s in range(5)]
    prog += [_p(2.5 + 0.1 * (s - 5), s, 0) for s in range(5, 10)]
    run = {"progress": prog, "launched": 0.0, "ended": 2.9, "faults": [{"ts": 1.45, "kind": "exception"}]}
    got = suite.goodput(run)
    # step 0 (its process's first) and step 5 (a fault in its gap) count the median step, 0.1
    assert math.isclose(got["productive_s"], 1.0)
    assert math.isclose(got["wall_s"], 2.9)
    assert math.isclose(got["goodput"], 1.0 / 2.9)


def test_goodput_counts_a_replayed_step_in_its_last_run_only() -> None:
    # steps 0-4, fault at 1.45; the same process rolls back to step 3 and runs 3-9 again
    prog = [_p(1.0 + 0.1 * s, s, 0) for s in range(5)]
    prog += [_p(2.5 + 0.2 * (s - 3), s, 0) for s in range(3, 10)]
    got = suite.goodput(
        {"progress": prog, "launched": 0.0, "ended": 4.0, "faults": [{"ts": 1.45, "kind": "hang"}]}
    )
    # the median of the clean gaps (0.1 x4, 0.2 x6) is 0.2; 0 (its first) and 3 (after step 4,
    # not 2) count it, 1 and 2 their 0.1, 4-9 their 0.2 of the replay (not 0.1 of the first run)
    assert math.isclose(got["step_s"], 0.2)
    assert math.isclose(got["productive_s"], 2 * 0.2 + 2 * 0.1 + 6 * 0.2)


def test_goodput_of_a_relaunched_process_counts_its_first_step_as_a_median_one() -> None:
    prog = [_p(1.0 + 0.1 * s, s, 0, pid=1) for s in range(5)]
    prog += [_p(4.0 + 0.2 * (s - 2), s, 0, pid=2) for s in range(2, 6)]  # relaunched from step 2
    got = suite.goodput(
        {"progress": prog, "launched": 0.0, "ended": 5.0, "faults": [{"ts": 1.45, "kind": "sigkill"}]}
    )
    # 0: median; 1: 0.1; 2: first of pid 2, median; 3-5: 0.2 each; the median of the clean gaps
    # (0.1 x4 from pid 1, 0.2 x3 from pid 2) is 0.1
    assert math.isclose(got["step_s"], 0.1)
    assert math.isclose(got["productive_s"], 0.1 + 0.1 + 0.1 + 3 * 0.2)


def test_a_peer_cell_has_its_median_its_range_and_what_it_did_instead() -> None:
    from benchmarks import work_lost_peers as wlp

    runs = [
        {"outcome": "recovered", "training_lost_s": x, "fault_step": 65, "steps_rerun": 0}
        for x in (1.0, 3.0, 2.0)
    ]
    cell = wlp.summarize(runs)
    assert cell["median"]["training_lost_s"] == 2.0 and cell["range"]["training_lost_s"] == [1.0, 3.0]
    assert suite.why_not(cell) is None
    went_on = "continued as 1 rank(s) without rank 1 (nothing replaces it)"
    cell = wlp.summarize([*runs[:1], {"outcome": went_on, "fault_step": 65}])
    assert suite.why_not(cell) == "1/2 recovered: continued as 1 rank(s) without rank 1"


def test_per_step_figures_over_the_whole_loop_and_its_second_half() -> None:
    # rank 0: steps 0..3 take 0.2 s each (one-off work beside it), steps 4..8 0.1 s; CPU 0.05 s each
    ts = [0.2 * s for s in range(5)] + [0.8 + 0.1 * (s - 4) for s in range(5, 9)]
    prog = [{**_p(t, s, 0), "cpu": 0.05 * s} for s, t in enumerate(ts)] + [_p(9.0, 8, 1)]
    run = {"progress": prog}
    assert math.isclose(suite._per_step(run, "t"), 1.2 / 8)
    assert math.isclose(suite._per_step(run, "t", half=True), 0.1)
    assert math.isclose(suite._per_step(run, "cpu"), 0.05)
    assert suite._per_step({"progress": [_p(0.0, 0, 0)]}, "cpu") is None  # (no CPU in the line)


def test_cpu_meter_reads_a_real_process_and_names_its_role(tmp_path) -> None:
    # a process in the job's directory burns CPU, then waits: its CPU time is sampled and counted
    # as a worker when its pid wrote progress, else as "other"
    burn = "\n".join(
        [
            "import sys, time",
            "t = time.process_time()",
            "while time.process_time() - t < 0.3: pass",
            "print(1, flush=True)",
            "sys.stdin.read()",
        ]
    )
    p = subprocess.Popen(
        [sys.executable, "-c", burn], cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"1"
        meter = suite.CpuMeter(tmp_path, root_pid=-1, every=0.0)
        meter.sample()
        roles = meter.by_role({p.pid})
        assert roles["workers"] >= 0.3 and roles["other"] == roles["launcher"] == roles["standby"] == 0.0
        assert meter.by_role(set())["other"] == roles["workers"]
    finally:
        p.kill()
        p.wait()
