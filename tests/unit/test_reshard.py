"""The indices a saved DTensor layout implies, and copying the overlap of two shards."""

from __future__ import annotations

import pytest
import torch

from resilient.checkpoint.reshard import _copy_overlap, held_indices
from resilient.errors import StateRestoreError


def _spec(shape: list[int], mesh: list[int], placements: list[list[object]]) -> dict[str, object]:
    n = 1
    for s in mesh:
        n *= s
    return {
        "mesh": {"device_type": "cpu", "shape": mesh, "ranks": list(range(n)), "dims": None},
        "placements": placements,
        "shape": shape,
        "stride": [],
    }


def _rows(spec: dict[str, object], rank: int) -> list[int]:
    idx = held_indices(spec, rank)
    assert idx is not None
    return idx[0].tolist()


def test_uneven_rows_follow_torch_chunk_and_a_rank_may_hold_none() -> None:
    spec = _spec([5, 3], [4], [["shard", 0]])
    assert [_rows(spec, r) for r in range(4)] == [[0, 1], [2, 3], [4], []]
    assert held_indices(spec, 9) is None  # not on the mesh


def test_left_to_right_and_strided_sharding_match_dtensors_own_tables() -> None:
    # the two tables of torch's _StridedShard docstring: [8, 8] on the 2x2 mesh [[0, 1], [2, 3]]
    plain = _spec([8, 8], [2, 2], [["shard", 0], ["shard", 0]])
    assert [_rows(plain, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    strided = _spec([8, 8], [2, 2], [["strided", 0, 2], ["shard", 0]])
    assert [_rows(strided, r) for r in range(4)] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    hsdp = _spec([6, 4], [2, 2], [["replicate"], ["shard", 1]])
    idx = held_indices(hsdp, 3)
    assert idx is not None and idx[0].tolist() == list(range(6)) and idx[1].tolist() == [2, 3]


def test_a_partial_sum_cannot_reshard() -> None:
    with pytest.raises(StateRestoreError, match="Partial"):
        held_indices(_spec([4], [2], [["partial", "sum"]]), 0)


def test_overlap_copies_exactly_the_common_elements() -> None:
    full = torch.arange(80.0).reshape(8, 10)
    want = [torch.tensor([1, 2, 5, 6]), torch.arange(3, 8)]  # an interleaved dimension and a range
    have = [torch.arange(0, 4), torch.arange(0, 10)]
    dst = torch.full((4, 5), -1.0)
    n = _copy_overlap(dst, want, full[0:4], have)
    assert n == 2 * 5
    assert torch.equal(dst[:2], full[[1, 2]][:, 3:8]) and (dst[2:] == -1).all()
    n2 = _copy_overlap(dst, want, full[4:8], [torch.arange(4, 8), torch.arange(10)])
    assert n2 == 10 and torch.equal(dst, full[want[0]][:, 3:8])
    assert _copy_overlap(dst, want, full[3:4], [torch.tensor([3]), torch.arange(10)]) == 0
