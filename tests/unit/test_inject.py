"""Chaos plans: parsing, and firing only where and as often as planned."""

from __future__ import annotations

import pytest

from chaos import inject
from chaos.inject import Fault, InjectedFault, Injector

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


def test_desync_on_a_ddp_model_turns_off_one_steps_gradient_sync():
    class FakeDDP:  # the injector only touches DDP's documented no_sync switch
        require_backward_grad_sync = True

    import torch.nn.parallel as par

    m = FakeDDP()
    inj = Injector.parse("desync@2:1")
    orig = par.DistributedDataParallel
    try:
        par.DistributedDataParallel = FakeDDP  # type: ignore[misc,assignment]
        inj.maybe_fire(1, 2, objects=[m])
        assert m.require_backward_grad_sync is False
        inj.maybe_fire(1, 2, "before_collective", objects=[m])  # same step: still off
        assert m.require_backward_grad_sync is False
        inj.maybe_fire(1, 3, objects=[m])  # the next step syncs again
        assert m.require_backward_grad_sync is True
    finally:
        par.DistributedDataParallel = orig  # type: ignore[misc]
