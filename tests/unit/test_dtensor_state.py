"""DTensor leaves are kept as local shards with their layout, and come back on today's mesh."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from resilient.errors import StateRestoreError
from resilient.state import Registry
from resilient.state.dtensor import MARK


@pytest.fixture
def group(tmp_path: Path):  # a one-rank gloo group, rebuilt by the test like a generation
    def build(name: str) -> None:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / name), 1), rank=0, world_size=1)

    yield build
    if dist.is_initialized():
        dist.destroy_process_group()


def _sharded_linear() -> torch.nn.Linear:
    mesh = init_device_mesh("cpu", (1,))
    lin = torch.nn.Linear(4, 3)
    for name, p in list(lin.named_parameters()):
        setattr(lin, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return lin


def test_dtensor_state_comes_back_onto_the_rebuilt_mesh(group) -> None:
    group("g0")
    torch.manual_seed(0)
    lin = _sharded_linear()
    reg = Registry()
    reg.add("model", lin)
    saved = copy.deepcopy(reg.capture()["model"])
    leaf = saved["weight"]
    assert set(leaf) == {MARK, "local"} and type(leaf["local"]) is torch.Tensor
    assert leaf[MARK]["placements"] == [["shard", 0]] and leaf[MARK]["shape"] == [3, 4]
    dist.destroy_process_group()  # a restart: the old mesh's group is gone

    group("g1")
    torch.manual_seed(1)  # different weights
    again = _sharded_linear()
    reg2 = Registry()
    reg2.add("model", again)
    reg2.load("model", saved)
    assert isinstance(again.weight, DTensor)
    assert torch.equal(again.weight.to_local(), lin.weight.to_local())
    assert torch.equal(again.bias.to_local(), lin.bias.to_local())


def test_a_layout_no_tracked_object_lives_on_is_named(group) -> None:
    group("g0")
    reg = Registry()
    reg.add("model", _sharded_linear())
    saved = copy.deepcopy(reg.capture()["model"])
    saved["weight"][MARK]["mesh"]["shape"] = [2]
    saved["weight"][MARK]["mesh"]["ranks"] = [0, 1]
    reg2 = Registry()
    reg2.add("model", _sharded_linear())
    with pytest.raises(StateRestoreError, match=r"model/weight: saved as a DTensor on the device mesh"):
        reg2.load("model", saved)
