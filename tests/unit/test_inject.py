"""Chaos plans: parsing, and firing only where and as often as planned."""

from __future__ import annotations

import pytest

from chaos import inject
from chaos.inject import Fault, InjectedFault, Injector, outcomes

PLAN = "exception@5:1,hang@7:0,stall@4:1=2.5,exception@6:1x3"


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the injectors' sleeps instead of sleeping (the faults are not under test here)."""
    calls: list[float] = []
    monkeypatch.setattr(inject.time, "sleep", calls.append)
    return calls


def test_parse_plan():
    inj = Injector.parse(PLAN)
    assert inj.faults == [
        Fault("exception", 5, 1),
        Fault("hang", 7, 0),
        Fault("stall", 4, 1, arg=2.5),
        Fault("exception", 6, 1, times=3),
    ]
    assert inj.faults[2].where == "before_collective"
    assert inj.faults[0].where == "step"


def test_empty_plans():
    assert Injector.parse(None).faults == []
    assert Injector.parse("").faults == []
    assert Injector.parse(" , ").faults == []
    assert Injector.parse("exception@3").faults == [Fault("exception", 3, 0)]


@pytest.mark.parametrize("spec", ["explode@5:1", "exception@five", "exception5:1", "stall@4:1=x", "hang@-1"])
def test_bad_spec_is_named(spec: str):
    with pytest.raises(ValueError, match="bad fault spec") as ei:
        Injector.parse(f"exception@1,{spec}")
    assert repr(spec) in str(ei.value)


def test_exception_fires_only_on_its_rank_step_and_place(sleeps):
    inj = Injector.parse(PLAN)
    inj.maybe_fire(rank=0, step=5)  # other rank
    inj.maybe_fire(rank=1, step=4)  # stall is not a "step" fault
    inj.maybe_fire(rank=1, step=5, where="before_collective")
    with pytest.raises(InjectedFault, match="step 5 on rank 1"):
        inj.maybe_fire(rank=1, step=5)
    inj.maybe_fire(rank=1, step=5)  # fired once already: the re-run of step 5 passes
    assert sleeps == []
    assert inj.counts() == {"exception@5:1": 1, "hang@7:0": 0, "stall@4:1": 0, "exception@6:1": 0}


def test_repeated_fault_fires_exactly_times(sleeps):
    inj = Injector.parse(PLAN)
    for _ in range(3):
        with pytest.raises(InjectedFault):
            inj.maybe_fire(rank=1, step=6)
    inj.maybe_fire(rank=1, step=6)
    inj.maybe_fire(rank=1, step=6)
    assert inj.counts()["exception@6:1"] == 3


def test_stall_and_hang_sleep_where_planned(sleeps):
    inj = Injector.parse(PLAN)
    inj.maybe_fire(rank=1, step=4, where="before_collective")
    inj.maybe_fire(rank=1, step=4, where="before_collective")
    assert sleeps == [2.5]
    inj.maybe_fire(rank=1, step=7)
    inj.maybe_fire(rank=0, step=7)
    assert sleeps == [2.5, 3600]
    assert inj.counts() == {"exception@5:1": 0, "hang@7:0": 1, "stall@4:1": 1, "exception@6:1": 0}


def test_injected_fault_is_an_ordinary_exception():
    # user code and the runtime see it like any other bug in the step
    assert issubclass(InjectedFault, Exception)


def test_desync_skips_exactly_one_collective_call_then_restores(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(t))
    original = dist.all_reduce
    inj = Injector.parse("desync@3:0")
    inj.maybe_fire(0, 3)
    assert dist.all_reduce("skipped") is None and calls == []  # not issued at all
    assert dist.all_reduce is original
    dist.all_reduce("issued")
    assert calls == ["issued"]
    assert '"kind": "desync"' in (tmp_path / "inj.jsonl").read_text()


def _idle(path) -> list[dict]:
    import json

    return [r for r in map(json.loads, path.read_text().splitlines()) if inject.IDLE in r]


def test_a_desync_in_a_step_with_no_collective_is_recorded_as_not_acted(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    original = dist.all_reduce
    inj = Injector.parse("desync@3:0")
    inj.maybe_fire(0, 3)
    assert dist.all_reduce is not original
    inj.step_over()  # the step ended without a collective: nothing was skipped, nothing stays patched
    assert dist.all_reduce is original
    (idle,) = _idle(tmp_path / "inj.jsonl")
    assert (idle["kind"], idle["step"], idle["rank"], idle["fired"]) == ("desync", 3, 0, True)
    assert "no torch.distributed collective in step 3" in idle[inject.IDLE]
    assert inject._fired_in_job(Fault("desync", 3, 0)) == 1  # (fired: a relaunch does not fire it again)


def test_a_re_run_of_the_faulted_step_ends_its_change_first(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    original = dist.all_reduce
    inj = Injector.parse("desync@3:0")
    inj.maybe_fire(0, 3)
    inj.maybe_fire(0, 3, "before_collective")  # the same step, later: still patched
    assert dist.all_reduce is not original
    inj.maybe_fire(0, 3)  # the step starts again (it raised): the change of its first run ends
    assert dist.all_reduce is original and len(_idle(tmp_path / "inj.jsonl")) == 1


def test_a_gradient_fault_without_a_backward_and_a_point_that_never_came_say_why(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    m = torch.nn.Linear(3, 1)
    inj = Injector.parse("nan@2:0,exception@2:0/forward3")
    inj.maybe_fire(0, 2, objects=[m])
    with torch.no_grad():
        m(torch.ones(1, 3))  # one forward, no backward: no gradient to poison, no 4th forward
    inj.step_over()
    idle = {r["kind"]: r for r in _idle(tmp_path / "inj.jsonl")}
    assert "no gradient flowed back" in idle["nan"][inject.IDLE] and idle["nan"]["fired"]
    assert "forward of microbatch 3" in idle["exception"][inject.IDLE] and not idle["exception"]["fired"]
    assert "ran 1 forwards" in idle["exception"][inject.IDLE]
    assert inject._fired_in_job(Fault("exception", 2, 0)) == 0  # never fired: a re-run arms it again
    assert not m._forward_hooks and not m._forward_pre_hooks


def test_a_fault_that_acted_leaves_no_idle_record(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    m = torch.nn.Linear(3, 1)
    inj = Injector.parse("nan@2:0")
    inj.maybe_fire(0, 2, objects=[m])
    m(torch.ones(1, 3)).sum().backward()
    inj.step_over()
    assert torch.isnan(m.weight.grad).all() and _idle(tmp_path / "inj.jsonl") == []


def test_outcomes_pair_each_did_not_act_record_with_its_firing():
    fired = {"by": "injector", "kind": "desync", "step": 3, "rank": 1}
    idle = {**fired, inject.IDLE: "nothing to skip", "fired": True}
    harness = {"by": "harness", "kind": "sigkill", "step": 9, "rank": 0, "ts": 1.0}
    # pid 10 fired it and found nothing; pid 11 (the re-run after a restart) fired it and it acted
    records = [{**fired, "pid": 10}, {**idle, "pid": 10}, {**fired, "pid": 11}, harness]
    acted, not_acted = outcomes(records)
    assert acted == [{**fired, "pid": 11}, harness]
    assert [str(n) for n in not_acted] == ["desync@3:1 did not act: nothing to skip"]
    acted, not_acted = outcomes(records[:2])
    assert acted == [] and len(not_acted) == 1
    point = {**fired, inject.IDLE: "its point never came", "fired": False}  # (no firing to take back)
    assert outcomes([point, {**fired, "pid": 12}])[0] == [{**fired, "pid": 12}]


def test_the_chaos_hook_ends_a_step_s_change_when_the_step_completes(monkeypatch, tmp_path):
    import torch.distributed as dist

    from chaos.hooks import ChaosHook

    monkeypatch.setenv("CHAOS_INJECTIONS", str(tmp_path / "inj.jsonl"))
    original = dist.all_reduce
    hook = ChaosHook(Injector.parse("desync@3:0"), step_events=False, final_state=None)
    hook.before_step(3, [])
    assert dist.all_reduce is not original
    hook.after_step(0, 3, 0.1)
    assert dist.all_reduce is original and len(_idle(tmp_path / "inj.jsonl")) == 1


def test_a_fault_at_a_recovery_s_point_parses_and_bad_points_are_named():
    inj = Injector.parse("exception@15:1,sigkill@agree:0,hang@rebuild")
    assert inj.faults[1:] == [Fault("sigkill", -1, 0, during="agree"), Fault("hang", -1, 0, during="rebuild")]
    for bad, why in [
        ("exception@nowhere:1", "point 'nowhere' not in"),
        ("stall@agree:1", "at a point, kind in"),
        ("exception@agree:1=3", "takes no =arg"),
    ]:
        with pytest.raises(ValueError, match=why):
            Injector.parse(bad)


def test_a_fault_at_a_point_fires_once_per_job_on_its_rank_only(monkeypatch, tmp_path):
    record = tmp_path / "injections.jsonl"
    monkeypatch.setenv("CHAOS_INJECTIONS", str(record))
    inj = Injector.parse("exception@restore:1")
    inj.at_point(0, "restore")  # another rank
    inj.at_point(1, "agree")  # another point
    with pytest.raises(InjectedFault):
        inj.at_point(1, "restore")
    inj.at_point(1, "restore")  # once
    again = Injector.parse("exception@restore:1")  # a later process of the same job (a replacement)
    again.at_point(1, "restore")
    acted, idle = outcomes(inject.read_events(record))
    assert [(r["kind"], r["step"], r["rank"], r["during"]) for r in acted] == [
        ("exception", None, 1, "restore")
    ]
    assert idle == []


def test_a_sigkill_at_a_point_is_the_rank_s_own_real_sigkill(tmp_path):
    import signal
    import subprocess
    import sys

    code = (
        "from chaos.inject import Injector; "
        "Injector.parse('sigkill@agree:0').at_point(0, 'agree'); print('alive')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr)
    assert "alive" not in done.stdout


def test_the_hooks_are_told_of_each_point_and_what_one_raises_is_raised_there():
    from resilient.runtime.hooks import Hook, at_point

    told: list[tuple[str, int, int | None]] = []

    class Watching(Hook):
        def on_phase(self, phase: str, generation: int, step: int | None) -> None:
            told.append((phase, generation, step))

    class Failing(Hook):
        def on_phase(self, phase: str, generation: int, step: int | None) -> None:
            if phase == "agree":
                raise InjectedFault("in agree")

    class Old:  # a hook written before on_phase existed: not called, no error
        pass

    at_point([Watching(), Old(), Failing()], "leave", 0, 12)
    with pytest.raises(InjectedFault, match="in agree"):
        at_point([Watching(), Failing()], "agree", 0, 12)
    assert told == [("leave", 0, 12), ("agree", 0, 12)]
