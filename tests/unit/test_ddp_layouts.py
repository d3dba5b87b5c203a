"""DDP's rebuilt bucket layout is noted, kept across processes, and handed to a DDP built again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from resilient.state.ddp import BucketLayouts


@pytest.fixture
def group(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_the_rebuilt_layout_is_noted_and_given_to_the_next_ddp(group, tmp_path: Path) -> None:
    ddp = DDP(_model())
    layouts = BucketLayouts()
    assert not layouts.observe([ddp]) and len(layouts) == 0  # nothing rebuilt before a backward
    for _ in range(3):
        ddp(torch.randn(3, 4)).sum().backward()
    assert layouts.observe([ddp, object()]) and len(layouts) == 1
    assert not layouts.observe([ddp])  # once
    (layout,) = layouts._known.values()
    assert sorted(i for b in layout for i in b) == list(range(6))

    layouts.dump(tmp_path / "buckets.json")
    again = BucketLayouts()
    again.load(tmp_path / "buckets.json")
    assert again._known == layouts._known

    original = dist._compute_bucket_assignment_by_size
    params = list(_model().parameters())
    with again.applied():
        buckets, _ = dist._compute_bucket_assignment_by_size(params, [1 << 30], [False] * 6)
        assert [list(b) for b in reversed(buckets)] == layout  # (DDP reverses what it is given)
        other = [torch.zeros(5)]  # another model's parameters: DDP's own assignment
        assert dist._compute_bucket_assignment_by_size(other, [1 << 30], [False])[0] == [[0]]
        rebuilt = DDP(_model())  # built while applied: trains as before
        rebuilt(torch.randn(3, 4)).sum().backward()
    assert dist._compute_bucket_assignment_by_size is original


def test_a_bad_layout_file_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "buckets.json"
    path.write_text('[{"params": [[[2], "os.system"]], "buckets": [[0]]}]')
    layouts = BucketLayouts()
    layouts.load(path)
    layouts.load(tmp_path / "missing.json")
    assert len(layouts) == 0


def _all_hold(values: list[str]) -> list[bool]:
    import threading

    from resilient.runtime.coordination.agreement import all_hold

    store = dist.HashStore()
    out: list[bool] = [False] * len(values)

    def rank(r: int) -> None:
        out[r] = all_hold(store, "job/a0/ddp_layout/g0", len(values), values[r], 30.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_layout_is_used_on_every_rank_or_on_none() -> None:
    assert _all_hold(["ab", "ab", "ab"]) == [True, True, True]
    assert _all_hold(["ab", "", "ab"]) == [False, False, False]  # one rank knows none: nobody uses it
    assert _all_hold(["", "", ""]) == [True, True, True]  # (the caller also needs a layout to use)
