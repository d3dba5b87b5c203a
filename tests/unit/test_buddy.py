"""The buddy copy (resilient/runtime/keeping/buddy.py) on a real TCPStore, real sockets and real
shared-memory slots (under a temporary directory): a rank's mirrored snapshot reaches the rank
on the next node, is read back whole and vouched for by the fingerprints its owner posted; a
copy that does not match is never returned; a replica sends nothing; and the recovery barrier's
plan takes a step a buddy holds when no replica vouches for a lost rank's state."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.checkpoint.shm import ShmSnapshot
from resilient.errors import StateRestoreError
from resilient.runtime.coordination.agreement import RestorePlan, restore_plan
from resilient.runtime.keeping import buddy as buddy_mod
from resilient.runtime.keeping.buddy import Buddy, buddy_of
from resilient.runtime.keeping.resume import StoreCopy
from resilient.runtime.recovery.recovery import loaded_everywhere

RUN = "run"


@pytest.fixture
def store() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield server


def _client(server: Any) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10))


class _Rank:
    """One rank of a 2-node job of one rank each: its mirror, its store copy, its buddy."""

    def __init__(self, server: Any, base: Path, rank: int, world: int = 2) -> None:
        self.rank = rank
        node = base / f"node{rank}"
        node.mkdir()
        self.shm = ShmSnapshot("job", 0, base=node)
        self.copy = StoreCopy(_client(server), f"resilient/{RUN}/store_copy", rank, 64)
        side = _client(server)
        copies = StoreCopy(side, self.copy.prefix, rank, 64)
        self.buddy = Buddy(self.shm, rank, world, 1, side, RUN, copies, "127.0.0.1")

    def mirror(self, step: int, state: dict[str, Any]) -> None:
        """What BuiltinKeeper.mirror does: the slot, the store copy, then the send."""
        self.shm.capture(step, state, checksum=False, owner=(self.rank, 2))
        self.copy.publish(step, 2, state)
        self.buddy.send(step)
        assert self.buddy.settled(30.0)

    def close(self) -> None:
        self.buddy.close()


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "data": {"position": seed},
    }


@pytest.fixture
def ranks(store: Any, tmp_path: Path) -> Any:
    made = [_Rank(store, tmp_path, 0), _Rank(store, tmp_path, 1)]
    yield made
    for r in made:
        r.close()


def test_the_buddy_is_the_same_local_rank_on_the_next_node() -> None:
    assert buddy_of(0, 4, 2) == 2 and buddy_of(3, 4, 2) == 1
    assert buddy_of(1, 2, 1) == 0
    assert buddy_of(0, 2, 2) is None  # one node: nothing survives its loss in memory


def test_a_shard_reaches_the_buddy_and_comes_back_vouched_for(ranks: list[_Rank], store: Any) -> None:
    r0, r1 = ranks
    r0.mirror(3, _state(0))
    r1.mirror(3, _state(1))  # (a shard: not what rank 0 holds)
    r1.mirror(4, _state(2))
    assert r1.buddy.sent == 2 and r1.buddy.replica is False
    assert r0.buddy.held() == {"1": [4, 3]}  # (both kept, newest first: ranks may agree on the older)
    prints = r1.copy.read(1, 4)[1]  # type: ignore[index]
    assert set(prints) == {"model"}  # (the data position fits the store copy)
    at = buddy_mod.address(_client(store), buddy_mod.prefix(RUN), 0)
    got = buddy_mod.fetch(at, 1, 4, prints)
    assert torch.equal(got["model"]["w"], _state(2)["model"]["w"])
    with pytest.raises(StateRestoreError, match="'model' does not match the fingerprint"):
        buddy_mod.fetch(at, 1, 3, prints)  # (step 3's copy against step 4's fingerprints)
    with pytest.raises(StateRestoreError, match="holds no copy of rank 1's step 9"):
        buddy_mod.fetch(at, 1, 9, prints)


def test_a_copy_changed_in_the_holders_memory_is_never_returned(ranks: list[_Rank], store: Any) -> None:
    r0, r1 = ranks
    r0.mirror(3, _state(0))
    r1.mirror(3, _state(1))
    held = next((r0.shm.top / "buddy").glob("rank*"))
    slot = next(p for p in held.glob("slot*.json") if json.loads(p.read_text())["step"] == 3)
    raw = bytearray(slot.with_suffix(".bin").read_bytes())
    raw[5] ^= 0x10  # a flipped bit in the holder's copy
    slot.with_suffix(".bin").write_bytes(bytes(raw))
    at = buddy_mod.address(_client(store), buddy_mod.prefix(RUN), 0)
    with pytest.raises(StateRestoreError, match="checksum mismatch"):
        buddy_mod.fetch(at, 1, 3, r1.copy.read(1, 3)[1])  # type: ignore[index]


def test_a_replica_sends_nothing_and_a_roll_back_drops_later_copies(ranks: list[_Rank]) -> None:
    r0, r1 = ranks
    r0.mirror(3, _state(7))
    r1.mirror(3, _state(7))  # equal state (data-parallel): the buddy holds it already
    assert r1.buddy.replica is True and r1.buddy.sent == 0
    assert "1" not in r0.buddy.held()
    r0.mirror(4, _state(8))
    r0.mirror(5, _state(9))  # (rank 1's buddy is rank 0: rank 1 now holds two copies of rank 0's)
    assert r1.buddy.held() == {"0": [5, 4]}
    r1.buddy.drop_after(4)
    assert r1.buddy.held() == {"0": [4]}


def _offers(buddy_holds: list[int]) -> list[Any]:
    prints = {"model": "f"}
    survivor = {"why": "a peer died", "vouch": {"since": 0, "prints": {}}, "buddy": {"1": buddy_holds}}
    replacement = {"why": "a replacement", "replacement": True, "stored": {"7": prints, "8": prints}}
    return [survivor, replacement]


def _plan(buddy_holds: list[int]) -> RestorePlan:
    payloads = [json.dumps({"steps": [8, 7], "live": o}) for o in _offers(buddy_holds)]
    return RestorePlan.parse(restore_plan(payloads))


def test_the_plan_takes_the_newest_step_a_buddy_holds_for_a_lost_shard() -> None:
    plan = _plan([7])  # (step 8's copy was still on its way)
    assert plan.snapshot_step() == 7 and plan.ring_buddies == {"1": 0} and not plan.ring_refused
    assert _plan([7, 8]).snapshot_step() == 8
    refused = _plan([])
    why = (refused.ring_refused or {}).get("1", "")
    assert "no replica holds its state; nor its buddy copy" in why
    with pytest.raises(StateRestoreError, match="not restorable from memory"):
        refused.snapshot_step()


def test_a_mirror_waits_for_a_slow_link_only_as_long_as_allowed(
    ranks: list[_Rank], store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buddy that stops reading (a congested link): the next capture waits for the newest copy,
    at most WAIT_S, and the wait is counted; the copy never completes, so none is described."""
    monkeypatch.setattr(buddy_mod, "WAIT_S", 0.5)
    _, r1 = ranks
    stalled = socket.create_server(("127.0.0.1", 0))  # accepts, never reads
    _client(store).set(f"{buddy_mod.prefix(RUN)}/addr/0", f"127.0.0.1:{stalled.getsockname()[1]}")
    big = {"model": {"w": torch.randn(4096, 1024)}, "data": {"position": 1}}  # 16 MB: past the buffers
    r1.shm.capture(3, big, checksum=False, owner=(1, 2))
    r1.copy.publish(3, 2, big)
    r1.buddy.replica = False
    r1.buddy.send(3)
    try:
        r1.buddy.before_capture(3)
        assert 0.5 <= r1.buddy.waited_s < 5.0 and r1.buddy.acked == -1
        waited = r1.buddy.waited_s
        r1.buddy.before_capture(3)  # the same stalled send: not waited for a second time
        assert r1.buddy.waited_s - waited < 0.2
    finally:
        stalled.close()


def test_a_buddy_copy_that_does_not_load_makes_every_rank_fall_back_together() -> None:
    votes: list[bool] = []

    def fall_back(e: StateRestoreError) -> BaseException:
        return RuntimeError(f"group restart: {e}")

    def failing() -> Any:
        raise StateRestoreError("'model' does not match the fingerprint its rank posted")

    with_buddies = RestorePlan(step=7, ring_buddies={"1": 0})
    # the new rank whose copy did not match: it says so, then falls back with its own reason
    with pytest.raises(RuntimeError, match="group restart: 'model' does not match"):
        loaded_everywhere(failing, with_buddies, lambda ok: votes.append(ok) or False, fall_back)
    # a survivor that loaded its own snapshot hears it and falls back with it
    with pytest.raises(RuntimeError, match="buddy copy did not load"):
        loaded_everywhere(lambda: "pending", with_buddies, lambda ok: votes.append(ok) or False, fall_back)
    assert votes == [False, True]
    assert loaded_everywhere(lambda: "ok", with_buddies, lambda ok: True, fall_back) == "ok"
    # no buddy copy in the plan: no vote at all (a recovery pays nothing for the feature)
    assert loaded_everywhere(lambda: "ok", RestorePlan(step=7), lambda ok: 1 / 0 > 0, fall_back) == "ok"
