"""Registry + SnapshotRing: a restore into fresh objects replays training bit for bit."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from chaos.compare import assert_bit_exact
from resilient.errors import StateRestoreError
from resilient.state import Registry, SnapshotRing, restore_rng
from resilient.state.registry import RNG


class Trainer:
    """A small but complete training setup: every kind of state the runtime must restore."""

    def __init__(self, init_seed: int) -> None:
        torch.manual_seed(init_seed)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 0.8**s)
        self.gen = torch.Generator().manual_seed(init_seed + 1000)
        self.registry = Registry()
        self.registry.add("model", self.model)
        self.registry.add("optim", self.opt)
        self.registry.add("sched", self.sched)
        self.registry.add("data", self.gen)

    def step(self) -> dict[str, Any]:
        x = torch.randn(16, 4, generator=self.gen)  # data order: a dedicated generator
        y = torch.randn(16, 2, generator=self.gen)
        py = random.random()  # python RNG (e.g. augmentation choice)
        npy = float(np.random.rand())  # numpy RNG
        out = self.model(x)  # dropout draws from the global torch RNG
        loss = ((out - y) ** 2).mean() * (1.0 + py) * (0.5 + npy)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        return {"loss": loss.detach().clone(), "py": py, "np": npy, "torch": torch.rand(3)}

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "gen": self.gen.get_state(),
        }


def clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def restore_into(t: Trainer, state: dict[str, Any]) -> None:
    for name in t.registry.names():
        t.registry.load(name, state[name])
    restore_rng(state[RNG])


@pytest.fixture
def seeded():
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)


def test_restore_into_fresh_objects_replays_bit_identically(seeded):
    k, m = 3, 4
    t = Trainer(init_seed=0)
    for _ in range(k):
        t.step()
    ring = SnapshotRing()
    ring.capture(k, t.registry.capture())
    expected = [t.step() for _ in range(m)]
    expected_state = t.state()

    # as after a restart: new objects built from scratch (other init, other RNG positions)
    fresh = Trainer(init_seed=123)
    random.random()
    np.random.rand()
    restore_into(fresh, ring.materialize(k))
    replay = [fresh.step() for _ in range(m)]

    assert assert_bit_exact(expected, replay) == 2 * m
    n = assert_bit_exact(expected_state, fresh.state())
    assert n >= 10  # parameters, BN buffers, Adam moments and steps, the generator state
    assert fresh.sched.get_last_lr() == t.sched.get_last_lr()


def test_snapshot_is_a_copy_not_a_view_of_live_state(seeded):
    t = Trainer(init_seed=0)
    t.step()
    ring = SnapshotRing()
    ring.capture(1, t.registry.capture())
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.step()  # mutates parameters and optimizer state in place
    snap = ring.materialize(1)
    assert_bit_exact(before, snap["model"])


def test_buffers_are_reused_across_captures(seeded):
    t = Trainer(init_seed=0)
    ring = SnapshotRing()
    ptrs: list[dict[str, int]] = []
    for step in range(1, 6):
        t.step()
        ring.capture(step, t.registry.capture())
        slot = next(s for s in ring._slots if s.valid and s.step == step)
        ptrs.append({path: b.data_ptr() for path, b in slot.buffers.items()})
        if step == 2:
            nbytes = ring.nbytes
    assert nbytes > 0 and ring.nbytes == nbytes
    # steps 1, 3, 5 went to one slot, 2 and 4 to the other: no new allocation after the first fill
    assert ptrs[0] == ptrs[2] == ptrs[4]
    assert ptrs[1] == ptrs[3]
    assert set(ptrs[0].values()).isdisjoint(ptrs[1].values())


def test_two_slots_keep_the_two_newest_steps(seeded):
    t = Trainer(init_seed=0)
    ring = SnapshotRing()
    assert ring.steps() == []
    for step in (10, 11, 12):
        t.step()
        ring.capture(step, t.registry.capture())
    assert ring.steps() == [12, 11]
    with pytest.raises(StateRestoreError, match=r"no snapshot for step 10; held: \[12, 11\]"):
        ring.materialize(10)


def test_capturing_the_same_step_twice_keeps_the_first(seeded):
    t = Trainer(init_seed=0)
    ring = SnapshotRing()
    t.step()
    ring.capture(1, t.registry.capture())
    first = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.step()
    ring.capture(1, t.registry.capture())
    assert ring.steps() == [1]
    assert_bit_exact(first, ring.materialize(1)["model"])


def test_materialize_returns_independent_clones(seeded):
    t = Trainer(init_seed=0)
    for _ in range(2):
        t.step()
    ring = SnapshotRing()
    ring.capture(2, t.registry.capture())
    pristine = clone_tree(ring.materialize(2))

    restored = ring.materialize(2)
    fresh = Trainer(init_seed=5)
    restore_into(fresh, restored)
    fresh.step()  # Optimizer.load_state_dict keeps the given tensors: this step writes into them
    for v in fresh.opt.state.values():
        v["exp_avg"].add_(100.0)
    restored["model"]["0.weight"].zero_()

    assert_bit_exact(pristine, ring.materialize(2))


def test_drop_after_invalidates_newer_snapshots(seeded):
    t = Trainer(init_seed=0)
    ring = SnapshotRing()
    for step in (4, 5):
        t.step()
        ring.capture(step, t.registry.capture())
    ring.drop_after(4)
    assert ring.steps() == [4]
    with pytest.raises(StateRestoreError):
        ring.materialize(5)
    ring.materialize(4)
    # step 5 can be captured again (after the replay) and the step-4 snapshot survives it
    t.step()
    ring.capture(5, t.registry.capture())
    assert ring.steps() == [5, 4]


def test_registry_rejects_objects_without_state_dict():
    reg = Registry()
    with pytest.raises(TypeError, match="loader"):
        reg.add("loader", object())
    with pytest.raises(ValueError, match="reserved"):
        reg.add(RNG, nn.Linear(1, 1))
    reg.add("gen", torch.Generator())
    reg.add("lin", nn.Linear(1, 1))
    assert reg.names() == ["gen", "lin"] and "lin" in reg and "loader" not in reg

    class Wrapped(torch.optim.Optimizer):  # a wrapper that never ran Optimizer.__init__ (Accelerate's)
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

        def state_dict(self) -> dict:  # type: ignore[override]
            return self.optimizer.state_dict()

        def load_state_dict(self, sd: dict) -> None:  # type: ignore[override]
            self.optimizer.load_state_dict(sd)

    inner = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"cannot track opt=Wrapped: it wraps an optimizer .*opt=<it>\.optimizer"
    ):
        reg.add("opt", Wrapped(inner))
    assert "opt" not in reg


def test_registry_load_failure_names_the_object():
    reg = Registry()
    reg.add("model", nn.Linear(2, 2))
    bad = nn.Linear(3, 3).state_dict()
    with pytest.raises(StateRestoreError, match="'model'"):
        reg.load("model", bad)


def test_rng_state_round_trip(seeded):
    reg = Registry()
    state = SnapshotRing()
    state.capture(0, reg.capture())
    draws = (random.random(), float(np.random.rand()), torch.rand(4))
    restore_rng(state.materialize(0)[RNG])
    again = (random.random(), float(np.random.rand()), torch.rand(4))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])


def test_adopted_step_materializes_from_its_loader_until_evicted(seeded):
    t = Trainer(0)
    ring = SnapshotRing()
    loads: list[int] = []
    held = t.registry.capture()

    def loader() -> dict[str, Any]:
        loads.append(1)
        return _copied(held)

    ring.adopt(5, loader)
    assert ring.steps() == [5] and ring.nbytes == 0  # nothing copied at adoption
    got = ring.materialize(5)
    assert loads == [1] and torch.equal(got["model"]["0.weight"], t.model[0].weight)
    ring.capture(6, t.registry.capture())
    ring.capture(7, t.registry.capture())  # the adopted slot is the oldest: it goes
    assert ring.steps() == [7, 6]
    with pytest.raises(StateRestoreError, match="no snapshot for step 5"):
        ring.materialize(5)


def test_adopted_step_that_no_longer_loads_names_the_step(seeded):
    ring = SnapshotRing()

    def gone() -> dict[str, Any]:
        raise FileNotFoundError("/dev/shm/resilient-x/rank00000/slot0.bin")

    ring.adopt(3, gone)
    with pytest.raises(StateRestoreError, match="adopted snapshot of step 3 does not load"):
        ring.materialize(3)


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    ring = SnapshotRing()
    ring.capture(0, state)
    return ring.materialize(0)


def test_a_failed_copy_names_the_tracked_object_and_the_leaf() -> None:
    from resilient.errors import SnapshotError
    from resilient.state.registry import Registry

    class Uncopyable:
        def __deepcopy__(self, memo: object) -> object:
            raise RuntimeError("cannot copy me")

    ring = SnapshotRing()
    with pytest.raises(
        SnapshotError, match=r"tracked object 'model', leaf 'extra/0': RuntimeError: cannot copy me"
    ):
        ring.capture(3, {"model": {"w": torch.ones(2), "extra": [Uncopyable()]}})
    assert ring.steps() == []  # nothing half-written is kept

    class Broken(torch.nn.Linear):
        def state_dict(self, *a: object, **k: object) -> dict:  # type: ignore[override]
            raise ValueError("no state today")

    reg = Registry()
    reg.add("net", Broken(2, 2))
    with pytest.raises(
        SnapshotError, match=r"'net' \(Broken\): state_dict\(\) failed: ValueError: no state today"
    ):
        reg.capture()
