"""One rank of the sharded-checkpoint test: FSDP2 state through ``Checkpointer(sharded=...)``.

save ROOT   train an FSDP2 model, checkpoint steps 1 and 2 (rank 0 writes save1.pt / save2.pt:
            the full tensors, gathered, for a bit-exact comparison)
load ROOT   fresh model with other weights; load the newest checkpoint that verifies on every
            rank, resharded to this world size (rank 0 writes load.pt and load.json)
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
from _reshard_worker import full, leave  # the script's own folder is on sys.path
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from resilient.checkpoint.manager import Checkpointer


def build(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    opt.zero_grad()
    model(torch.randn(4, 6, generator=gen)).square().mean().backward()
    opt.step()


def sharded_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def main() -> None:
    phase, root = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0, timeout=timeout
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    out = root.parent
    if phase == "save":
        model, opt = build(seed=0, lr=1e-2)
        gen = torch.Generator().manual_seed(100 + rank)
        with Checkpointer(root, rank=rank, world_size=world, token="job") as ck:
            for s in (1, 2):
                step(model, opt, gen)
                state = sharded_state(model, opt)
                ck.save(s, {"gen": gen.get_state()}, sharded=state)
                gathered = full(state)
                if rank == 0:
                    torch.save(gathered, out / f"save{s}.pt")
    else:
        model, opt = build(seed=99, lr=0.5)
        state = sharded_state(model, opt)
        with Checkpointer(root, rank=rank, world_size=world, token="job2") as ck:
            loaded = ck.load_latest(sharded=state)
        assert loaded is not None
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        gathered = full(sharded_state(model, opt))
        if rank == 0:
            torch.save(gathered, out / "load.pt")
            (out / "load.json").write_text(
                json.dumps({"step": loaded.step, "state": loaded.state is not None})
            )
    leave(store, rank, world, timeout)


if __name__ == "__main__":
    main()
