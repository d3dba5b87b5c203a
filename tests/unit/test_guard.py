"""The step guard: non-finite and spiking gradients rejected before ``optimizer.step`` applies them,
and the verdict on one that comes back on replay."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from resilient.detectors.guard import GuardConfig, NonFiniteStep, SpikeStep, StepGuard, Window, grad_norm
from resilient.errors import FaultRepeats
from resilient.runtime.context import Context
from resilient.runtime.faults.records import FaultRecord, classify


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: Any, **fields: Any) -> dict[str, Any]:
        self.emitted.append((event.value, fields))
        return fields


class Run:
    """A model, its optimizer and a guard watching it; ``train(step, grad)`` runs one step whose
    gradient is ``grad`` everywhere."""

    def __init__(self, **cfg: Any) -> None:
        self.model = torch.nn.Linear(4, 1, bias=False)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.step: int | None = None
        self.events = Events()
        self.guard = StepGuard(GuardConfig(**cfg), self.events, lambda: self.step)  # type: ignore[arg-type]
        self.guard.attach("optimizer", self.opt)

    def train(self, step: int, grad: float) -> None:
        self.step = step
        self.model.weight.grad = torch.full_like(self.model.weight, grad)
        self.opt.step()

    def warm(self, steps: int = 10, grad: float = 1.0) -> None:
        for s in range(steps):
            self.train(s, grad)


def fault(kind: str, step: int) -> FaultRecord:
    return FaultRecord(rank=0, generation=0, step=step, kind=kind, severity="soft",
                       signature=f"{kind}: x", message=f"{kind} at step {step}")  # fmt: skip


def test_grad_norm_is_finite_nan_inf_or_an_overflow_of_finite_values():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    assert grad_norm(opt) is None  # no gradient yet
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert grad_norm(opt) == (5.0, True)
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    value, finite = grad_norm(opt)  # type: ignore[misc]
    assert math.isnan(value) and not finite
    p.grad = torch.tensor([1.0, float("-inf"), 0.0])
    assert grad_norm(opt) == (math.inf, False)
    p.grad = torch.tensor([3e38, 3e38, 0.0])  # every value finite, the sum of squares is not
    assert grad_norm(opt) == (math.inf, True)


def test_a_non_finite_gradient_is_rejected_before_the_weights_change():
    run = Run()
    before = run.model.weight.detach().clone()
    with pytest.raises(NonFiniteStep, match=r"non-finite gradient .* of 'optimizer' at step 3") as e:
        run.train(3, float("nan"))
    assert torch.equal(run.model.weight, before)  # the update was not applied
    assert e.value.step == 3 and classify(e.value)[0] == "nonfinite"


def test_a_spike_is_judged_against_the_median_after_the_warmup():
    run = Run(spike=10.0, warmup=5, window=8)
    run.train(0, 100.0)  # nothing to compare with yet: applied
    for s in range(1, 5):
        run.train(s, 1.0)
    run.train(5, 5.0)  # 5x the median of [100, 1, 1, 1, 1]: below 10x
    with pytest.raises(SpikeStep, match=r"is 25.0x the median") as e:
        run.train(6, 25.0)
    assert classify(e.value)[0] == "spike"
    run.guard.rewind(6)
    run.train(6, 1.0)  # the replay, without the spike


def test_turned_off_the_spike_watch_lets_any_finite_value_through():
    run = Run(spike=0.0)
    run.warm()
    run.train(10, 1e12)


def test_a_roll_back_drops_the_values_of_the_steps_it_undid():
    w = Window(5)
    for s, v in enumerate([1.0, 2.0, 3.0, 4.0]):
        w.add(s, v)
    w.rewind(2)
    assert [s for s, _ in w.values] == [0, 1] and w.median() == 1.5


def test_a_spike_that_comes_back_on_replay_is_the_datas_and_applied():
    run = Run()
    run.warm()
    with pytest.raises(SpikeStep):
        run.train(10, 1e3)
    run.guard.learn(fault("spike", 10), [])  # the recovery: every rank agreed
    run.guard.rewind(10)
    run.train(10, 1e3)  # the same spike, replayed: applied
    assert run.events.emitted[-1][0] == "spike_accepted"
    assert run.model.weight[0, 0].item() < -50  # SGD applied the 1e3 gradient


def test_a_non_finite_step_that_comes_back_on_replay_stops_naming_the_step():
    run = Run()
    run.guard.learn(fault("nonfinite", 7), [])
    with pytest.raises(FaultRepeats, match=r"fault repeats at step 7: .*came back on replay.*on_nonfinite"):
        run.guard.learn(fault("nonfinite", 7), [])


def test_skip_batch_drops_that_steps_update_on_every_pass():
    run = Run(on_nonfinite="skip_batch")
    run.warm(3)
    before = run.model.weight.detach().clone()
    run.guard.learn(fault("nonfinite", 3), [])
    run.guard.learn(fault("nonfinite", 3), [])  # came back on replay: skip it from now on
    run.train(3, float("nan"))
    assert torch.equal(run.model.weight, before)
    assert run.events.emitted[-1][0] == "batch_skipped"
    run.train(4, 1.0)  # the next step is applied as usual
    assert not torch.equal(run.model.weight, before)


def test_with_a_closure_the_gradients_are_checked_after_the_step():
    run = Run()
    run.step = 0

    def closure() -> torch.Tensor:
        run.model.weight.grad = torch.full_like(run.model.weight, float("inf"))
        return torch.tensor(0.0)

    with pytest.raises(NonFiniteStep):
        run.opt.step(closure)  # the pre-hook saw no gradient: the post-hook checks


def test_observed_loss_is_held_to_the_same_rules():
    run = Run(loss_spike=3.0, warmup=3)
    for s in range(3):
        run.step = s
        run.guard.observed(torch.tensor(2.0))
    run.step = 3
    with pytest.raises(SpikeStep, match=r"loss 7 is 3\.5x"):
        run.guard.observed(7.0)
    with pytest.raises(NonFiniteStep, match="non-finite loss"):
        run.guard.observed(torch.tensor(float("inf")))


def test_ctx_observe_names_an_unknown_value():
    class Loop:
        def observe(self, loss: Any) -> None:
            self.seen = loss

    loop = Loop()
    ctx = Context(loop)  # type: ignore[arg-type]
    ctx.observe(loss=1.5)
    assert loop.seen == 1.5
    with pytest.raises(TypeError, match="got accuracy"):
        ctx.observe(accuracy=0.5)
