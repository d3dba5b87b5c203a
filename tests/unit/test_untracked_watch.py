"""The step loop's scan for state the runtime cannot see (runtime/steps/untracked_watch.py), in
the built-in engine with fakes (tests/unit/test_core.py): a hand-written loader left untracked is
named in an ``untracked_state`` event and first among a diverged replay's causes; tracked, nothing
is said; a trainer's loop (``ctx.begin_step``) is not scanned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from resilient.runtime.context import Context
from resilient.runtime.steps.loop import StepLoop
from tests.unit.test_core import Fakes, _cfg, _runtime


class Loader:
    """A loader as popular single-file scripts write it: its position in plain attributes."""

    def __init__(self) -> None:
        self.current_position = 0

    def next_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.current_position)
        self.current_position += 4
        return torch.randn(4, 2, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"current_position": self.current_position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.current_position = state["current_position"]


class Bare:
    """The same loader with nothing to restore it by."""

    def __init__(self) -> None:
        self.current_position = 0

    def next_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.current_position)
        self.current_position += 4
        return torch.randn(4, 2, generator=g)


def _fn(make: Any, track_loader: bool, fault_at: int | None = None) -> Any:
    def fn(loop: StepLoop) -> None:
        ctx = Context(loop)
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loader = make()
        objects: dict[str, Any] = {"model": model, "opt": opt}
        if track_loader:
            objects["train_loader"] = train_loader
        ctx.track(**objects)
        for step in ctx.steps(10):
            if fault_at is not None and ctx.generation == 0 and step == fault_at:
                raise ValueError("boom")
            loss = model(train_loader.next_batch()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    return fn


def test_an_untracked_loader_is_named_with_its_attribute_and_the_line_to_add(tmp_path: Path) -> None:
    fakes = Fakes(tmp_path)
    _runtime(fakes).run(_fn(Bare, track_loader=False))
    (said,) = fakes.events("untracked_state")
    (found,) = said["findings"]
    assert found["name"] == "train_loader.current_position" and found["type"] == "Bare", found
    assert "state_dict()" in found["fix"] and "ctx.track(train_loader=train_loader)" in found["fix"]
    assert said["step"] == 2  # (decided at the third step's start)


def test_a_tracked_loader_and_a_loader_with_state_dict_left_out_say_what_they_should(tmp_path: Path) -> None:
    tracked = Fakes(tmp_path / "tracked")
    _runtime(tracked).run(_fn(Loader, track_loader=True))
    assert tracked.events("untracked_state") == []
    left_out = Fakes(tmp_path / "left_out")
    _runtime(left_out).run(_fn(Loader, track_loader=False))
    (said,) = left_out.events("untracked_state")
    assert [f["fix"] for f in said["findings"]] == ["ctx.track(train_loader=train_loader)"]


def test_a_diverged_replay_names_the_untracked_value_first(tmp_path: Path) -> None:
    # the fault comes after the scan; the restore from the ring replays a loader that went on
    fakes = Fakes(tmp_path)
    cfg = _cfg(snapshot={"interval": 4, "live": False})
    _runtime(fakes, cfg).run(_fn(Bare, track_loader=False, fault_at=6))
    (diverged,) = fakes.events("replay_diverged")
    assert diverged["causes"][0].startswith("train_loader.current_position (Bare) changes every step")


def test_a_loop_that_is_not_ctx_steps_is_not_scanned(tmp_path: Path) -> None:
    fakes = Fakes(tmp_path)

    def fn(loop: StepLoop) -> None:
        ctx = Context(loop)
        loader = Bare()
        ctx.track(model=torch.nn.Linear(2, 1))
        for _ in range(6):  # a trainer's loop: its callbacks begin and end each step
            ctx.begin_step()
            loader.next_batch()
            ctx.end_step()

    _runtime(fakes).run(fn)
    assert fakes.events("untracked_state") == []
