"""DCP save/load with JSON metadata, single process (DCP runs without a process group)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from resilient.checkpoint.sharded import METADATA_FILE, _JsonMetadataReader, load_sharded, save_sharded
from resilient.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@dataclass
class Opaque:
    """Not a tensor nor a plain container: weights_only=True must refuse it."""

    value: int


def _state() -> dict:
    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "step": 17,
        "nested": {
            "ids": torch.tensor([3, 1, 4], dtype=torch.int64),
            "half": torch.linspace(0, 1, 5, dtype=torch.bfloat16),
            "items": [torch.ones(2), 0.5],
            "name": "adam",
            "betas": (0.9, 0.999),
        },
    }


def _blank() -> dict:
    return {
        "w": torch.zeros(4, 6),
        "step": 0,
        "nested": {
            "ids": torch.zeros(3, dtype=torch.int64),
            "half": torch.zeros(5, dtype=torch.bfloat16),
            "items": [torch.zeros(2), 0.0],
            "name": "",
            "betas": (0.0, 0.0),
        },
    }


def _assert_same(expected: dict, got: dict) -> None:
    assert torch.equal(got["w"], expected["w"])
    assert got["step"] == expected["step"]
    for key in ("ids", "half"):
        assert got["nested"][key].dtype == expected["nested"][key].dtype
        assert torch.equal(got["nested"][key], expected["nested"][key])
    assert torch.equal(got["nested"]["items"][0], expected["nested"]["items"][0])
    assert got["nested"]["items"][1] == expected["nested"]["items"][1]
    assert got["nested"]["name"] == "adam"
    assert tuple(got["nested"]["betas"]) == (0.9, 0.999)


def test_round_trip_plain_and_nested(tmp_path: Path) -> None:
    directory = tmp_path / "step-00000100.tmp" / "dcp"  # parents do not exist yet
    written = save_sharded(_state(), directory)
    assert METADATA_FILE in written
    assert sorted(p.name for p in directory.iterdir()) == written
    target = _blank()
    w = target["w"]
    load_sharded(target, directory)
    _assert_same(_state(), target)
    assert target["w"] is w  # tensors load in place


def test_metadata_is_json(tmp_path: Path) -> None:
    save_sharded(_state(), tmp_path)
    doc = json.loads((tmp_path / METADATA_FILE).read_text())
    assert doc["state_dict_metadata"]["w"]["size"] == [4, 6]
    assert doc["state_dict_metadata"]["nested.half"]["dtype"] == "bfloat16"
    assert doc["state_dict_metadata"]["step"] == {"type": "bytes"}
    assert doc["planner_data"]["nested.items.1"] == ["nested", "items", 1]
    assert not (tmp_path / ".metadata").exists()  # no pickled metadata next to it


def test_load_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_sharded(_state(), tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used on the load path")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    target = _blank()
    load_sharded(target, tmp_path)
    _assert_same(_state(), target)


def test_non_tensor_object_is_rejected_not_unpickled(tmp_path: Path) -> None:
    save_sharded({"w": torch.ones(2), "obj": Opaque(3)}, tmp_path)
    with pytest.raises(CheckpointError, match="'obj' does not load with weights_only=True"):
        load_sharded({"w": torch.zeros(2), "obj": None}, tmp_path)


def test_stock_planner_is_refused_for_non_tensor_entries(tmp_path: Path) -> None:
    save_sharded(_state(), tmp_path)
    with pytest.raises(CheckpointException, match="stock DCP unpickles them"):
        dcp.load(_blank(), storage_reader=_JsonMetadataReader(tmp_path))


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda p: p.write_text(p.read_text()[:40]),  # truncated
        lambda p: p.write_bytes(pickle.dumps({"a": 1})),  # a stock DCP (pickled) metadata file, say
        lambda p: p.unlink(),
        lambda p: _edit(p, '"float32"', '"__import__"'),  # not a torch.dtype
        lambda p: _edit(p, '"size":[4,6]', '"size":[4,"6"]'),
        lambda p: _edit(p, '"format":"resilient.dcp-metadata/1"', '"format":"other"'),
    ],
    ids=["truncated", "pickle", "missing", "bad-dtype", "bad-size", "bad-format"],
)
def test_corrupt_metadata_names_the_file(tmp_path: Path, corrupt: Callable[[Path], None]) -> None:
    save_sharded(_state(), tmp_path)
    path = tmp_path / METADATA_FILE
    corrupt(path)
    with pytest.raises(CheckpointError, match=str(path)):
        load_sharded(_blank(), tmp_path)


def test_a_file_s_tensor_strides_are_read_where_torch_has_the_field_and_dropped_where_not():
    import dataclasses

    import pytest
    from torch.distributed.checkpoint.metadata import TensorProperties

    from resilient.checkpoint import sharded

    has = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}  # (torch 2.15+)
    assert sharded._strides_for({"strides": [4, 1]}) == ({"strides": (4, 1)} if has else {})
    assert sharded._strides_for({}) == ({"strides": None} if has else {})  # (a file from an older torch)
    if has:
        with pytest.raises(TypeError):
            sharded._strides_for({"strides": ["4", 1]})
