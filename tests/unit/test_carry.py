"""``ctx.carry``: values a loop carries between steps outside any tracked object (a prefetched
batch, a best loss) are restored with the rest, live or from a snapshot, and the run ends where a
fault-free run ends; without it, the same loop does not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from resilient.errors import ResilienceError
from resilient.runtime.context import Context
from resilient.runtime.steps import replay
from resilient.runtime.steps.loop import StepLoop
from resilient.state.carry import Carried
from tests.unit.test_core import Fakes, _cfg, _runtime

STEPS = 12


def test_fields_are_attributes_and_what_cannot_be_kept_is_refused_by_name() -> None:
    c = Carried(batch=None, best=1e9)
    c.batch = (torch.zeros(2), torch.ones(2))
    c.stats = {"tokens": 3, "seen": [1, 2]}
    assert c.best == 1e9 and "stats" in c and c.fields()["batch"][1].sum() == 2
    with pytest.raises(AttributeError, match="no field 'missing'"):
        _ = c.missing
    with pytest.raises(TypeError, match=r"ctx\.carry\.bad\[0\]: cannot carry a object"):
        c.bad = [object()]
    with pytest.raises(TypeError, match="keys are strings"):
        c.bad = {1: 2}
    # a snapshot is not changed by later in-place edits of a carried container; tensors are shared
    sd = c.state_dict()
    c.stats["seen"].append(3)
    assert sd["stats"]["seen"] == [1, 2] and sd["batch"][0] is c.batch[0]
    c.load_state_dict({"best": 0.5, "arr": np.arange(3)})
    assert c.best == 0.5 and "batch" not in c


def _train(fault_at: Callable[[int, int], bool], carried: bool) -> Callable[[StepLoop], dict[str, Any]]:
    """A loop that draws its next batch at the end of each step (a prefetch) and keeps its best
    loss: in ``ctx.carry`` when ``carried``, else in locals, as scripts often do."""

    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.track(model=model, opt=opt)
        first = torch.randn(4, 8)  # (drawn at the top: after a restart, from whatever the RNG holds)
        carry = ctx.carry(batch=first, best=1e9) if carried else None
        batch, best = first, 1e9
        for step in ctx.steps(STEPS):
            x = carry.batch if carry is not None else batch
            loss = model(x).pow(2).mean()
            if fault_at(ctx.generation, step):
                raise ValueError(f"boom at step {step}")
            opt.zero_grad()
            loss.backward()
            opt.step()
            if carry is not None:
                carry.best = min(carry.best, loss.item())
                carry.batch = torch.randn(4, 8)
            else:
                best, batch = min(best, loss.item()), torch.randn(4, 8)
        final = {k: v.clone() for k, v in model.state_dict().items()}
        return {**final, "best": carry.best if carry is not None else best}

    return fn


@pytest.fixture(autouse=True)
def _digest_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay, "BUDGET", 1.0)  # (microsecond steps here: a digest at every one)


@pytest.mark.parametrize("live", [True, False], ids=["live", "ring"])
def test_a_carried_prefetch_is_restored_and_the_run_ends_bit_exact(tmp_path: Path, live: bool) -> None:
    cfg = _cfg(snapshot={"interval": 4, "live": live})
    ref_rt = _runtime(Fakes(tmp_path / "ref"), cfg)
    ref = ref_rt.run(_train(lambda g, s: False, carried=True))
    fakes = Fakes(tmp_path / "hit")
    rt = _runtime(fakes, cfg)
    got = rt.run(_train(lambda g, s: g == 0 and s == 6, carried=True))
    assert all(torch.equal(ref[k], got[k]) for k in ref if k != "best") and ref["best"] == got["best"]
    (restored,) = fakes.events("state_restored")
    assert "carry" in restored["objects"]
    assert (restored["step"], restored["source"]) == ((6, "live") if live else (4, "ring")), restored
    # the replay from the ring is checked step by step; a live resume replays nothing
    (said,) = [e for e in fakes.events() if e["event"].startswith("replay_")]
    if live:
        assert said["event"] == "replay_unchecked" and "resumed live" in said["why"], said
    else:
        assert said["event"] == "replay_verified" and (said["first"], said["last"]) == (5, 6), said


def test_the_same_prefetch_kept_in_a_local_is_not_restored(tmp_path: Path) -> None:
    # what ctx.carry is for: the batch drawn before the loop comes from the restart's RNG, not
    # from the step the run resumes at
    cfg = _cfg(snapshot={"interval": 4, "live": False})
    ref_rt = _runtime(Fakes(tmp_path / "ref"), cfg)
    ref = ref_rt.run(_train(lambda g, s: False, carried=False))
    fakes = Fakes(tmp_path / "hit")
    got = _runtime(fakes, cfg).run(_train(lambda g, s: g == 0 and s == 6, carried=False))
    assert not all(torch.equal(ref[k], got[k]) for k in ref if k != "best")
    # and the runtime says so: the replay of step 4 (the first after the restore) differs
    (said,) = [e for e in fakes.events() if e["event"].startswith("replay_")]
    assert said["event"] == "replay_diverged" and said["first_step"] == 5, said
    assert set(said["objects"]) == {"model"} and any("ctx.carry" in c for c in said["causes"])


def _ema_train(fault: bool) -> Callable[[StepLoop], dict[str, Any]]:
    def fn(loop: StepLoop) -> dict[str, Any]:
        ctx = Context(loop)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx.track(model=model, opt=opt)
        carry = ctx.carry(ema=torch.zeros(4))
        for step in ctx.steps(STEPS):
            carry.ema.mul_(0.9).add_(torch.randn(4))  # an in-place EMA: the step's start is gone
            if fault and ctx.generation == 0 and step == 6:
                raise ValueError("boom")
            loss = model(carry.ema).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return {"ema": carry.ema.clone(), **{k: v.clone() for k, v in model.state_dict().items()}}

    return fn


def test_a_carried_tensor_changed_in_place_in_the_step_falls_back_to_a_snapshot(tmp_path: Path) -> None:
    cfg = _cfg(snapshot={"interval": 4})
    ref = _runtime(Fakes(tmp_path / "ref"), cfg).run(_ema_train(False))
    fakes = Fakes(tmp_path / "hit")
    got = _runtime(fakes, cfg).run(_ema_train(True))
    (agreed,) = fakes.events("restore_agreed")
    assert agreed["source"] == "ring" and "'carry' changed in place" in str(agreed["live_refused"]), agreed
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_carry_is_called_once_per_entry(tmp_path: Path) -> None:
    def fn(loop: StepLoop) -> None:
        ctx = Context(loop)
        ctx.carry(a=1)
        ctx.carry(b=2)

    rt = _runtime(Fakes(tmp_path), _cfg())
    with pytest.raises(ResilienceError, match="called twice"):
        rt.run(fn)
