"""Live resume (runtime/steps/live.py): a soft fault resumes at the step it hit when the large state
is vouched for, falls back to the ring when it is not, and ends bit-exact either way.

The engine runs in one process with test_core's fakes; the faults are real exceptions raised at a
chosen point of a step: before the forward, after the backward, after the optimizer's step, in
the middle of an accumulation window, after an in-place change outside the optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.runtime.context import Context
from resilient.runtime.coordination.agreement import RestorePlan, restore_plan
from resilient.runtime.steps.live import LiveResume
from resilient.runtime.steps.loop import StepLoop
from resilient.state.registry import Registry
from tests.unit.test_core import Fakes, _cfg, _runtime

EPOCHS, BATCHES = 2, 6  # 12 steps


class Big:
    """A tracked object whose state is too large to copy at every step."""

    def __init__(self) -> None:
        self.t = torch.zeros(4096)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = state["t"].clone()


def _train(fault: tuple[int, str] | None, accumulate: int = 1, clamp: bool = False, big: bool = False) -> Any:
    """BatchNorm and dropout, AdamW, a scheduler, a shuffled DataLoader over two epochs; the fault
    ``(step, where)`` raised once at that point of that step."""
    pending = [fault]

    def hit(step: int, where: str) -> None:
        if pending[0] == (step, where):
            pending[0] = None
            raise ValueError(f"injected {where} step {step}")

    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.7)
        data = torch.utils.data.TensorDataset(torch.randn(BATCHES * 4, 4), torch.randn(BATCHES * 4, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        extra = {"big": Big()} if big else {}
        ctx.track(model=model, optimizer=opt, scheduler=sched, loader=loader, **extra)
        for _ in ctx.epochs(EPOCHS):
            for x, y in ctx.steps(loader):
                step = ctx.step
                hit(step, "start")
                if clamp:
                    with torch.no_grad():
                        model[0].weight.clamp_(-0.4, 0.4)
                hit(step, "clamped")
                loss = torch.nn.functional.mse_loss(model(x), y) / accumulate
                hit(step, "forward")
                loss.backward()
                hit(step, "backward")
                if (step + 1) % accumulate == 0:
                    opt.step()
                    hit(step, "optimizer")
                    opt.zero_grad()
                    sched.step()
        return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
                "rng": torch.get_rng_state()}  # fmt: skip

    return fn


def _run(tmp: Path, fault: tuple[int, str] | None, **kw: Any) -> tuple[dict[str, Any], Fakes]:
    fakes = Fakes(tmp)
    rt = _runtime(fakes, _cfg(snapshot={"interval": 4, "live_max_bytes": 8192}))
    return rt.run(_train(fault, **{k: v for k, v in kw.items() if k != "live"})), fakes


def _equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal(x, y)
    else:
        assert a == b


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, bool], dict[str, Any]]:
    out = {}
    for accumulate, clamp in ((1, False), (2, False), (1, True)):
        got, fakes = _run(tmp_path_factory.mktemp("ref"), None, accumulate=accumulate, clamp=clamp)
        assert not fakes.events("fault_detected")
        out[(accumulate, clamp)] = got
    return out


@pytest.mark.parametrize(
    ("step", "where", "accumulate", "clamp", "live"),
    [
        (5, "start", 1, False, True),  # mid-epoch, BatchNorm's buffers learned as changing by now
        (6, "forward", 1, False, True),  # an epoch's first step: BatchNorm updated, the loader drew
        (9, "backward", 1, False, True),  # the gradients of the failed step are dropped
        (1, "forward", 1, False, True),  # before any buffer was learned: every buffer copied
        (7, "optimizer", 1, False, False),  # the optimizer stepped: the ring
        (7, "forward", 2, False, True),  # the window's second step: its gradients carried
        (7, "backward", 2, False, False),  # ... once its backward added to them: the ring
        (5, "clamped", 1, True, False),  # an in-place change outside the optimizer: the ring
        (5, "start", 1, True, True),  # ... not made yet: live
    ],
)
def test_a_fault_resumes_live_where_every_rank_vouches_else_from_the_ring_bit_exact(
    tmp_path: Path, refs: dict[tuple[int, bool], dict[str, Any]], step: int, where: str, accumulate: int,
    clamp: bool, live: bool,
) -> None:  # fmt: skip
    got, fakes = _run(tmp_path, (step, where), accumulate=accumulate, clamp=clamp)
    _equal(refs[(accumulate, clamp)], got)
    (agreed,) = fakes.events("restore_agreed")
    (restored,) = fakes.events("state_restored")
    assert restored["source"] == agreed["source"] == ("live" if live else "ring")
    assert restored["work_lost_s"] >= 0  # (the restored step's start to the fault)
    if live:
        assert restored["step"] == step and restored["steps_rerun"] == 0 and "live_refused" not in agreed
    else:
        assert restored["step"] < step and restored["steps_rerun"] == step - restored["step"]
        (why,) = agreed["live_refused"].values()
        assert ("optimizer step ran" if where == "optimizer" else "changed in place") in why, why


def test_an_object_too_large_to_copy_each_step_falls_back_and_is_named(tmp_path: Path) -> None:
    ref, _ = _run(tmp_path / "ref", None, big=True)
    got, fakes = _run(tmp_path / "hit", (5, "start"), big=True)
    _equal(ref, got)
    (agreed,) = fakes.events("restore_agreed")
    assert agreed["source"] == "ring"
    assert "'big' holds 16384 tensor bytes" in agreed["live_refused"]["0"]


def test_live_off_keeps_the_ring(tmp_path: Path) -> None:
    fakes = Fakes(tmp_path)
    rt = _runtime(fakes, _cfg(snapshot={"interval": 4, "live": False}))
    rt.run(_train((5, "start")))
    (agreed,) = fakes.events("restore_agreed")
    assert agreed["source"] == "ring" and agreed["step"] == 4
    assert agreed["live_refused"] == {"0": "snapshot.live is off"}


def test_a_fault_that_casts_doubt_on_the_state_never_resumes_live() -> None:
    live = LiveResume(True, 1024)
    registry = Registry()
    model = torch.nn.Linear(2, 2)
    registry.add("model", model)
    live.capture(3, registry, False, 7)
    assert live.offer("exception", registry) == {"step": 3, "seq": 7}
    for symptom in ("sdc", "desync", "malformed"):
        assert "not trusted" in live.offer(symptom, registry)["why"]
    model.weight = torch.nn.Parameter(torch.zeros(2, 2))  # (a parameter replaced, not changed in place)
    assert "replaced" in live.offer("exception", registry)["why"]


def _plan(*offers: Any, steps: list[int] | None = None) -> RestorePlan:
    payloads = [json.dumps({"steps": steps or [4], "layout": None, "live": o}) for o in offers]
    return RestorePlan.parse(restore_plan(payloads))


def test_the_barrier_resumes_live_only_when_every_rank_vouches_for_one_step_after_the_same_collectives() -> (
    None
):
    assert _plan({"step": 6, "seq": 10}, {"step": 6, "seq": 10}).live == 6
    refused = _plan({"step": 6, "seq": 10}, {"why": "an optimizer step ran after step 6 began"})
    assert refused.live is None and refused.step == 4
    assert refused.live_refused == {"1": "an optimizer step ran after step 6 began"}
    ahead = _plan({"step": 6, "seq": 10}, {"step": 7, "seq": 12})  # rank 1 completed step 6
    assert ahead.live is None and ahead.live_refused == {"0": "at step 6", "1": "at step 7"}
    desync = _plan({"step": 6, "seq": 10}, {"step": 6, "seq": 11})
    assert desync.live is None and "11 collectives" in desync.live_refused["1"]
    # a rank that posts no offer (an older payload: steps alone) makes the plan fall back
    mixed = RestorePlan.parse(
        restore_plan([json.dumps([4]), json.dumps({"steps": [4], "live": {"step": 6, "seq": 1}})])
    )
    assert mixed.live is None and mixed.step == 4 and "0" in mixed.live_refused


def _closure_train(fault: int | None) -> Any:
    """``optimizer.step(closure)`` (Lightning's automatic optimization): the forward and backward
    run inside the optimizer's step; the fault raised in the closure's backward at step ``fault``."""
    pending = [fault]

    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ctx.track(model=model, optimizer=opt)
        for step in ctx.steps(10):

            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = model(torch.randn(4, 4)).pow(2).mean()
                loss.backward()
                if pending[0] == step:
                    pending[0] = None
                    raise ValueError(f"injected in the closure at step {step}")
                return loss

            opt.step(closure)
        return {k: v.clone() for k, v in model.state_dict().items()}

    return fn


def test_a_fault_inside_a_closure_resumes_live_bit_exact(tmp_path: Path) -> None:
    runs = []
    for name, fault in (("ref", None), ("hit", 6)):
        fakes = Fakes(tmp_path / name)
        runs.append((_runtime(fakes, _cfg(snapshot={"interval": 4})).run(_closure_train(fault)), fakes))
    (ref, _), (got, fakes) = runs
    _equal(ref, got)
    (restored,) = fakes.events("state_restored")
    assert (restored["step"], restored["source"]) == (6, "live")


def _stateful_loader_train(fault: int | None) -> Any:
    """The DDP tutorial's manual loop over torchdata's StatefulDataLoader: ``ctx.steps(n)``, a new
    ``iter(loader)`` at each epoch's start and at the entry after a restore."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    pending = [fault]

    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
        loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        ctx.track(model=model, optimizer=opt, loader=loader)
        per, batches = len(loader), None
        for step in ctx.steps(2 * per):
            if batches is None or step % per == 0:
                sampler.set_epoch(step // per)
                batches = iter(loader)
            if pending[0] == step:
                pending[0] = None
                raise ValueError(f"injected at step {step}")
            x, y = next(batches)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    return fn


def test_a_stateful_dataloader_resumes_live_from_the_state_its_step_began_with(tmp_path: Path) -> None:
    # (the restored loader's own state is kept for the next capture: asking it for its state_dict
    # before the function's iter() would begin its pass early)
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    runs = []
    for name, fault in (("ref", None), ("hit", 23)):
        fakes = Fakes(tmp_path / name)
        rt = _runtime(fakes, _cfg(snapshot={"interval": 5}))
        runs.append((rt.run(_stateful_loader_train(fault)), fakes))
    (ref, _), (got, fakes) = runs
    _equal(ref, got)
    (restored,) = fakes.events("state_restored")
    assert (restored["step"], restored["source"]) == (23, "live")


def test_a_rank_past_its_optimizers_update_leaves_at_the_steps_end() -> None:
    from resilient.errors import StepInterrupted

    live = LiveResume(True, 1024)
    registry = Registry()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry.add("model", model)
    registry.add("optimizer", opt)
    live.tracked("optimizer", opt)
    live.capture(4, registry, False, 3)
    assert not live.past_update() and not live.leave_at_step_end(0, 0, "peer")  # (before the update)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert live.past_update()
    assert not live.leave_at_step_end(0, 1, "peer")  # (another generation runs: nothing deferred)
    assert live.leave_at_step_end(0, 0, "peer: rank 1 faulted")
    live.capture(5, registry, False, 4)  # (the step's end: its successor's state captured first)
    with pytest.raises(StepInterrupted, match="rank 1 faulted"):
        live.leave_if_asked(0)
    assert live.offer("exception", registry) == {"step": 5, "seq": 4}
    assert not live.take_leaving(0)  # (left already: the grace timer interrupts nothing)
    # a tail that does not end in time is interrupted where it is, and vouches for nothing
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert live.leave_at_step_end(0, 0, "peer") and live.take_leaving(0)
    live.leave_if_asked(0)  # (taken: nothing raised here)
    assert "optimizer step ran" in live.offer("exception", registry)["why"]


class Counted(torch.nn.Linear):
    """A module with extra state (``get_extra_state``) that its forward changes."""

    def __init__(self) -> None:
        super().__init__(2, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self) -> Any:
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def test_a_modules_extra_state_is_read_at_every_capture() -> None:
    live, registry, m = LiveResume(True, 1024), Registry(), Counted()
    registry.add("model", m)
    for step in range(3):
        live.capture(step, registry, False, 0)
        m(torch.ones(1, 2))
    assert live.state(registry)["model"]["_extra_state"] == {"calls": 2}  # (as step 2 began)


def test_a_rank_inside_its_optimizers_update_also_leaves_at_the_steps_end() -> None:
    # a peer's fault arriving while the update runs (seen at 2 of 4 ranks under load: the rank then
    # vouched for nothing and every rank went back to the ring) waits for the update and the tail;
    # a closure's forward and backward (the update has not begun) is interrupted as before
    from resilient.errors import StepInterrupted

    live = LiveResume(True, 1024)
    registry = Registry()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registry.add("model", model)
    registry.add("optimizer", opt)
    live.tracked("optimizer", opt)
    live.capture(4, registry, False, 3)
    seen: list[bool] = []

    def closure() -> torch.Tensor:  # (Lightning's: the forward and backward inside opt.step)
        seen.append(live.leave_at_step_end(0, 0, "peer"))  # (the update has not begun: no)
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    opt.step(closure)
    live.capture(5, registry, False, 4)
    # a hook after the runtime's: the update has begun when it runs, as a fault arriving then
    opt.register_step_pre_hook(lambda *_: seen.append(live.leave_at_step_end(0, 0, "peer: rank 1 faulted")))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert seen == [False, True], seen
    live.capture(6, registry, False, 5)
    with pytest.raises(StepInterrupted, match="rank 1 faulted"):
        live.leave_if_asked(0)
    assert live.offer("exception", registry) == {"step": 6, "seq": 5}
