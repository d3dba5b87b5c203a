"""The phases of an in-process recovery (resilient/metrics/phases.py), from synthetic event logs."""

from __future__ import annotations

from typing import Any

import pytest

from resilient.metrics import account
from resilient.metrics.phases import PHASES, fault_start, fmt, incident_phases, recovery_phases

T0 = 1_000_000.0
START = T0 + 10.0  # the fault (rank 1's exception)


def rank_log(r: int, m: dict[str, float], gen: int = 0, **parts: float) -> list[dict[str, Any]]:
    """One rank's records of the recovery from ``gen``, from its instants ``m`` (seconds after T0):
    noticed, detected (the record's ts), left, checked, agreed, prepared, freed, rebuilt, entered,
    restored, resumed. The parts (prepare_s, build_s, load_s) are the differences they imply."""

    def rec(t: float, event: str, g: int = gen, **kw: Any) -> dict[str, Any]:
        return {"ts": T0 + t, "event": event, "rank": r, "pid": 100 + r, "generation": g, "step": 20, **kw}

    return [
        rec(m["detected"], "fault_detected", kind="exception", origin_rank=1, origin_step=20,
            origin_ts=START, origin_latency_s=0.0, noticed_ts=T0 + m["noticed"]),
        rec(m["left"], "group_aborted"),
        rec(m["checked"], "health_checked", ok=True),
        rec(m["prepared"], "restore_agreed", fault_step=20, barrier_s=0.004, verify_s=0.001,
            prepare_s=round(m["prepared"] - m["agreed"], 9), duration_s=0.05, **parts),
        rec(m["rebuilt"], "group_rebuilt", gen + 1, gc_s=0.001, build_s=round(m["rebuilt"] - m["freed"], 9)),
        rec(m["restored"], "state_restored", gen + 1, steps_rerun=10,
            load_s=round(m["restored"] - m["entered"], 9)),
        rec(m["resumed"], "step_completed", gen + 1, step=10),
        rec(m["resumed"] + 0.001, "step_resumed", gen + 1, step=10),
        rec(m["resumed"] + 0.1, "step_completed", gen + 1, step=11),
    ]  # fmt: skip


# rank 1 faulted and knew first; its health check was slow, and rank 0 waited for it in the barrier
R0 = dict(noticed=10.010, detected=10.011, left=10.020, checked=10.030, agreed=10.090, prepared=10.100,
          freed=10.120, rebuilt=10.150, entered=10.195, restored=10.200, resumed=10.300)  # fmt: skip
R1 = dict(noticed=10.002, detected=10.003, left=10.025, checked=10.080, agreed=10.089, prepared=10.101,
          freed=10.130, rebuilt=10.152, entered=10.200, restored=10.210, resumed=10.310)  # fmt: skip
TWO = {  # the phases of R0 and R1 (ms), and the rank that ended each last
    "detect": (10.0, 0),  # rank 0 noticed at 10.010
    "leave": (15.0, 1),  # 10.010 -> rank 1 aborted at 10.025
    "health": (55.0, 1),  # -> 10.080: rank 1's slow check, charged here
    "agree": (10.0, 0),  # -> 10.090, not the 60 ms rank 0 waited in the barrier
    "free": (29.0, 1),  # prepared 10.101 -> freed 10.130
    "rebuild": (22.0, 1),  # -> 10.152
    "restore": (21.0, 1),  # materialized 10.090 -> 10.101, loaded 10.200 -> 10.210
    "reenter": (48.0, 1),  # 10.152 -> 10.200
    "rerun": (100.0, 1),  # 10.210 -> 10.310
}


def two_ranks() -> list[dict[str, Any]]:
    return sorted(rank_log(0, R0) + rank_log(1, R1), key=lambda e: e["ts"])


def ms(p: Any) -> dict[str, float | None]:
    return {k: None if v is None else round(1e3 * v, 3) for k, v in p.seconds.items()}


def test_the_phases_add_up_to_the_fault_until_every_rank_stepped_again():
    p = incident_phases(two_ranks(), START)
    assert p is not None and p.complete() and p.generation == 0
    assert ms(p) == {k: v for k, (v, _) in TWO.items()}
    assert list(p.seconds) == list(PHASES)
    assert p.total == pytest.approx(0.310)  # 10.000 -> rank 1's first step at 10.310
    assert sum(v for v in p.seconds.values() if v is not None) == pytest.approx(p.total)
    # the agreement's parts, of the rank that materialized last (rank 1), not duration_s
    assert p.agree_parts == {"barrier_s": 0.004, "verify_s": 0.001, "prepare_s": 0.012}


def test_a_late_rank_is_charged_to_its_phase_and_named():
    p = incident_phases(two_ranks(), START)
    assert p is not None
    assert p.ranks == {k: r for k, (_, r) in TWO.items()}
    # made rank 0 the slow one in the health check: the time moves there, and so does the name
    slow = {**R0, "checked": 10.088}
    q = recovery_phases(rank_log(0, slow) + rank_log(1, R1), 0, START)
    assert (ms(q)["health"], q.ranks["health"]) == (63.0, 0)
    assert (ms(q)["agree"], q.ranks["agree"]) == (2.0, 0)  # 10.088 -> 10.090
    assert q.total == pytest.approx(0.310)


def test_three_ranks_each_late_in_another_phase():
    base = dict(noticed=10.004, detected=10.005, left=10.010, checked=10.020, agreed=10.030, prepared=10.035,
                freed=10.040, rebuilt=10.050, entered=10.060, restored=10.065, resumed=10.100)  # fmt: skip
    logs = [
        rank_log(0, {**base, "noticed": 10.001, "resumed": 10.140}),  # its first step slow
        rank_log(1, {**base, "noticed": 10.002, "entered": 10.062, "restored": 10.067}),  # late loads
        rank_log(2, {**base, "freed": 10.037, "rebuilt": 10.058}),  # a slow group build
    ]
    p = incident_phases([e for log in logs for e in log], START)
    assert p is not None and p.complete()
    assert ms(p) == {"detect": 4.0, "leave": 6.0, "health": 10.0, "agree": 10.0, "free": 5.0, "rebuild": 18.0,
                     "restore": 10.0, "reenter": 4.0, "rerun": 73.0}  # fmt: skip
    # rank 2 noticed last (10.004) and built its group last; rank 1 loaded last; rank 0 stepped last
    last = {k: p.ranks[k] for k in ("detect", "rebuild", "reenter", "restore", "rerun")}
    assert last == {"detect": 2, "rebuild": 2, "reenter": 1, "restore": 1, "rerun": 0}
    assert p.total == pytest.approx(0.140)
    assert sum(v or 0.0 for v in p.seconds.values()) == pytest.approx(p.total)


def test_a_missing_record_makes_its_phases_unknown_not_wrong():
    evs = [e for e in two_ranks() if not (e["event"] == "health_checked" and e["rank"] == 1)]
    p = incident_phases(evs, START)
    assert p is not None and not p.complete()
    got = ms(p)
    assert got["health"] is None and got["agree"] is None  # the mark between them is unknown
    assert p.ranks["health"] is None and p.ranks["agree"] is None
    assert {k: v for k, v in got.items() if v is not None} == {
        k: v for k, (v, _) in TWO.items() if k not in ("health", "agree")
    }
    assert p.total == pytest.approx(0.310)
    assert fmt(p) == (
        "detect 10.0, leave 15.0, health —, agree —, free 29.0, rebuild 22.0, restore 21.0, "
        "reenter 48.0, rerun 100.0 ms (= 310.0 ms)"
    )
    # a rank that never stepped again: no rerun and no total
    evs = [e for e in two_ranks() if not (e["event"].startswith("step_") and e["rank"] == 0)]
    p = incident_phases(evs, START)
    assert p is not None and p.seconds["rerun"] is None and p.total is None
    assert ms(p)["reenter"] == 48.0
    assert fmt(p).endswith("rerun — ms")


def test_a_hard_fault_has_no_phases():
    hard = [e for e in two_ranks() if e["event"] in ("fault_detected", "group_aborted")]
    assert incident_phases(hard, START) is None  # no restore_agreed: not recovered in-process
    assert incident_phases([e for e in two_ranks() if e["event"] != "fault_detected"], START) is None
    assert incident_phases([], START) is None


def test_a_log_without_noticed_ts_times_the_detection_from_the_record():
    for old in ({"noticed_ts": None}, {}):
        evs = []
        for e in two_ranks():
            if e["event"] == "fault_detected":
                e = {k: v for k, v in e.items() if k != "noticed_ts"} | old
            evs.append(e)
        p = incident_phases(evs, START)
        assert p is not None and p.complete()
        got = ms(p)
        assert (got["detect"], got["leave"]) == (11.0, 14.0)  # rank 0's record at 10.011
        assert (got["health"], got["agree"], got["rerun"]) == (55.0, 10.0, 100.0)
        assert p.total == pytest.approx(0.310)


def test_records_of_other_generations_and_ranks_are_left_out():
    evs = two_ranks()
    evs += [  # the agent's, a step of the failed generation, a rank that never detected the fault
        {"ts": T0 + 10.05, "event": "health_checked", "rank": -1, "generation": 0},
        {"ts": T0 + 10.06, "event": "step_completed", "rank": 0, "generation": 0, "step": 21},
        {"ts": T0 + 10.5, "event": "step_completed", "rank": 5, "generation": 1, "step": 10},
    ]
    p = incident_phases(evs, START)
    assert p is not None and ms(p) == {k: v for k, (v, _) in TWO.items()}


def test_an_incident_of_the_accounting_carries_what_the_phases_need():
    before = [
        {"ts": T0 + 9.9, "event": "step_completed", "rank": r, "pid": 100 + r, "generation": 0, "step": 19}
        for r in (0, 1)
    ]
    (inc,) = account(before + two_ranks()).incidents
    start = fault_start(inc.records)
    assert start == START and inc.start == START
    p = incident_phases(inc.records, start)
    assert p is not None and ms(p) == {k: v for k, (v, _) in TWO.items()}
    assert inc.end == T0 + 10.310 and p.total == pytest.approx(inc.end - START)


def test_the_fault_starts_at_its_origin_less_a_hangs_idle_time():
    evs = [{"ts": T0 + 5.0, "event": "fault_detected", "rank": 0, "generation": 0, "origin_ts": T0 + 4.0,
            "origin_latency_s": 2.0}]  # fmt: skip
    assert fault_start(evs) == T0 + 2.0
    assert fault_start([{"ts": T0 + 5.0, "event": "fault_detected", "rank": 0}]) == T0 + 5.0
    assert fault_start([{"ts": T0, "event": "worker_died", "rank": -1}]) is None
