"""Restart policy: immediate first restart, bounded backoff, repeat diagnosis and the sliding budget.

Every fault carries an explicit ``ts`` (the origin's clock), and the policy's own clock is a trap:
the verdict must never depend on this process's wall clock.
"""

from __future__ import annotations

import random

import pytest

from resilient.config import RestartConfig
from resilient.errors import FaultRepeats, RestartBudgetExhausted
from resilient.runtime.faults.records import FaultRecord
from resilient.runtime.recovery.policy import RestartPolicy

T0 = 1_000_000.0


def no_wall_clock() -> float:
    raise AssertionError("the policy read its own clock although the fault carries a timestamp")


def fault(step: int, ts: float, sig: str = "exception: ValueError: boom") -> FaultRecord:
    return FaultRecord(
        rank=0,
        generation=0,
        step=step,
        kind="exception",
        severity="soft",
        signature=sig,
        message="boom",
        ts=ts,
    )


def policy(seed: int = 0, **cfg: float) -> RestartPolicy:
    return RestartPolicy(RestartConfig(**cfg), clock=no_wall_clock, rng=random.Random(seed))


def delays(p: RestartPolicy, n: int) -> list[float]:
    # distinct steps so repeat detection never triggers; all inside the window
    return [p.admit(fault(step=i, ts=T0 + i)) for i in range(n)]


def test_first_restart_is_immediate():
    assert policy().admit(fault(step=3, ts=T0)) == 0.0


def test_quick_restarts_back_off_exponentially_up_to_the_cap():
    cfg = {"backoff_initial_s": 0.1, "backoff_max_s": 1.0, "max_recoveries": 50}
    d = delays(policy(**cfg), 9)
    assert d[0] == 0.0
    assert 0.1 <= d[1] <= 0.2 < d[2] <= 0.3
    assert d[1] < d[2] < d[3] < d[4]
    assert all(x <= 1.0 for x in d)
    assert d[-1] == 1.0  # 0.1 * 2**7 ≫ cap
    assert d == sorted(d)


def test_backoff_is_reproducible_with_a_seeded_rng():
    cfg = {"backoff_initial_s": 0.5, "backoff_max_s": 30.0, "max_recoveries": 20}
    assert delays(policy(seed=42, **cfg), 6) == delays(policy(seed=42, **cfg), 6)
    assert delays(policy(seed=42, **cfg), 6) != delays(policy(seed=43, **cfg), 6)


def test_policy_does_not_touch_the_global_random_state():
    # the global `random` state belongs to the user's tracked, restored RNG state
    random.seed(1234)
    before = random.getstate()
    p = RestartPolicy(RestartConfig(max_recoveries=20), clock=no_wall_clock)  # default rng
    delays(p, 6)
    seeded = policy(seed=1, max_recoveries=20)
    delays(seeded, 6)
    assert random.getstate() == before


def test_fault_repeating_at_the_same_step_stops_the_run():
    p = policy(max_repeats=3)
    sig = "collective: RuntimeError: Connection closed by peer [N]:N"
    p.admit(fault(step=5, ts=T0, sig=sig))
    p.admit(fault(step=5, ts=T0 + 1, sig=sig))
    with pytest.raises(FaultRepeats) as ei:
        p.admit(fault(step=5, ts=T0 + 2, sig=sig))
    e = ei.value
    assert str(e).startswith(f"fault repeats at step 5: {sig}")
    assert (e.step, e.signature, e.count) == (5, sig, 3)
    assert len(e.history) == 3 and all(h["step"] == 5 for h in e.history)
    assert isinstance(e, RestartBudgetExhausted)  # one clause catches both verdicts


def test_a_different_step_in_between_resets_the_repeat_count():
    p = policy(max_repeats=3)
    p.admit(fault(step=5, ts=T0))
    p.admit(fault(step=5, ts=T0 + 1))
    p.admit(fault(step=6, ts=T0 + 2))  # progress was made in between
    p.admit(fault(step=5, ts=T0 + 3))
    p.admit(fault(step=5, ts=T0 + 4))
    with pytest.raises(FaultRepeats):
        p.admit(fault(step=5, ts=T0 + 5))


def test_a_different_signature_at_the_same_step_is_not_a_repeat():
    p = policy(max_repeats=2)
    p.admit(fault(step=5, ts=T0, sig="a"))
    p.admit(fault(step=5, ts=T0 + 1, sig="b"))
    p.admit(fault(step=5, ts=T0 + 2, sig="a"))
    with pytest.raises(FaultRepeats):
        p.admit(fault(step=5, ts=T0 + 3, sig="a"))


def test_budget_exhausted_after_max_recoveries_within_the_window():
    p = policy(max_recoveries=3, window_s=100.0)
    for i in range(3):
        p.admit(fault(step=i, ts=T0 + 10 * i))
    with pytest.raises(RestartBudgetExhausted) as ei:
        p.admit(fault(step=3, ts=T0 + 30))
    assert not isinstance(ei.value, FaultRepeats)
    assert "recovery budget exhausted" in str(ei.value)
    assert "restart.max_recoveries=3" in str(ei.value)
    assert len(ei.value.history) == 4


def test_restarts_older_than_the_window_are_forgotten():
    p = policy(max_recoveries=3, window_s=100.0, backoff_initial_s=0.1, backoff_max_s=10.0)
    for i in range(3):
        p.admit(fault(step=i, ts=T0 + 10 * i))  # T0, T0+10, T0+20
    # at T0+105 the restart at T0 left the window; the two others are still inside
    d = p.admit(fault(step=3, ts=T0 + 105))
    assert d > 0.0  # still a quick restart: two restarts inside the window
    with pytest.raises(RestartBudgetExhausted):
        p.admit(fault(step=4, ts=T0 + 106))
    # long after every recorded restart: the budget is whole again and the restart is immediate
    assert policy(max_recoveries=1, window_s=100.0).admit(fault(step=0, ts=T0)) == 0.0
    q = policy(max_recoveries=1, window_s=100.0)
    q.admit(fault(step=0, ts=T0))
    assert q.admit(fault(step=1, ts=T0 + 500)) == 0.0


def test_zero_restarts_allowed_stops_at_the_first_fault():
    with pytest.raises(RestartBudgetExhausted):
        policy(max_recoveries=0).admit(fault(step=1, ts=T0))


# ---- the two rules the runtime and the launcher share (resilient/restarts.py) ----------------------
def test_restart_window_admits_up_to_its_limit_and_forgets_what_left_it():
    from resilient.restarts import RestartWindow

    w = RestartWindow(2, span_s=100.0)
    assert w.admit(T0) and w.admit(T0 + 50)
    assert not w.admit(T0 + 60) and w.count(T0 + 60) == 2  # a refusal records nothing
    assert w.left(T0 + 101) == 1 and w.admit(T0 + 101)  # T0 left the window
    forever = RestartWindow(1, span_s=None)  # no window: every restart of the run counts
    assert forever.admit(T0) and not forever.admit(T0 + 1e9)
    assert RestartWindow(-1).left(T0) == 0 and not RestartWindow(-1).admit(T0)


def test_repeats_counts_the_run_at_the_end_of_a_history():
    from resilient.restarts import repeats

    assert repeats([]) == 0
    assert repeats(["a", "b", "b", "b"]) == 3
    assert repeats(["b", "b", "a"]) == 1
    assert repeats([(5, "x", 1), (5, "x", 2)], key=lambda e: e[:2]) == 2
