"""Replay verification's bookkeeping (runtime/steps/replay.py): the digests kept, the replay
compared with them after a restore from the ring or from shared memory, across a generation's new
objects; what it says when there is nothing to compare, and ``verify_replay: stop``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import resilient.runtime.steps.replay as replay_mod
from resilient.errors import ReplayDiverged
from resilient.events import Event
from resilient.runtime.steps.live import LiveResume
from resilient.runtime.steps.replay import ReplayCheck
from resilient.state.carry import Carried
from resilient.state.registry import Registry, capture_rng, restore_rng
from tests.unit.test_carry import _train
from tests.unit.test_core import Fakes, _cfg, _runtime


class Clock:
    """Read at a step's start and at its digest's end: steps of 100 ms, digests of 0.1 ms."""

    def __init__(self) -> None:
        self.t, self.calls = 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        self.t += 0.0001 if self.calls % 2 == 0 else 0.0999
        return self.t


class Trainer:
    """A model, an optimizer and a carried counter, trained from a seed; ``start(step)`` captures
    and digests the state as a step's start (a new Trainer is a new generation's objects)."""

    def __init__(self, check: ReplayCheck, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.carry = Carried(seen=0)
        self.registry = Registry()
        for name, obj in {"model": self.model, "opt": self.opt, "carry": self.carry}.items():
            self.registry.add(name, obj)
        self.live = LiveResume(False, 1 << 20, capture=True)
        self.check = check
        check.generation()

    def start(self, step: int) -> None:
        self.live.capture(step, self.registry, False, -1)
        objects = dict(zip(self.registry.names(), self.registry.objects(), strict=True))
        self.check.at_start(step, self.live.cap, objects, self.live)

    def step(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        self.model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.carry.seen += 1

    def state(self) -> dict[str, Any]:
        model = {k: v.clone() for k, v in self.model.state_dict().items()}
        return model | {
            "seen": self.carry.seen,
            "rng": capture_rng(),
            "opt": copy.deepcopy(self.opt.state_dict()),
        }

    def load(self, state: dict[str, Any]) -> None:
        """As a restore loads a snapshot: every object, then the RNGs."""
        self.model.load_state_dict({k: v for k, v in state.items() if k not in ("seen", "opt", "rng")})
        self.opt.load_state_dict(copy.deepcopy(state["opt"]))  # (an optimizer keeps what it is given)
        self.carry.seen = state["seen"]
        restore_rng(state["rng"])


def _events() -> tuple[list[tuple[Event, dict[str, Any]]], Any]:
    seen: list[tuple[Event, dict[str, Any]]] = []
    return seen, lambda event, **kw: seen.append((event, kw))


def _run(t: Trainer, steps: range, keep: dict[int, dict[str, Any]] | None = None) -> None:
    for s in steps:
        t.start(s)
        if keep is not None and s in (4, 8):
            keep[s] = t.state()
        t.step(s)


def test_a_replay_from_a_snapshot_in_a_new_generation_is_verified_step_by_step() -> None:
    # the ring's or shared memory's snapshot of step 4 is loaded into a new generation's objects
    # (a restart re-enters the function): its start and every replayed step equal the first run's
    seen, emit = _events()
    check = ReplayCheck("warn", emit, clock=Clock())
    snaps: dict[int, dict[str, Any]] = {}
    t = Trainer(check)
    _run(t, range(0, 7), snaps)  # the fault in step 6
    for source in ("ring", "shm"):
        t2 = Trainer(check, seed=99)  # (the new generation: other objects, other initial values)
        t2.load(snaps[4])
        check.restored(4, 6, source, 1)
        _run(t2, range(4, 7))
        (verified,) = [kw for e, kw in seen if e is Event.REPLAY_VERIFIED]
        assert (verified["first"], verified["last"], verified["steps_checked"]) == (5, 6, 2), verified
        assert verified["restore_checked"] and verified["restored_step"] == 4
        seen.clear()


def test_a_replay_that_differs_names_the_first_step_and_the_leaves() -> None:
    seen, emit = _events()
    check = ReplayCheck("warn", emit, clock=Clock())
    snaps: dict[int, dict[str, Any]] = {}
    t = Trainer(check)
    _run(t, range(0, 7), snaps)
    t2 = Trainer(check, seed=99)
    t2.load(snaps[4])
    check.restored(4, 6, "ring", 1)
    t2.start(4)
    t2.step(41)  # another batch than the run's step 4 (a prefetch kept in a local, say)
    t2.start(5)
    (diverged,) = [kw for e, kw in seen if e is Event.REPLAY_DIVERGED]
    assert diverged["first_step"] == 5 and diverged["steps_checked"] == 1, diverged
    assert diverged["objects"]["model"] == ["0.weight", "0.bias", "1.weight", "1.bias", "/1.running_mean",
                                            "/1.running_var"], diverged  # fmt: skip
    assert any("ctx.carry" in c for c in diverged["causes"])
    # a restore that does not bring back what was saved is named at the restored step itself
    seen.clear()
    t3 = Trainer(check, seed=99)
    t3.load(snaps[4] | {"seen": 3})
    check.restored(4, 6, "ring", 2)
    t3.start(4)
    (diverged,) = [kw for e, kw in seen if e is Event.REPLAY_DIVERGED]
    assert diverged["first_step"] == 4 and diverged["objects"] == {"carry": ["(its non-tensor values)"]}


def test_a_silent_faults_replay_is_checked_against_the_run_before_its_window_only() -> None:
    # a flipped bit at step 6 went unnoticed until the check at step 9's end, whose window began at
    # step 5: the run's digests from step 6 on are of the corrupted model. The replay from the
    # snapshot of step 4 is correct, is verified up to step 5, and is never called diverged.
    seen, emit = _events()
    check = ReplayCheck("warn", emit, clock=Clock())
    snaps: dict[int, dict[str, Any]] = {}
    t = Trainer(check)
    _run(t, range(0, 6), snaps)
    with torch.no_grad():  # the flip, in step 6
        t.model[0].weight.view(-1)[3] *= -1
    _run(t, range(6, 10))
    t2 = Trainer(check, seed=99)
    t2.load(snaps[4])
    check.restored(4, 9, "ring", 1, since=5)
    _run(t2, range(4, 10))
    assert not [kw for e, kw in seen if e is Event.REPLAY_DIVERGED], seen
    (verified,) = [kw for e, kw in seen if e is Event.REPLAY_VERIFIED]
    assert (verified["first"], verified["last"], verified["reference_end"]) == (5, 5, 5), verified
    # restored at the window's first step: nothing before the fault's window was replayed
    seen.clear()
    t3 = Trainer(check, seed=99)
    t3.load(snaps[4])
    check.restored(4, 9, "ring", 2, since=4)
    _run(t3, range(4, 10))
    (why,) = [kw["why"] for e, kw in seen if e is Event.REPLAY_UNCHECKED]
    assert why.startswith("the restored state matched; a silent fault found at step 9")
    assert "may have begun at step 4" in why


def test_nothing_to_compare_is_said_and_why() -> None:
    seen, emit = _events()
    check = ReplayCheck("warn", emit, clock=Clock())
    t = Trainer(check)
    _run(t, range(0, 7))
    check.restored(6, 6, "live", 1)  # a live resume replays nothing
    (why,) = [kw["why"] for e, kw in seen if e is Event.REPLAY_UNCHECKED]
    assert "resumed live" in why
    seen.clear()
    check.restored(4, 6, "ring", 1)
    check.restored(4, 6, "ring", 2)  # a second fault before the replay reached step 6
    (why,) = [kw["why"] for e, kw in seen if e is Event.REPLAY_UNCHECKED]
    assert "another fault came before the replay reached step 6" in why
    seen.clear()
    check.prune(5)  # the oldest snapshot a restore can return to: step 5
    assert min(check.kept) == 5
    check.restored(2, 3, "checkpoint", 3)  # further back than any digest kept
    _run(Trainer(check), range(2, 4))
    whys = [kw["why"] for e, kw in seen if e is Event.REPLAY_UNCHECKED]
    assert len(whys) == 2 and "another fault" in whys[0] and "no digest was kept of steps 3..3" in whys[1]


def test_the_digest_is_taken_as_often_as_its_budget_allows() -> None:
    _, emit = _events()
    ticks = iter(range(10**6))
    check = ReplayCheck("warn", emit, clock=lambda: float(next(ticks)), budget=0.1)
    t = Trainer(check)
    _run(t, range(0, 12))
    # each digest costs one tick and a step two (its start, the digest's end): 0.5 of a step
    assert check.every == 5, check.every
    assert sorted(check.kept) == [0, 1, 2, 3, 4, 5, 10]


def test_verify_replay_stop_ends_the_run_naming_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the prefetch kept in a local (tests/unit/test_carry.py), verify_replay: stop: exit 3
    monkeypatch.setattr(replay_mod, "BUDGET", 1.0)  # (microsecond steps here: digest every one)
    fakes = Fakes(tmp_path)
    rt = _runtime(fakes, _cfg(snapshot={"interval": 4, "live": False}, verify_replay="stop"))
    with pytest.raises(ReplayDiverged, match=r"diverged: the replay of step 4 differs .* at step 5"):
        rt.run(_train(lambda g, s: g == 0 and s == 6, carried=False))
    assert ReplayDiverged.exit_code == 3
    (failed,) = fakes.events("run_failed")
    assert "verify_replay: stop" in failed["error"]


def test_the_steps_after_a_snapshot_are_digested_whatever_the_cadence() -> None:
    # a digest too dear for every step is taken every k steps, and at the steps that follow each
    # snapshot: a replay from the ring begins at one, so it is checked however short it is
    seen, emit = _events()
    ticks = iter(range(10**6))
    check = ReplayCheck("warn", emit, clock=lambda: float(next(ticks)), budget=0.1)
    t = Trainer(check)
    snaps: dict[int, dict[str, Any]] = {}
    for s in range(0, 9):
        t.start(s)
        if s == 7:  # (as the loop does: the step's start digested first, then the ring's copy kept)
            check.snapshot_at(7, 7)  # (nothing older kept)
            snaps[7] = t.state()
        t.step(s)
    assert check.every == 5 and sorted(check.kept) == [8], sorted(check.kept)
    t2 = Trainer(check, seed=99)
    t2.load(snaps[7])
    check.restored(7, 8, "ring", 1)
    _run(t2, range(7, 9))
    (verified,) = [kw for e, kw in seen if e is Event.REPLAY_VERIFIED]
    assert (verified["first"], verified["last"]) == (8, 8) and not verified["restore_checked"], verified
