"""A user's training script: three lines of resilient, no fault code, no chaos imports."""

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient


@resilient.wrap(hang_timeout=2, checkpoint={"dir": "ck", "interval": 5})
def train(ctx: resilient.Context) -> None:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(dist.get_rank())
    ctx.track(model=model, optimizer=opt, data=data)
    for _ in ctx.steps(30):
        x = torch.randn(16, 8, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)  # the rest of a real step's work


if __name__ == "__main__":
    train()
