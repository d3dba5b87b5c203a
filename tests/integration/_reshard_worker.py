"""One rank of the resharding test: ``save`` or ``load`` sharded state in DIR (env:// rendezvous, gloo).

Each phase writes the full (unsharded) tensors it holds afterwards to ``DIR/../<phase>.pt`` on rank 0,
so the test can compare them bit for bit, and each rank writes the files it reported having written.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from resilient.checkpoint.sharded import load_sharded, save_sharded

GLOBAL = torch.arange(60, dtype=torch.float32).reshape(10, 6) / 7  # 10 rows: uneven over 4 ranks


def build(mesh: DeviceMesh, seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))  # 3 rows: one rank holds none
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()


def full(tree: Any) -> Any:
    """The same tree with every DTensor gathered (collective), for a bit-exact comparison."""
    if isinstance(tree, dict):
        return {k: full(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(full(v) for v in tree)
    return tree.full_tensor() if isinstance(tree, DTensor) else tree


def main() -> None:
    phase, directory = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=20)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    mesh = init_device_mesh("cpu", (world,))
    if phase == "save":
        model, opt = build(mesh, seed=0, lr=1e-2)
        train(model, opt, steps=2)  # Adam moments and step are non-trivial
        dt = distribute_tensor(GLOBAL, mesh, [Shard(0)])
        extra = {"step": 2, "tag": "run-a"}
    else:  # everything differs (weights, lr, extras): the load must overwrite it all
        model, opt = build(mesh, seed=99, lr=0.5)
        dt = distribute_tensor(torch.zeros_like(GLOBAL), mesh, [Shard(0)])
        extra = {"step": 0, "tag": ""}
    model_sd, optim_sd = get_state_dict(model, opt)  # a fresh optimizer gets its state initialised
    state = {"model": model_sd, "optim": optim_sd, "dt": dt, "extra": extra}
    if phase == "save":
        written = save_sharded(state, directory)
        (directory.parent / f"written-{rank}.json").write_text(json.dumps(written))
    else:
        load_sharded(state, directory)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        model_sd, optim_sd = get_state_dict(model, opt)  # read back what the modules now hold
        state = {"model": model_sd, "optim": optim_sd, "dt": state["dt"], "extra": state["extra"]}
    gathered = full(state)
    if rank == 0:
        torch.save(gathered, directory.parent / f"{phase}.pt")
    leave(store, rank, world, timeout)


def leave(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> None:
    """End a worker: the group torn down, rank 0 (the store's host) last, no interpreter finalization.

    A gloo worker thread frees a finished collective's tensors a moment after the main thread saw it
    complete, and a barrier keeps every collective issued before it until the barrier is freed. If
    the interpreter is finalizing by then, that free takes the GIL and the process aborts with
    "terminate called without an active exception" (CI, once; here 2 runs in 30 on a loaded
    machine; the core: ~AsyncBarrierWork -> ~AsyncAllgatherCoalescedWork -> decref_pyobject ->
    take_gil -> pthread_exit). Everything the test reads is written and closed by now.
    """
    dist.barrier()
    dist.destroy_process_group()
    store.set(f"left/{rank}", "1")
    if rank == 0:
        store.wait([f"left/{r}" for r in range(1, world)], timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
