"""Restoring after a relaunch: packing state for peers, the store copy, labelled shm slots."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from chaos.compare import assert_bit_exact
from resilient.checkpoint import flushed
from resilient.checkpoint.shm import ShmSnapshot
from resilient.errors import CheckpointError
from resilient.runtime.keeping import resume
from resilient.state.digest import leaf_sums


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(33, 7, generator=g), "b": torch.zeros(3, dtype=torch.float16)},
        "data": {"gen": g.get_state(), "position": seed, "order": (1, 2.5, "x")},
        "__rng__": {"numpy": np.arange(5, dtype=np.uint32), "flag": True},
    }


def test_pack_unpack_round_trips_bit_exact() -> None:
    s = _state(1)
    header, buf = resume.pack(s)
    assert_bit_exact(s, resume.unpack(header, buf))
    assert_bit_exact(s, resume.unpack(header, buf.numpy().tobytes()))


def test_equal_state_has_equal_fingerprint_and_unequal_differs(tmp_path: Path) -> None:
    a, b = _state(1), _state(1)
    assert resume.fingerprint(a["model"]) == resume.fingerprint(b["model"])
    b["model"]["w"].view(torch.int32)[0, 0] ^= 1 << 30  # one flipped bit
    assert resume.fingerprint(a["model"]) != resume.fingerprint(b["model"])
    assert resume.fingerprint(a["data"]) != resume.fingerprint(_state(2)["data"])
    b = _state(1)
    b["data"]["position"] += 1  # not a tensor: the skeleton counts too
    assert resume.fingerprint(a["data"]) != resume.fingerprint(b["data"])
    # live state and its shared-memory copy (loaded, or mapped) have one fingerprint
    live = {"model": torch.nn.Linear(5, 3).state_dict()}
    shm = ShmSnapshot("job", 0, base=tmp_path)
    shm.capture(3, live, checksum=False, owner=(0, 2))
    for mapped in (False, True):
        got = shm.load(3, mapped=mapped)
        assert got is not None
        assert resume.fingerprint(got[1]["model"]) == resume.fingerprint(live["model"])
    shm.close()


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


def test_store_replica_keeps_small_objects_and_the_two_newest_steps(store: dist.Store) -> None:
    rep = resume.StoreCopy(store, "job/replica", rank=3, max_bytes=2048)
    for step in (4, 5, 6):
        rep.publish(step, world=8, state=_state(step))
    # the 33x7 float32 weights (924 bytes) and the 5 KB generator state do not both fit in 2 KiB
    names, tree = rep.fetch(3, 6)
    assert "model" in names and "data" not in names and "__rng__" in names
    assert_bit_exact(_state(6)["model"], tree["model"])
    # what did not fit is named by its fingerprint, for a peer's equal copy to stand in for it
    assert rep.fingerprints(3, 6) == {"data": resume.fingerprint(_state(6)["data"])}
    assert rep.fetch(3, 4) is None and rep.fetch(3, 5) is not None  # the oldest was deleted
    assert rep.fetch(2, 6) is None  # another rank's: never posted


def test_replica_off_posts_nothing(store: dist.Store) -> None:
    rep = resume.StoreCopy(store, "job/replica", rank=0, max_bytes=0)
    rep.publish(1, world=2, state=_state(1))
    assert rep.fetch(0, 1) is None


def test_a_roll_back_drops_the_mirrors_of_later_steps(tmp_path: Path, store: dist.Store) -> None:
    # a replica that passed its neighbour's comparison may hold what a corrupt peer's gradients
    # made of it: after a roll-back to step 7, its step-8 mirror must neither be restored nor
    # stand in for the replay's (a capture of the same step is skipped while it is held)
    shm = ShmSnapshot("job", 0, base=tmp_path)
    shm.capture(7, _state(7), checksum=False, owner=(0, 2))
    shm.capture(8, _state(99), checksum=False, owner=(0, 2))
    assert shm.drop_after(7) == [8]
    assert shm.steps() == [7] and not shm.holds(8, 0, 2)
    got = shm.load()
    assert got is not None and got[0] == 7
    assert_bit_exact(_state(7), got[1])
    shm.capture(8, _state(8), checksum=False, owner=(0, 2))  # the replay's
    loaded = shm.load(8)
    assert loaded is not None
    assert_bit_exact(_state(8), loaded[1])
    rep = resume.StoreCopy(store, "job/replica", rank=0, max_bytes=1 << 16)
    for step in (7, 8):
        rep.publish(step, world=2, state=_state(step))
    rep.drop_after(7)
    assert rep.fetch(0, 8) is None and rep.fetch(0, 7) is not None


@pytest.mark.parametrize("mapped", [False, True])
def test_a_mirror_slot_is_verified_against_the_sums_taken_at_capture(tmp_path: Path, mapped: bool) -> None:
    # the runtime's mirror carries no checksum of its bytes (too dear per capture) but the byte
    # sums the replica digests already took: a slot that changed since is never loaded
    from resilient.state.digest import leaf_sums

    shm = ShmSnapshot("job", 0, base=tmp_path)
    state = _state(3)
    shm.capture(5, state, checksum=False, owner=(0, 2), sums=leaf_sums(state))
    got = shm.load(5, mapped=mapped)
    assert got is not None
    assert_bit_exact(state, got[1])
    meta = json.loads((shm.dir / "slot0.json").read_text())
    _key, _, _, offset, _ = next(e for e in meta["layout"] if e[0] == "/model/w")
    with open(shm.dir / "slot0.bin", "r+b") as f:  # one flipped bit in one weight
        f.seek(offset + 4)
        byte = f.read(1)[0]
        f.seek(offset + 4)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(CheckpointError, match="leaf '/model/w' of the snapshot of step 5"):
        shm.load(5, mapped=mapped)


def test_shm_slots_carry_the_writing_rank_and_world(tmp_path: Path) -> None:
    shm = ShmSnapshot("job", 1, base=tmp_path)  # directory of local rank 1
    shm.capture(7, _state(7), checksum=False, owner=(5, 8))
    shm.capture(8, _state(8), checksum=False, owner=(5, 8))
    held = [
        {"step": 8, "rank": 5, "world": 8, "sharded": False},
        {"step": 7, "rank": 5, "world": 8, "sharded": False},
    ]
    assert shm.slots() == held
    assert shm.holds(8, 5, 8) and not shm.holds(8, 1, 8) and not shm.holds(8, 5, 4)
    shm.close()


def _run_ranks(world: int, fn) -> list:
    """``fn(rank, exchange)`` on ``world`` threads sharing one HashStore (a small all-gather)."""
    store = dist.HashStore()
    out: list = [None] * world
    errors: list = []

    def exchange_for(rank: int):
        def exchange(name: str, payload: str) -> list[str]:
            store.set(f"{name}/{rank}", payload)
            store.wait([f"{name}/{r}" for r in range(world)])
            return [store.get(f"{name}/{r}").decode() for r in range(world)]

        return exchange

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, exchange_for(rank), store)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_every_rank_holding_its_own_slot_restores_locally(tmp_path: Path) -> None:
    names = ["model", "data", "__rng__"]
    for r in range(2):
        ShmSnapshot("job", r, base=tmp_path).capture(6, _state(10 + r), checksum=False, owner=(r, 2))

    def fn(rank, exchange, store):
        shm = ShmSnapshot("job", rank, base=tmp_path)
        return resume.restore(shm=shm, rank=rank, world=2, names=names, exchange=exchange, store_copy=None,
                              newest_checkpoint=-1)  # fmt: skip

    got = _run_ranks(2, fn)
    assert [g.source for g in got] == ["shm", "shm"] and [g.step for g in got] == [6, 6]
    for r in range(2):
        assert_bit_exact(_state(10 + r), got[r].state)


def test_a_newer_checkpoint_wins_over_older_snapshots(tmp_path: Path) -> None:
    ShmSnapshot("job", 0, base=tmp_path).capture(6, _state(1), checksum=False, owner=(0, 1))

    def fn(rank, exchange, store):
        shm = ShmSnapshot("job", rank, base=tmp_path)
        return resume.restore(shm=shm, rank=0, world=1, names=["model"], exchange=exchange, store_copy=None,
                              newest_checkpoint=8)  # fmt: skip

    assert _run_ranks(1, fn) == [None]


def test_a_lost_rank_without_a_replica_or_verifiable_copy_falls_back(tmp_path: Path) -> None:
    # one survivor holds the large object: nobody can vouch that the lost rank's copy was equal
    ShmSnapshot("job", 0, base=tmp_path).capture(6, _state(1), checksum=False, owner=(0, 2))
    names = ["model", "data", "__rng__"]

    def fn(rank, exchange, store):
        shm = ShmSnapshot("job", rank, base=tmp_path / f"n{rank}")
        if rank == 0:
            shm = ShmSnapshot("job", 0, base=tmp_path)
        rep = resume.StoreCopy(store, "r", rank, max_bytes=64)
        return resume.restore(shm=shm, rank=rank, world=2, names=names, exchange=exchange, store_copy=rep,
                              newest_checkpoint=-1)  # fmt: skip

    assert _run_ranks(2, fn) == [None, None]


@pytest.mark.parametrize("equal", [True, False])
def test_a_lost_rank_takes_large_objects_from_a_survivor_with_its_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, equal: bool
) -> None:
    # 2 ranks, rank 1's node lost: one survivor holds the model. Rank 1 posted its small objects
    # and the fingerprint of its model: the survivor's copy stands in for it only if they match.
    mine = _state(1)
    ShmSnapshot("job", 0, base=tmp_path / "n0").capture(6, mine, checksum=False, owner=(0, 2))
    lost = _state(1) if equal else _state(2)
    names = ["model", "data", "__rng__"]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # (the plan only: nothing is sent)
    plans: list = [None, None]

    def fn(rank, exchange, store):
        rep = resume.StoreCopy(store, "r", rank, max_bytes=2048)
        if rank == 1:
            rep.publish(6, world=2, state=lost)  # before its node went
        exchange("posted", "")
        shm = ShmSnapshot("job", rank, base=tmp_path / f"n{rank}")
        how = resume._Resume(shm, rank, 2, names, exchange, rep)
        held = [json.loads(v) for v in exchange("slots", json.dumps(how.shm.slots()))]
        plans[rank] = how._plan(6, 2, held, [[], []])

    _run_ranks(2, fn)
    if not equal:
        assert plans == [None, None]
        return
    for p in plans:
        assert p.owners == {0: 0} and p.store_copy == {1: ["__rng__", "model"]}
        assert p.donated == {"data": {1: 0}}  # (the 5 KB generator state did not fit in 2 KiB)
        assert p.prints == {1: {"data": resume.fingerprint(lost["data"])}}


def test_dtensor_shards_of_another_world_size_go_to_the_checkpoint(tmp_path: Path) -> None:
    # 4 old ranks' FSDP shards, 2 ranks now: memory holds the wrong cut of every tensor
    layout = {"mesh": {"device_type": "cpu", "shape": [4], "ranks": [0, 1, 2, 3], "dims": None},
              "placements": [["shard", 0]], "shape": [8, 2], "stride": [2, 1]}  # fmt: skip
    for r in range(2):
        state = {**_state(r), "model": {"w": {"__dtensor__": layout, "local": torch.ones(2, 2) * r}}}
        ShmSnapshot("job", r, base=tmp_path).capture(6, state, checksum=False, owner=(r, 4))
    assert ShmSnapshot("job", 0, base=tmp_path).slots()[0]["sharded"] is True

    def fn(rank, exchange, store):
        shm = ShmSnapshot("job", rank, base=tmp_path)
        return resume.restore(shm=shm, rank=rank, world=2, names=["model", "data", "__rng__"],
                              exchange=exchange, store_copy=None, newest_checkpoint=-1)  # fmt: skip

    assert _run_ranks(2, fn) == [None, None]


def test_a_mapped_load_copies_nothing_and_keeps_the_slot_intact(tmp_path: Path) -> None:
    # a replacement restores from its predecessor's slot with views of a private mapping: a module
    # copies them as it loads, an optimizer gets copies (Registry.load owned=False): one copy in all
    from resilient.state.registry import Registry

    shm = ShmSnapshot("job", 0, base=tmp_path)
    model, other = torch.nn.Linear(33, 7), torch.nn.Linear(33, 7)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 33)).sum().backward()
    opt.step()
    shm.capture(5, {"model": model.state_dict(), "opt": opt.state_dict()}, checksum=True)
    step, view = shm.load(5, mapped=True)
    assert step == 5
    copy = shm.load(5)[1]
    assert_bit_exact(copy, view)
    reg = Registry()
    opt2 = torch.optim.Adam(other.parameters())
    reg.add("model", other)
    reg.add("opt", opt2)
    reg.load("model", view["model"], owned=False)
    reg.load("opt", view["opt"], owned=False)
    assert_bit_exact(copy["model"], other.state_dict())
    moment = opt2.state[other.weight]["exp_avg"]
    assert moment.data_ptr() != view["opt"]["state"][0]["exp_avg"].data_ptr()  # the optimizer's own
    moment.add_(1.0)
    view["model"]["weight"].add_(1.0)  # the views are copy-on-write: the slot does not change
    assert_bit_exact(copy, shm.load(5)[1])
    # an optimizer that already holds state of the same shapes (a warm-up step, states initialised
    # for loading) gets the snapshot copied into its own tensors: no new memory
    warm = torch.nn.Linear(33, 7)
    opt3 = torch.optim.Adam(warm.parameters())
    warm(torch.randn(2, 33)).sum().backward()
    opt3.step()
    before = opt3.state[warm.weight]["exp_avg_sq"].data_ptr()
    reg.add("opt3", opt3)
    reg.load("opt3", shm.load(5, mapped=True)[1]["opt"], owned=False)
    assert opt3.state[warm.weight]["exp_avg_sq"].data_ptr() == before
    assert_bit_exact(copy["opt"], opt3.state_dict())


def _flush_ranks(tmp_path: Path, world: int, step: int) -> Path:
    """Each rank's snapshot of ``step`` in a node's shared memory, flushed by its agent to disk."""
    top = tmp_path / "ck" / flushed.FLUSHED
    for r in range(world):
        shm = ShmSnapshot("job", r, base=tmp_path / f"node{r}")
        shm.capture(step, _state(20 + r), checksum=False, owner=(r, world), sums=leaf_sums(_state(20 + r)))
        got = flushed.flush(shm.dir, top)
        assert got is not None and got.steps == (step,) and got.rank == r
        shm.unlink()  # the node is gone with its memory
    return top


def test_a_rank_no_node_holds_comes_back_from_its_flushed_snapshot(tmp_path: Path) -> None:
    # rank 0's node holds its own snapshot; rank 1's node is gone, its agent flushed it first
    top = _flush_ranks(tmp_path, 2, 6)
    ShmSnapshot("job", 0, base=tmp_path / "n0").capture(6, _state(20), checksum=False, owner=(0, 2))
    names = ["model", "data", "__rng__"]

    def fn(rank, exchange, store):
        shm = ShmSnapshot("job", rank, base=tmp_path / f"n{rank}")
        disk = functools.partial(flushed.copy_of, top)
        return resume.restore(shm=shm, rank=rank, world=2, names=names, exchange=exchange, store_copy=None,
                              newest_checkpoint=4, flushed=disk)  # fmt: skip

    got = _run_ranks(2, fn)
    assert [g.step for g in got] == [6, 6] and [g.source for g in got] == ["flushed", "flushed"]
    assert set(got[0].sources.values()) == {"shm"} and set(got[1].sources.values()) == {"flushed"}
    for r in range(2):
        assert_bit_exact(_state(20 + r), got[r].state)


def test_a_requeued_job_resumes_from_every_ranks_flushed_snapshot_unless_a_checkpoint_is_newer(
    tmp_path: Path,
) -> None:
    top = _flush_ranks(tmp_path, 2, 6)

    def fn(newest: int):
        def run(rank, exchange, store):
            shm = ShmSnapshot("job", rank, base=tmp_path / f"fresh{rank}")  # (a new launch: nothing held)
            return resume.restore(shm=shm, rank=rank, world=2, names=["model", "data", "__rng__"],
                                  exchange=exchange, store_copy=None, newest_checkpoint=newest,
                                  flushed=functools.partial(flushed.copy_of, top))  # fmt: skip

        return run

    got = _run_ranks(2, fn(6))
    assert [g.source for g in got] == ["flushed", "flushed"] and [g.step for g in got] == [6, 6]
    assert_bit_exact(_state(21), got[1].state)
    assert _run_ranks(2, fn(7)) == [None, None]  # a newer checkpoint: the disk's own path
    assert flushed.prune(top, 7) == [0, 1] and not list(top.iterdir())


def test_a_flushed_copy_is_never_one_the_writer_was_rewriting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the replacement mirrors its first snapshot into the same slot while the agent copies it: the
    # copy whose description changed meanwhile is dropped, the other slot's is kept
    shm = ShmSnapshot("job", 0, base=tmp_path)
    shm.capture(5, _state(5), checksum=False, owner=(0, 2), sums=leaf_sums(_state(5)))
    shm.capture(6, _state(6), checksum=False, owner=(0, 2), sums=leaf_sums(_state(6)))
    real = flushed._copy

    def copy_while_rewritten(src: Path, dst: Path, size: int, durable: bool) -> bool:
        ok = real(src, dst, size, durable)
        if src.name == "slot0.bin":  # (step 5's slot: the older, the one a capture overwrites)
            shm.capture(7, _state(7), checksum=False, owner=(0, 2), sums=leaf_sums(_state(7)))
        return ok

    monkeypatch.setattr(flushed, "_copy", copy_while_rewritten)
    got = flushed.flush(shm.dir, tmp_path / "out")
    assert got is not None and got.steps == (6,)
    step, state = flushed.copy_of(tmp_path / "out", 0).load()  # type: ignore[misc]
    assert step == 6
    assert_bit_exact(_state(6), state)
