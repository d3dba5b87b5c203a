"""A replica group's worker for the torchft peer of benchmarks/work_lost_peers.py (torchft 0.2.0).

One rank per replica group, gloo; the shared workload (benchmarks/peers/tiny_workload.py) under
torchft's Manager, its DDP and optimizer wrappers, in the example's step order: the batch, the
planned fault (keyed by the replica group's number), the forward, the padding, ``zero_grad``
(which starts the step's quorum, asynchronously), the backward, ``step`` (which commits only if
every participant's all-reduce went through). A group that (re)joins heals from a survivor's state
at the survivor's step. The process group's timeout (``--timeout``) is how long a survivor waits on
a peer that stopped answering: torchft has no detector of its own for a hung trainer.

A committed step appends ``{"t", "step", "rank", "pid"}`` (``rank`` = the replica group); a step
that did not commit appends ``{"event": "uncommitted", ...}`` (the driver's detection time).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.tiny_workload import build, padded_loss, progress
from chaos import Injector


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--progress", type=Path, required=True)
    p.add_argument("--fault", default="", help="chaos plan, kind@step:replica_group")
    p.add_argument("--timeout", type=float, default=5.0, help="torchft's process-group timeout, s")
    args = p.parse_args()
    group = int(os.environ["REPLICA_GROUP_ID"])
    torch.set_num_threads(1)
    wl = build(group, args.steps)

    def load_state_dict(sd: dict[str, Any]) -> None:
        wl.model.load_state_dict(sd["model"])
        wl.opt.load_state_dict(sd["optim"])
        wl.sched.load_state_dict(sd["sched"])

    def state_dict() -> dict[str, Any]:
        return {"model": wl.model.state_dict(), "optim": wl.opt.state_dict(), "sched": wl.sched.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, wl.model)
    opt = Optimizer(manager, wl.opt)
    injector = Injector.parse(args.fault)
    try:
        while manager.current_step() < args.steps:
            before = manager.current_step()
            loss = padded_loss(ddp, wl, args.step_ms, lambda: injector.maybe_fire(group, before))  # noqa: B023
            opt.zero_grad()
            loss.backward()
            opt.step()
            after = manager.current_step()
            if after > before:  # committed (a healing group jumps to the survivor's step meanwhile)
                wl.sched.step()
                progress(args.progress, step=after - 1, rank=group)
            else:
                progress(args.progress, event="uncommitted", rank=group, step_tried=before)
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
