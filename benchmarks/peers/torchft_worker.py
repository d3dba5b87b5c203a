"""A replica group's worker for the torchft peer (benchmarks/peers/torchft_peer.py).

One rank per replica group, gloo; a small MLP trained with torchft's Manager, its DDP and optimizer
wrappers (the loop torchft documents: ``zero_grad`` starts the quorum, ``step`` commits only if
every participant's all-reduce went through). A group that (re)joins heals from a survivor's
state at the survivor's step. Steps are padded to ``--step-ms``. Each *committed* step appends
{"t", "step", "replica", "pid"} to --progress.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--timeout", type=float, default=5.0, help="torchft's process-group timeout, s")
    p.add_argument("--progress", type=Path, required=True)
    args = p.parse_args()
    replica = os.environ["REPLICA_GROUP_ID"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    data = torch.Generator().manual_seed(int(replica))
    while manager.current_step() < args.steps:
        t0 = time.monotonic()
        before = manager.current_step()
        x = torch.randn(16, 64, generator=data)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
        spare = args.step_ms / 1e3 - (time.monotonic() - t0)
        if spare > 0:
            time.sleep(spare)  # the step's padding, as the other benchmarks' steps
        after = manager.current_step()
        if after > before:  # committed (a healing group jumps to the survivor's step meanwhile)
            line = {"t": time.time(), "step": after - 1, "replica": replica, "pid": os.getpid()}
            with open(args.progress, "a") as f:
                f.write(json.dumps(line) + "\n")
    manager.shutdown()


if __name__ == "__main__":
    main()
