"""Rank 1 raises at the start of step FAULT while rank 0 is still in the tail of step FAULT - 1,
after its backward's allreduce and before its optimizer's update (a slow rank's tail): rank 0 is
a step behind the rank that faulted. Argument ``fault``: inject it; without: the reference run.

Rank 0 holds its tail until the runtime has taken its peer's fault (it polls the step loop's own
record of a pending leave, so the order is an event, not a race); an interrupted tail would
vouch for the step before the fault's, and the ranks would fall back to the ring's snapshot."""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient

FAULT = 12
MARK = Path("rank1_raises")


@resilient.wrap(hang_timeout=10, snapshot={"interval": 5})
def train(ctx: resilient.Context) -> None:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(dist.get_rank())
    ctx.track(model=model, optimizer=opt, data=data)
    inject = ctx.job_start and sys.argv[1:] == ["fault"]
    for step in ctx.steps(24):
        if inject and step == FAULT and dist.get_rank() == 1:
            MARK.touch()
            raise RuntimeError(f"rank 1 fails at the start of step {step}")
        x = torch.randn(16, 8, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if inject and step == FAULT - 1 and dist.get_rank() == 0:
            _hold_tail_until_the_peers_fault_is_taken(ctx)
        opt.step()
    if dist.get_rank() == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, "final.pt")


def _hold_tail_until_the_peers_fault_is_taken(ctx: resilient.Context) -> None:
    live = ctx._rt.live  # (the test's window on the runtime: its record of a leave at the step's end)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if MARK.exists() and live._leaving is not None:
            return
        time.sleep(0.01)
    raise TimeoutError("rank 1's fault never reached rank 0")


if __name__ == "__main__":
    train()
