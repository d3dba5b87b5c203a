"""A step that ends inside a gradient-accumulation window keeps the module's gradients."""

from __future__ import annotations

import copy

import torch
from torch import nn

from resilient.state import Registry
from resilient.state.registry import GRAD


def _setup(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Registry]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    reg = Registry()
    reg.add("model", model)
    reg.add("opt", opt)
    return model, opt, reg


def _micro_step(reg: Registry, model: nn.Module, x: torch.Tensor) -> None:
    reg.step_begins()
    model(x).square().mean().backward()


def test_gradients_are_kept_mid_window_and_come_back() -> None:
    model, opt, reg = _setup(0)
    assert GRAD not in reg.capture()["model"]  # before any step: nothing pending
    _micro_step(reg, model, torch.randn(2, 4))
    saved = copy.deepcopy(reg.capture()["model"])  # (the ring copies; so does this test)
    assert set(saved[GRAD]) == {n for n, _ in model.named_parameters()}

    again, _, reg2 = _setup(1)
    reg2.load("model", saved)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad), n
    assert q.grad is not saved[GRAD][n]  # its own copy: accumulation must not write into a snapshot

    reg.step_begins()  # the window closes: the optimizer steps, gradients are stale from here on
    model(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    assert GRAD not in reg.capture()["model"]


def test_untracked_optimizers_and_plain_steps_keep_no_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    reg = Registry()
    reg.add("model", model)  # no optimizer tracked: nothing says a window is open
    _micro_step(reg, model, torch.randn(2, 4))
    assert GRAD not in reg.capture()["model"]
