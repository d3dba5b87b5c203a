"""Faults inside a step (chaos/points.py): armed at the step's start on the stage's module, fired
at a microbatch's forward or backward; and a skipped point-to-point send (chaos/faults/p2p_skip.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from chaos.inject import Fault, InjectedFault, Injector
from chaos.schedule import Planned
from resilient.detectors import p2p


def test_a_point_is_parsed_and_written_back() -> None:
    assert Injector.parse("exception@3:1/backward2").faults == [
        Fault("exception", 3, 1, at="backward", microbatch=2)
    ]
    assert Planned(fault="oom", rank=3, step=12, at="forward", microbatch=1).spec(12) == "oom@12:3/forward1"
    with pytest.raises(ValueError, match="only in-process faults"):
        Planned(fault="sigkill", step=12, at="backward")


def _microbatches(m: torch.nn.Module, n: int) -> str | None:
    """Forward ``n`` microbatches, then their backwards (GPipe): where a fault was raised."""
    outs = []
    for i in range(n):
        try:
            outs.append(m(torch.ones(2, 3)))
        except InjectedFault:
            return f"forward {i}"
    for i, out in enumerate(outs):
        try:
            out.sum().backward()
        except InjectedFault:
            return f"backward {i}"
    return None


@pytest.mark.parametrize("at", ["forward", "backward"])
def test_it_fires_at_its_microbatch_once(at: str) -> None:
    m = torch.nn.Linear(3, 1)
    inj = Injector.parse(f"exception@4:0/{at}2")
    inj.maybe_fire(0, 4, objects=[object(), m])  # armed: nothing fires at the step's start
    assert _microbatches(m, 4) == f"{at} 2"
    assert inj.counts() == {"exception@4:0": 1}
    assert _microbatches(m, 4) is None  # fired: the step's re-run passes
    inj.maybe_fire(0, 5, objects=[m])  # the next step disarms it
    assert not m._forward_hooks and not m._forward_pre_hooks


def test_a_point_beyond_the_schedule_never_fires() -> None:
    m = torch.nn.Linear(3, 1)
    inj = Injector.parse("exception@4:0/forward9")
    inj.maybe_fire(0, 4, objects=[m])
    assert _microbatches(m, 4) is None
    assert inj.counts() == {"exception@4:0": 0}


@pytest.fixture
def fake_group() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    p2p.install()
    try:
        yield
    finally:
        p2p.uninstall()
        dist.destroy_process_group()


def test_p2p_skip_sends_nothing_once(fake_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tally = p2p.Tally()
    monkeypatch.setattr(p2p, "TALLY", tally)
    counting = dist.ProcessGroup.send
    Injector.parse("p2p_skip@3:0").maybe_fire(0, 3)
    t = torch.ones(2)
    work = dist.isend(t, 1)  # skipped: done, nothing sent, nothing counted
    assert work is not None and work.wait() and tally.ops == {}
    assert dist.ProcessGroup.send is counting
    dist.isend(t, 1).wait()
    assert tally.ops == {">1": 1}
