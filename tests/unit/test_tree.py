"""The one walk over nested state containers, and the walks built on it keeping their formats."""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import pytest
import torch

from resilient.checkpoint.codec import decode, encode
from resilient.errors import CheckpointError
from resilient.state import SnapshotRing
from resilient.state.dtensor import MARK, holds_dtensors
from resilient.state.registry import Registry
from resilient.state.snapshot import Frozen
from resilient.state.tree import any_leaf, is_namedtuple, map_leaves, map_with_path

Point = collections.namedtuple("Point", "x y")


def _tree() -> dict[str, Any]:
    return {
        "a": collections.OrderedDict(w=1, v=[2, (3, 4)]),
        "p": Point(5, 6),
        "n": None,
        7: "int key",
    }


def test_containers_are_rebuilt_as_their_kind_and_namedtuples_are_leaves() -> None:
    seen: list[Any] = []
    out = map_leaves(lambda x: seen.append(x) or x, _tree())
    assert out == _tree()
    assert type(out["a"]) is dict and type(out["a"]["v"]) is list and type(out["a"]["v"][1]) is tuple
    assert out["p"] is not None and is_namedtuple(out["p"])
    assert seen == [1, 2, 3, 4, Point(5, 6), None, "int key"]  # depth first, in key order
    assert not is_namedtuple((1, 2)) and not is_namedtuple([1])


def test_paths_join_keys_and_indices_with_slashes() -> None:
    paths = []
    map_with_path(lambda x, p: paths.append(p), _tree())
    assert paths == ["/a/w", "/a/v/0", "/a/v/1/0", "/a/v/1/1", "/p", "/n", "/7"]
    got: list[str] = []
    map_with_path(lambda x, p: got.append(p), [[1]], "/root")
    assert got == ["/root/0/0"]
    assert map_with_path(lambda x, p: p, 3) == ""  # a bare leaf is the root


def test_typed_leaves_go_to_their_own_function_and_the_rest_to_fn() -> None:
    tree = {"t": torch.zeros(1), "l": [torch.ones(2), {"u": torch.ones(3)}], "s": 1}
    typed = (torch.Tensor, lambda x, p: ("typed", p))
    out = map_with_path(lambda x, p: ("fn", p), tree, typed=typed)
    assert out == {
        "t": ("typed", "/t"),
        "l": [("typed", "/l/0"), {"u": ("typed", "/l/1/u")}],
        "s": ("fn", "/s"),
    }
    assert map_with_path(lambda x, p: "fn", torch.zeros(1), "/r", typed=typed) == ("typed", "/r")
    assert map_leaves(type, tree, typed=(torch.Tensor, type)) == map_leaves(type, tree)
    assert map_leaves(lambda x: "fn", torch.zeros(1), typed=(torch.Tensor, lambda x: "typed")) == "typed"


def test_stop_hands_a_container_whole_to_the_leaf_function() -> None:
    tree = {"x": {"stop": 1}, "y": [{"go": 2}]}
    out = map_with_path(lambda x, p: (p, x), tree, stop=lambda o: isinstance(o, dict) and "stop" in o)
    assert out == {"x": ("/x", {"stop": 1}), "y": [{"go": ("/y/0/go", 2)}]}


def test_wrap_replaces_each_container_after_its_children() -> None:
    order: list[str] = []

    def wrap(obj: Any, out: Any, path: str) -> Any:
        order.append(path)
        return {type(obj).__name__: out}

    assert map_with_path(lambda x, p: x, {"a": [1, (2,)]}, wrap=wrap) == {
        "dict": {"a": {"list": [1, {"tuple": (2,)}]}}
    }
    assert order == ["/a/1", "/a", ""]


def test_any_leaf_stops_at_the_first_match() -> None:
    visited: list[Any] = []

    def pred(x: Any) -> bool:
        visited.append(x)
        return x == 2

    assert any_leaf(pred, [1, [2, 3], 4])
    assert visited == [1, 2]
    assert not any_leaf(lambda x: False, {"a": [1, (2,)]})
    assert any_leaf(lambda x: False, [1, torch.ones(1)], typed=(torch.Tensor, lambda x: True))
    assert not any_leaf(lambda x: True, [torch.ones(1)], typed=(torch.Tensor, lambda x: False))


def test_holds_dtensors_finds_a_portable_leaf_at_any_depth() -> None:
    portable = {MARK: {}, "local": torch.zeros(1)}
    assert holds_dtensors(portable)
    assert holds_dtensors({"a": [1, (portable,)]})
    assert not holds_dtensors({"a": [torch.zeros(1), {"local": 1}]})


class Keeper:
    """Keeps the state it is loaded with (as an optimizer does): the registry must hand it copies."""

    got: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.got = state


def test_a_mapped_state_is_loaded_as_copies_of_its_tensors_and_the_rest_as_is() -> None:
    t = torch.ones(2)
    p = Point(t, 1)
    registry, keeper = Registry(), Keeper()
    registry.add("k", keeper)
    registry.load("k", {"t": t, "l": [t], "tu": (t,), "p": p}, owned=False)
    out = keeper.got
    assert out["t"].data_ptr() != t.data_ptr() and torch.equal(out["t"], t)
    assert out["l"][0].data_ptr() != t.data_ptr() and out["tu"][0].data_ptr() != t.data_ptr()
    assert out["p"] is p  # a namedtuple is a leaf: kept, not rebuilt


def test_encode_skeleton_and_leaf_keys_are_unchanged() -> None:
    """The skeleton and tensor keys are the saved format: spelled out here, byte for byte."""
    a, b, arr = torch.zeros(2), torch.ones(1, dtype=torch.int64), np.arange(3)
    tree = {
        "m": collections.OrderedDict(w=a),
        "opt": {"state": {0: {"step": b}}, "groups": [{"lr": 0.1, "params": [0]}]},
        "rng": Frozen((3, (1, 2), None)),
        "np": arr,
        "f": np.float32(0.5),
        "i": np.int64(4),
        "dt": torch.float16,
        "raw": b"\x00",
        "tu": (a,),
    }
    skeleton, leaves = encode(tree)
    assert skeleton == {
        "d": {
            "m": {"d": {"w": {"T": 0}}},
            "opt": {
                "d": {
                    "state": {"D": [[0, {"d": {"step": {"T": 1}}}]]},
                    "groups": {"l": [{"d": {"lr": 0.1, "params": {"l": [0]}}}]},
                }
            },
            "rng": {"t": [3, {"t": [1, 2]}, None]},
            "np": {"a": 2},
            "f": 0.5,
            "i": 4,
            "dt": {"dt": "float16"},
            "raw": {"b": "AA=="},
            "tu": {"t": [{"T": 3}]},
        }
    }
    assert [leaf.key for leaf in leaves] == ["/m/w", "/opt/state/0/step", "/np", "/tu/0"]
    back = decode(skeleton, [leaf.tensor for leaf in leaves])
    assert back["rng"] == (3, (1, 2), None) and back["opt"]["state"][0]["step"] is leaves[1].tensor


def test_encode_refuses_a_namedtuple_naming_its_path() -> None:
    with pytest.raises(CheckpointError, match=r"cannot checkpoint /x/0: Point is not a tensor"):
        encode({"x": [Point(1, 2)]})


def test_snapshot_buffers_are_keyed_by_leaf_path_and_leaves_keep_their_kind() -> None:
    ring = SnapshotRing()
    state = {"m": {"w": torch.ones(2)}, "o": [{"s": torch.zeros(1)}, (torch.ones(1), 3)], "p": Point(1, 2),
             "r": Frozen(random.getstate())}  # fmt: skip
    ring.capture(1, state)
    slot = next(s for s in ring._slots if s.valid)
    assert sorted(slot.buffers) == ["/m/w", "/o/0/s", "/o/1/0"]
    out = ring.materialize(1)
    assert type(out["o"]) is list and type(out["o"][1]) is tuple and out["o"][1][1] == 3
    assert out["p"] == Point(1, 2) and is_namedtuple(out["p"])
    assert out["r"] == state["r"].value
