"""What a recovery decides, with fakes: the admit verdict, the failed agreement, the plan's step,
and a recovery whose backoff is the injected sleep's, never the wall clock's. Milliseconds each."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from resilient.config import RestartConfig
from resilient.errors import (
    FaultRepeats,
    HardFault,
    RestartBudgetExhausted,
    SetupFailed,
    StateRestoreError,
    StepInterrupted,
)
from resilient.launch_env import LaunchEnv
from resilient.runtime.coordination.agreement import RestorePlan
from resilient.runtime.engine.builtin import BuiltinRun, collaborators
from resilient.runtime.faults.records import FaultRecord, Severity, Symptom
from resilient.runtime.recovery.decision import Verdict, admit, failed_agreement
from resilient.runtime.recovery.policy import RestartPolicy
from resilient.runtime.run.wiring import Setup
from tests.unit.test_core import Fakes, _cfg, _train


def _fault(kind: str = Symptom.EXCEPTION.value, *, rank: int = 1, step: int = 7, **kw: Any) -> FaultRecord:
    return FaultRecord(
        rank=rank,
        generation=0,
        step=step,
        kind=kind,
        severity=kw.pop("severity", Severity.SOFT.value),
        signature=kw.pop("signature", f"{kind}: boom"),
        message="boom",
        ts=kw.pop("ts", 1000.0),
        **kw,
    )


def _policy(**cfg: Any) -> RestartPolicy:
    return RestartPolicy(RestartConfig(**cfg), clock=lambda: 1000.0, rng=random.Random(0))


def _no_verdict(primary: FaultRecord, history: list[dict[str, Any]]) -> None:
    return None


def test_a_soft_fault_restarts_after_the_policys_backoff() -> None:
    policy = _policy(backoff_initial_s=2.0, backoff_max_s=60.0)
    first = admit(_fault(step=3), None, policy, _no_verdict)
    second = admit(_fault(step=9), None, policy, _no_verdict)
    assert (first.verdict, first.delay_s) == (Verdict.RESTART, 0.0)  # (the first restart is immediate)
    assert second.verdict is Verdict.RESTART and 2.0 <= second.delay_s <= 4.0
    assert not second.attribute


def test_this_ranks_hard_fault_is_hard_before_anything_else() -> None:
    own = _fault(Symptom.CUDA.value, severity=Severity.HARD.value, rank=0)
    got = admit(_fault(Symptom.PREEMPT.value), own, _policy(), _no_verdict)
    assert got.verdict is Verdict.HARD


def test_a_preemption_is_never_counted_against_the_budget() -> None:
    policy = _policy(max_recoveries=1)
    assert admit(_fault(Symptom.PREEMPT.value), None, policy, _no_verdict).verdict is Verdict.PREEMPT
    assert policy.history == []


def test_a_repeating_fault_gives_up_with_the_policys_reason() -> None:
    policy = _policy(max_repeats=2)
    assert admit(_fault(), None, policy, _no_verdict).verdict is Verdict.RESTART
    got = admit(_fault(), None, policy, _no_verdict)
    assert got.verdict is Verdict.GIVE_UP and isinstance(got.refusal, FaultRepeats)
    assert "step 7" in str(got.refusal)


def test_a_detectors_verdict_is_taken_with_the_history_including_this_fault() -> None:
    seen: list[int] = []

    def refuse(primary: FaultRecord, history: list[dict[str, Any]]) -> None:
        seen.append(len(history))
        raise RestartBudgetExhausted("the spike came back on replay", history)

    got = admit(_fault("spike"), None, _policy(), refuse)
    assert got.verdict is Verdict.GIVE_UP and "came back" in str(got.refusal) and seen == [1]


def test_silent_corruption_is_attributed_before_the_agreement() -> None:
    assert admit(_fault("sdc"), None, _policy(), _no_verdict).attribute


def test_a_failed_agreement_names_the_culprit_and_raises_its_own_exception_as_itself() -> None:
    err = SetupFailed("rank 1 failed before the first step: boom", [1])
    own = KeyError("the user's")
    assert failed_agreement(err, own, 1, under_launcher=False) is own
    assert failed_agreement(err, own, 0, under_launcher=False) is err  # (a peer: the error naming it)
    assert failed_agreement(err, StepInterrupted("peer"), 1, under_launcher=False) is err
    gap = StateRestoreError("no snapshot step held by every rank")
    assert failed_agreement(gap, None, 0, under_launcher=False) is gap
    hard = failed_agreement(gap, None, 0, under_launcher=True)
    assert isinstance(hard, HardFault) and hard.__cause__ is gap and "launcher restarts" in str(hard)


def test_the_plan_resumes_live_else_at_the_newest_common_snapshot_else_fails_alike() -> None:
    assert RestorePlan(step=4, live=6).restore_step() == 6
    assert RestorePlan(step=4, live_refused={"1": "at step 7"}).restore_step() == 4
    with pytest.raises(SetupFailed, match="rank 1 failed before the first step: boom"):
        RestorePlan(empty=[1]).restore_step(_fault())
    with pytest.raises(StateRestoreError, match=r"\[\[3\], \[4\]\]"):
        RestorePlan(held=[[3], [4]]).restore_step()
    assert RestorePlan.parse(RestorePlan(step=4, live_donors={"1": 0}).to_json()).live_donors == {"1": 0}


def test_a_recoverys_backoff_is_the_injected_sleep_not_the_wall_clock(tmp_path: Path) -> None:
    fakes = Fakes(tmp_path)
    restart = {"backoff_initial_s": 30.0, "backoff_max_s": 30.0, "max_recoveries": 5}
    setup = Setup.of(_cfg(restart=restart), launch=LaunchEnv.from_environ({}))
    run = BuiltinRun(collaborators(setup, fakes.wiring(setup)))
    slept: list[float] = []
    run.recovery.sleep = slept.append
    t0 = time.monotonic()
    run.run(_train(run, lambda g, s: g < 2 and s == 4 + g))  # (two faults: the second backs off)
    assert time.monotonic() - t0 < 20.0  # (far below the 30 s the backoff asked for)
    assert len(slept) == 1 and slept[0] == 30.0
    agreed = fakes.events("restore_agreed")
    assert [e["step"] for e in agreed] == [4, 5] and agreed[1]["backoff_s"] >= 0.0
