"""Silent data corruption: exact digests (any flipped bit changes them), the replica groups they
are compared in, the comparison riding the collective count, the attribution of the corrupt
replica, and snapshots verified against their sums before they are restored."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from chaos.faults.bitflip import Bitflip, flip_bit
from chaos.inject import Fault
from resilient.contract import mark_replace, take_replace
from resilient.detectors import collectives as fingerprint
from resilient.detectors.collectives import CollectiveCount
from resilient.detectors.replicas import CorruptReplica, ReplicaCheck, SdcConfig, SilentCorruption
from resilient.runtime.faults.records import Severity, classify
from resilient.state import SnapshotRing
from resilient.state import digest as dg
from resilient.state.snapshot import CorruptSnapshot

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64,
]  # fmt: skip


def _tensor(dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_every_flipped_bit_changes_the_sum(dtype: torch.dtype, n: int) -> None:
    t = _tensor(dtype, n)
    (before,) = dg.tensor_sums([t])
    words = t.view(torch.uint8)
    for byte in range(words.numel()):
        for bit in range(8):
            flipped = words.clone()
            flipped[byte] ^= 1 << bit
            (after,) = dg.tensor_sums([flipped.view(dtype)])
            assert after != before, (byte, bit)


def test_equal_tensors_have_equal_digests_in_any_layout() -> None:
    a = torch.randn(6, 4)
    b = a.clone().t().contiguous().t()  # the same values, another memory layout
    sums_a = dg.leaf_sums({"m": {"w": a, "s": torch.tensor(3)}})
    sums_b = dg.leaf_sums({"m": {"s": torch.tensor(3), "w": b}})
    assert sums_a == sums_b
    assert dg.digest(sums_a.items()) == dg.digest(reversed(list(sums_b.items())))
    flip_bit(b, 5)
    assert dg.digest(dg.leaf_sums({"m": {"w": b, "s": torch.tensor(3)}}).items()) != dg.digest(sums_a.items())


def test_flip_bit_doubles_or_halves_a_float_weight() -> None:
    t = torch.tensor([0.75, 1.0])
    flip_bit(t)
    assert t[0].item() in (1.5, 0.375) and t[1].item() == 1.0
    i = torch.tensor([5], dtype=torch.int64)
    flip_bit(i, bit=63)  # (the sign bit of a signed view)
    assert i.item() == 5 - 2**63


# -- replica groups ------------------------------------------------------------------------------------
def _spec(placements: list[list[Any]], shape: list[int]) -> dict[str, Any]:
    n = 1
    for s in shape:
        n *= s
    return {"mesh": {"shape": shape, "ranks": list(range(n))}, "placements": placements}


def test_dtensor_replica_groups_on_a_2d_mesh() -> None:
    # HSDP on a (replicate=2, shard=3) mesh: ranks r*3 + s; replicas share the shard coordinate
    hsdp = _spec([["replicate"], ["shard", 0]], [2, 3])
    assert dg.dtensor_group(hsdp, 1) == (1, 4) and dg.dtensor_group(hsdp, 5) == (2, 5)
    # a tensor-parallel parameter replicated on the tp dim of a (dp=2, tp=3) mesh, sharded over dp
    tp = _spec([["shard", 0], ["replicate"]], [2, 3])
    assert dg.dtensor_group(tp, 4) == (3, 4, 5)
    assert dg.dtensor_group(_spec([["replicate"], ["replicate"]], [2, 3]), 2) == (0, 1, 2, 3, 4, 5)
    # sharded (or partial) on every dim: no replica (1-D FSDP: not covered)
    assert dg.dtensor_group(_spec([["shard", 0], ["partial", "sum"]], [2, 3]), 4) == (4,)
    assert dg.dtensor_group(_spec([["shard", 0]], [6]), 2) == (2,)


def _fake_ddp(module: nn.Module) -> DistributedDataParallel:
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = module
    return ddp


def test_replicated_leaves_are_ddp_parameters_their_optimizer_and_dtensor_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dg, "_ddp_group", lambda ddp, world: (0, 1, 2))
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    ddp = _fake_ddp(model)
    opt = torch.optim.Adam(ddp.parameters())
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
    other = torch.optim.SGD([nn.Parameter(torch.ones(1))])  # not a tracked DDP's: per rank
    hsdp = {"__dtensor__": _spec([["replicate"], ["shard", 0]], [2, 3]), "local": torch.ones(2)}
    objects = {"model": ddp, "opt": opt, "other": other, "fsdp": nn.Linear(1, 1)}
    state = {"model": ddp.state_dict(), "opt": opt.state_dict(), "other": other.state_dict(),
             "fsdp": {"w": hsdp, "buf": torch.ones(1)}}  # fmt: skip
    sets = dg.replica_sets(state, objects, rank=1, world=3)
    assert sorted(sets) == [(0, 1, 2), (1, 4)]
    ddp_paths = sets[(0, 1, 2)]
    assert "/model/module.0.weight" in ddp_paths and "/model/module.1.weight" in ddp_paths
    assert not any("running" in p for p in ddp_paths)  # BatchNorm's statistics: per rank
    assert "/opt/state/0/exp_avg" in ddp_paths and "/opt/state/0/step" in ddp_paths
    assert sets[(1, 4)] == ["/fsdp/w/local"]
    assert dg.next_member((0, 1, 2), 2) == 0 and dg.next_member((1, 4), 1) == 4


# -- the comparison, riding the collective count -----------------------------------------------------
@pytest.fixture
def seq(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint, "issued_on_default_group", lambda: 0)


def _close_all(
    counts: list[CollectiveCount], digests: list[dict[Any, str]], step: int
) -> list[BaseException | None]:
    for c, d in zip(counts, digests, strict=True):
        c.begin(step)
        c.close_window(step, d)
    errors: list[BaseException | None] = []
    for c in counts:
        try:
            c.settle(block=False)
            errors.append(None)
        except SilentCorruption as e:
            errors.append(e)
    return errors


def test_equal_digests_pass_and_a_different_one_is_named_by_both_neighbours(seq: None) -> None:
    store = dist.HashStore()
    counts = [CollectiveCount(store, "fp", r, 3) for r in range(3)]
    g = (0, 1, 2)
    assert _close_all(counts, [{g: "a"}, {g: "a"}, {g: "a"}], 0) == [None, None, None]
    errors = _close_all(counts, [{g: "a"}, {g: "b"}, {g: "a"}], 1)
    assert errors[2] is None
    e0, e1 = errors[0], errors[1]
    assert isinstance(e0, SilentCorruption) and e0.ranks == (0, 1) and e0.window_end == 1
    assert isinstance(e1, SilentCorruption) and e1.ranks == (1, 2)
    assert "step 1" in str(e0) and "rank 0" in str(e0) and "rank 1" in str(e0)
    assert classify(e0) == ("sdc", Severity.SOFT)
    assert classify(CorruptReplica("x")) == ("sdc", Severity.HARD)


def test_a_replica_group_off_the_ring_compares_with_its_next_member(seq: None) -> None:
    # HSDP-like: ranks 0,2 and 1,3 are replicas; 0's ring neighbour (1) holds another shard
    store = dist.HashStore()
    counts = [CollectiveCount(store, "fp", r, 4) for r in range(4)]
    a, b = (0, 2), (1, 3)
    ok = [{a: "x"}, {b: "y"}, {a: "x"}, {b: "y"}]
    assert _close_all(counts, ok, 0) == [None] * 4
    errors = _close_all(counts, [{a: "x"}, {b: "y"}, {a: "x"}, {b: "z"}], 1)
    named = [e.ranks if isinstance(e, SilentCorruption) else None for e in errors]
    assert named == [None, (1, 3), None, (3, 1)]


def test_digests_are_compared_with_the_counts_check_off(seq: None) -> None:
    store = dist.HashStore()
    counts = [CollectiveCount(store, "fp", r, 2, counts=False) for r in range(2)]
    store.set("unrelated", "1")
    errors = _close_all(counts, [{(0, 1): "a"}, {(0, 1): "b"}], 0)
    assert all(isinstance(e, SilentCorruption) for e in errors)


def test_the_pending_window_waits_for_the_peer_before_comparing(seq: None) -> None:
    store = dist.HashStore()
    a, b = CollectiveCount(store, "fp", 0, 2), CollectiveCount(store, "fp", 1, 2)
    a.begin(0)
    a.close_window(0, {(0, 1): "d"})
    assert a.settle(block=False) is False  # the peer has not posted: nothing compared yet
    t = threading.Thread(target=lambda: (b.begin(0), b.close_window(0, {(0, 1): "e"})))
    t.start()
    with pytest.raises(SilentCorruption):
        a.settle(block=True)
    t.join(5)


# -- who was corrupt -----------------------------------------------------------------------------------
class _Events:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []

    def emit(self, event: Any, **fields: Any) -> None:
        self.got.append({"event": event.value, **fields})


def _check(rank: int, world: int, tmp_path: Path | None = None) -> ReplicaCheck:
    def mark(detail: dict[str, Any]) -> bool:  # (what the step loop's run does under the launcher)
        return tmp_path is not None and mark_replace(tmp_path, rank, detail)

    run = SimpleNamespace(rank=rank, world_size=world, local_rank=rank, generation=0, events=_Events(),
                          mark_replace=mark)  # fmt: skip
    return ReplicaCheck(SdcConfig(), run)  # type: ignore[arg-type]


def _exchange(checks: list[ReplicaCheck]) -> Any:
    payloads = [
        json.dumps({str(s): {dg.group_id(g): d for g, d in ds.items()} for s, ds in c.history.items()})
        for c in checks
    ]
    return lambda gen, name, payload: payloads


def test_three_replicas_name_the_minority(tmp_path: Path) -> None:
    g = (0, 1, 2)
    checks = [_check(r, 3, tmp_path) for r in range(3)]
    for c, d in zip(checks, ["a", "b", "a"], strict=True):
        c.history = {4: {g: "ok"}, 9: {g: d}}
    for c in checks[::2]:
        c.attribute(0, _exchange(checks))
    checks[1].attribute(0, _exchange(checks))
    for c in checks:
        (ev,) = c.session.events.got
        assert ev["event"] == "sdc_detected" and ev["ranks"] == [1] and ev["step"] == 9
        assert ev["how"] == "majority"
    assert checks[1].strikes == 1 and checks[0].strikes == 0
    with pytest.raises(CorruptReplica) as e:  # found corrupt again: its agent is to replace it
        checks[1].attribute(1, _exchange(checks))
    assert e.value.replaced
    mark = take_replace(tmp_path, 1)
    assert mark is not None and mark["cause"].startswith("sdc: replica found corrupt 2 times")


def test_two_replicas_are_told_apart_by_the_replay_or_not_at_all() -> None:
    g = (0, 1)
    for replayed, named in (("a", [1]), ("b", [0]), ("c", [])):
        checks = [_check(r, 2) for r in range(2)]
        for c, d in zip(checks, ["a", "b"], strict=True):
            c.history = {9: {g: d}}
        exchange = _exchange(checks)
        for c in checks:
            c.attribute(0, exchange)
            assert c.session.events.got[-1]["how"] == "replay pending"
            c.history[9] = {g: replayed}  # the replay closed the same window, digests agreed
            c.agreed(9)
            ev = c.session.events.got[-1]
            assert ev["ranks"] == named and ev["how"] == ("replay" if named else "undecided")
            assert not c.awaiting
        assert [c.strikes for c in checks] == [int(r in named) for r in range(2)]


def test_the_digest_interval() -> None:
    c = _check(0, 2)
    assert [n for n in range(1, 301) if c.due(n)] == [100, 200, 300]
    c.cfg = SdcConfig(interval=7)
    assert c.due(14) and not c.due(15)


# -- snapshots verified before they are restored -----------------------------------------------------
def test_a_snapshot_whose_copy_changed_is_never_restored() -> None:
    ring = SnapshotRing()
    for step in (4, 8):
        state = {"model": {"w": torch.full((3,), float(step))}}
        ring.capture(step, state, dg.leaf_sums(state))
    flip_bit(ring._slots[1].buffers["/model/w"], 2)  # a bit flips in the host copy of step 8
    assert ring.materialize(4)["model"]["w"][0].item() == 4.0
    with pytest.raises(CorruptSnapshot, match=r"step 8.*'/model/w'"):
        ring.materialize(8)
    assert ring.steps() == [4]
    ring.capture(12, {"model": {"w": torch.zeros(3)}}, dg.leaf_sums({"model": {"w": torch.zeros(3)}}))
    flip_bit(ring._slots[1].buffers["/model/w"], 0)
    assert ring.drop_corrupt() and ring.steps() == [4]


# -- the chaos kind ------------------------------------------------------------------------------------
def test_bitflip_flips_after_the_optimizer_step_once() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = model.weight.detach().clone()
    undo = Bitflip().inject(Fault("bitflip", 3, 1), [model, opt])
    assert torch.equal(model.weight, before)  # not before the optimizer step
    opt.step()
    changed = (model.weight != before).nonzero().tolist()
    assert changed == [[0, 0]]
    after = model.weight.detach().clone()
    opt.step()
    assert torch.equal(model.weight, after)  # the hook removed itself
    assert undo is not None
    undo()  # (idempotent)
