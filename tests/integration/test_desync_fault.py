"""``desync`` on a DDP model at two gloo ranks (chaos/faults/desync.py): the faulted step's
gradients are not all-reduced however the loop toggles DDP's sync (set before every micro-step, or
``no_sync()``), and the model is a plain DDP again, syncing, once the step is over."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from chaos.inject import Injector, outcomes

pytestmark = pytest.mark.integration
ACCUM = 2  # micro-steps per step


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rank(rank: int, store_path: str, plan: str, style: str, out: str) -> None:
    """Three steps of ``ACCUM`` micro-steps on a DDP model; rank r's inputs are all ``r + 1``, so
    its own gradient is 3 (r + 1) per weight and the all-reduced one 4.5."""
    os.environ["CHAOS_INJECTIONS"] = os.path.join(out, "inj.jsonl")
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1, bias=False))
    inj = Injector.parse(plan)
    grads, after = [], []
    for step in range(3):
        inj.maybe_fire(rank, step, objects=[model])
        model.zero_grad(set_to_none=True)
        for micro in range(ACCUM):
            x = torch.full((1, 4), float((rank + 1) * (micro + 1)))
            if style == "attribute":  # set before every micro-step's forward, the last one True
                model.require_backward_grad_sync = micro == ACCUM - 1
                model(x).sum().backward()
            elif micro < ACCUM - 1:
                with model.no_sync():
                    model(x).sum().backward()
            else:
                model(x).sum().backward()
        grads.append(model.module.weight.grad[0, 0].item())
        inj.step_over()
        after.append([type(model) is DDP, model.require_backward_grad_sync])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"grads": grads, "after": after}, f)
    # torn down, then out without the interpreter's finalization: a gloo thread freeing the
    # barrier's tensors then would abort the process (tests/integration/_reshard_worker.py:leave)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.parametrize("style", ["attribute", "no_sync"])
def test_the_faulted_step_is_not_all_reduced_however_the_loop_sets_the_sync(
    tmp_path: Path, style: str
) -> None:
    import torch.multiprocessing as mp

    # both ranks skip step 1's all-reduce (one alone would leave its peer waiting in it)
    plan = "desync@1:0,desync@1:1"
    mp.spawn(_rank, args=(str(tmp_path / "store"), plan, style, str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["grads"] for g in got] == [[4.5, 3.0, 4.5], [4.5, 6.0, 4.5]]  # step 1: each its own
    assert all(g["after"] == [[True, True]] * 3 for g in got)  # a plain DDP, syncing, after it
    acted, idle = outcomes(_records(tmp_path / "inj.jsonl"))
    assert sorted((r["kind"], r["rank"]) for r in acted) == [("desync", 0), ("desync", 1)] and idle == []
