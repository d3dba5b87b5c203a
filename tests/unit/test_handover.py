"""A live resume across a hard fault (runtime/steps/handover.py): the step-start capture a rank
mirrors to shared memory reads back as it was; a replacement takes a survivor's live state only
where their posted fingerprints show the two were replicas, and loads it under its predecessor's
own buffers and hyperparameters. (The whole path, under ``resilient launch`` with a real SIGKILL:
tests/integration/test_replace.py.)"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.errors import SetupFailed, StateRestoreError
from resilient.runtime.coordination.agreement import RestorePlan, restore_plan
from resilient.runtime.keeping.resume import StoreCopy
from resilient.runtime.steps.handover import FromPeer, Handover
from resilient.runtime.steps.live import LiveResume, _Capture, _Kept, _Later
from resilient.runtime.steps.mirror import LiveMirror, Mirrored
from resilient.state.registry import RNG, Registry


def _rank_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Registry]:
    torch.manual_seed(0)  # (replicas start alike)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.manual_seed(seed)  # (their data differ: so do their BatchNorm statistics)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # (as a step leaves them; gradients pending are the rank's own)
    registry = Registry()
    registry.add("model", model)
    registry.add("optimizer", opt)
    registry.add("gen", torch.Generator().manual_seed(seed))
    return model, opt, registry


def _captured(registry: Registry, step: int = 6, seq: int = 11) -> LiveResume:
    live = LiveResume(True, 1 << 20)
    live.capture(step, registry, False, seq)
    return live


def test_the_mirrored_capture_reads_back_as_it_was_taken(tmp_path: Path) -> None:
    model, _, registry = _rank_state(1)
    live = _captured(registry)
    LiveMirror(tmp_path).write(live.cap, 3)
    got = LiveMirror(tmp_path).read()
    assert isinstance(got, Mirrored), got
    assert (got.step, got.seq, got.generation, got.pid) == (6, 11, 3, os.getpid())
    assert got.large == ["model", "optimizer"] and list(got.small) == ["gen"]
    assert torch.equal(got.buffers["model"]["1.running_mean"], model[1].running_mean)
    assert got.groups["optimizer"][0]["lr"] == 0.1
    assert torch.equal(got.rng["torch"], torch.get_rng_state()) and got.rng["python"] == random.getstate()
    assert torch.equal(got.small["gen"]["generator"], registry.capture()["gen"]["generator"])


def test_a_capture_that_is_not_enough_is_mirrored_with_the_reason(tmp_path: Path) -> None:
    mirror = LiveMirror(tmp_path)
    assert "left no live capture" in str(mirror.read())

    def cap(**kept: _Kept) -> _Capture:
        return _Capture(5, kept, {}, 0, 0, 0, None)

    mirror.write(cap(scaler=_Kept([], 0, state=_Later(dict))), 0)
    assert "device GradScaler" in str(mirror.read())
    model = torch.nn.Linear(2, 2)
    mirror.write(cap(model=_Kept([model.weight], 0, grads=frozenset({1}))), 0)
    assert "accumulated gradients" in str(mirror.read())
    mirror.write(_Capture(5, {}, {}, 0, 0, 0, "tracked object 'big' holds 9 tensor bytes"), 0)
    assert "'big'" in str(mirror.read())
    for path in mirror.paths:
        path.write_bytes(b"{not a capture\n")
    assert "does not parse" in str(mirror.read())


def test_a_write_torn_by_a_death_leaves_the_previous_capture(tmp_path: Path) -> None:
    # the two files are written in turn: a record cut short fails its checksum, the other is read
    _, _, registry = _rank_state(1)
    mirror = LiveMirror(tmp_path)
    mirror.write(_captured(registry, step=6).cap, 2)
    mirror.write(_captured(registry, step=7).cap, 2)
    got = LiveMirror(tmp_path).read()
    assert isinstance(got, Mirrored) and got.step == 7, got
    newest = mirror.paths[1]  # (the second write's)
    newest.write_bytes(newest.read_bytes()[:-9])
    got = LiveMirror(tmp_path).read()
    assert isinstance(got, Mirrored) and got.step == 6, got


def test_small_state_that_is_not_plain_values_goes_through_the_codec(tmp_path: Path) -> None:
    # a tracked object whose state holds tensors, arrays and an OrderedDict reads back equal
    import collections

    import numpy as np

    state = collections.OrderedDict(w=torch.arange(3.0), a=np.arange(4), n=(1, 2.5, None, "x"))

    class Holder:
        def state_dict(self) -> dict:
            return state

        def load_state_dict(self, sd: dict) -> None: ...

    registry = Registry()
    registry.add("holder", Holder())
    mirror = LiveMirror(tmp_path)
    mirror.write(_captured(registry).cap, 0)
    got = mirror.read()
    assert isinstance(got, Mirrored), got
    back = got.small["holder"]
    assert torch.equal(back["w"], state["w"]) and np.array_equal(back["a"], state["a"])
    assert back["n"] == (1, 2.5, None, "x") and list(back) == ["w", "a", "n"]


def _posting(store: dist.Store, rank: int, registry: Registry, max_bytes: int) -> StoreCopy:
    """Rank ``rank``'s store copy, its snapshots of steps 4 and 6 posted (``max_bytes``: 64
    posts the model's and the optimizer's fingerprints, 1 MiB their state)."""
    rep = StoreCopy(store, "t/replica", rank, max_bytes)
    for step in (4, 6):
        rep.publish(step, 2, registry.capture())
    return rep


def _survivor(store: dist.Store, registry: Registry, max_bytes: int = 64, since: int = 0) -> dict[str, Any]:
    """Rank 0's live offer (its state set at step ``since``)."""
    keep = Handover(0, LiveMirror(Path("/nonexistent")), _posting(store, 0, registry, max_bytes))
    keep.started(since)
    return keep.vouch(_captured(registry).offer("collective", registry), "collective", registry)


def _joining(store: dist.Store, dead: Registry, where: Path, max_bytes: int = 64) -> Handover:
    """Rank 1's replacement: its predecessor posted its snapshots, then ran a forward of its own
    batch (its BatchNorm statistics move), then mirrored its capture."""
    replica = _posting(store, 1, dead, max_bytes)
    model = dead.objects()[0]
    model(torch.randn(5, 3, generator=torch.Generator().manual_seed(9)))
    mirror = LiveMirror(where)
    mirror.write(_captured(dead).cap, 2)
    return Handover(1, mirror, replica)


def _plan(offers: list[Any]) -> RestorePlan:
    return RestorePlan.parse(
        restore_plan([json.dumps({"steps": [4], "layout": None, "live": o}) for o in offers])
    )


def test_a_replacement_takes_a_survivor_whose_posted_fingerprints_equal_its_predecessors(
    tmp_path: Path,
) -> None:
    for max_bytes in (64, 1 << 20):  # fingerprints posted, or the state itself
        _, _, survivor = _rank_state(1)
        dead_model, _, dead = _rank_state(1)  # a replica (the same updates)
        store = dist.HashStore()
        offer = _survivor(store, survivor, max_bytes)
        joining = _joining(store, dead, tmp_path, max_bytes)
        joined = joining.replacement_offer(2, os.getpid())
        assert set(joined["mirrored"]["prints"]) == {"4", "6"}, joined
        plan = _plan([offer, joined])
        assert plan.live == 6 and plan.live_donors == {"1": 0}, plan
    # what the replacement loads: the donor's model and optimizer under its own buffers, its RNG
    state = joining.replacement_state(0)
    assert isinstance(state["model"], FromPeer) and state["model"].donor == 0
    donor = _captured(survivor).state(survivor)
    model = state["model"].under_own(donor["model"])
    assert torch.equal(model["1.running_mean"], dead_model[1].running_mean)
    assert not torch.equal(model["1.running_mean"], donor["model"]["1.running_mean"])
    assert torch.equal(model["0.weight"], donor["model"]["0.weight"])
    assert state["optimizer"].under_own(donor["optimizer"])["param_groups"][0]["lr"] == 0.1
    assert torch.equal(state[RNG]["torch"], torch.get_rng_state()) and joining.since == 6


def test_no_donor_where_the_copies_are_not_shown_to_be_replicas(tmp_path: Path) -> None:
    _, _, survivor = _rank_state(1)
    _, _, other = _rank_state(2)  # trained on other data, no all-reduce: not a replica
    for dead, since in [(other, 0), (survivor, 6)]:  # (equal, but only since its state was set at 6)
        store = dist.HashStore()
        offer = _survivor(store, survivor, since=since)
        joining = _joining(store, dead, tmp_path)
        plan = _plan([offer, joining.replacement_offer(2, None)])
        assert plan.live is None and "not a replica" in plan.live_refused["1"], plan
    # a capture of another generation, or by another process, is not the predecessor's last
    assert "generation 2, not 3" in joining.replacement_offer(3, None)["why"]
    assert "not 1" in joining.replacement_offer(2, 1)["why"]


def _post(steps: list[int], live: dict[str, Any]) -> str:
    return json.dumps({"steps": steps, "live": live})


def test_a_replacement_from_another_node_takes_the_ring_step_from_a_survivor_shown_equal() -> None:
    # rank 1's node was lost: its replacement holds nothing but its predecessor's store copies
    # (steps 7 and 8, the model's fingerprint posted for each); rank 0 survived with steps 8, 7
    # in its ring and posted the same fingerprint of step 8 after its state was last set (0)
    stored = {"7": {"model": "f7"}, "8": {"model": "f8"}}
    lost = {"why": "a replacement: no capture", "replacement": True, "stored": stored}
    survivor = {"why": "refused", "vouch": {"since": 0, "prints": {"8": {"model": "f8", "optimizer": "o8"}}}}
    plan = RestorePlan.parse(restore_plan([_post([8, 7], survivor), _post([8, 7], lost)]))
    assert plan.live is None and plan.restore_step() == 8
    assert plan.ring_donors == {"1": 0} and plan.ring_refused is None
    # a survivor whose copy differs (not a replica: a sharded state) is no donor: the ranks fall
    # back (the launcher restarts the group from the checkpoint), saying why
    other = {"why": "refused", "vouch": {"since": 0, "prints": {"8": {"model": "zz"}}}}
    plan = RestorePlan.parse(restore_plan([_post([8, 7], other), _post([8, 7], lost)]))
    assert plan.ring_donors is None and "no replica holds its state" in str(plan.ring_refused)
    with pytest.raises(StateRestoreError, match="not restorable from memory"):
        plan.restore_step()
    # nor is one whose state was set from elsewhere after that step
    late = {"why": "refused", "vouch": {"since": 8, "prints": {"8": {"model": "f8"}}}}
    plan = RestorePlan.parse(restore_plan([_post([8, 7], late), _post([8, 7], lost)]))
    assert plan.ring_refused is not None


def test_a_replacement_from_another_node_with_no_store_copy_falls_back_not_fatal() -> None:
    # nothing of the lost rank survived (the store copy is off): not "failed before its first
    # step" (a verdict that ends the job) but a restore the group restart takes from disk
    bare = {"why": "a replacement: no capture", "replacement": True}
    plan = RestorePlan.parse(restore_plan([_post([8, 7], {"why": "refused"}), _post([], bare)]))
    assert plan.empty == []
    with pytest.raises(StateRestoreError, match="holds no state"):
        plan.restore_step()
    # a rank that is no replacement and holds nothing did fail before its first step
    plan = RestorePlan.parse(restore_plan([_post([8, 7], {"why": "refused"}), _post([], {"why": "x"})]))
    with pytest.raises(SetupFailed):
        plan.restore_step()


def test_a_replacement_state_from_the_store_copy_comes_from_its_donor_for_the_rest() -> None:
    h = Handover(1)
    h.stored = {8: ({"data": {"pos": 3}, RNG: {"torch": None}}, {"model": "f8"})}
    state = h.stored_state(8, donor=0)
    assert state["data"] == {"pos": 3} and RNG in state
    assert isinstance(state["model"], FromPeer) and state["model"].donor == 0
    assert h.since == 8 and h.stored_steps() == [8]
