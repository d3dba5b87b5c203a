"""Data parallel by hand: three all-reduces of equal shape per step (a skipped one is silent)."""

import argparse

import torch
import torch.distributed as dist

import resilient

p = argparse.ArgumentParser()
p.add_argument("--check", choices=["on", "off"], default="on")
args = p.parse_args()


# a fixed snapshot cadence: without the check, snapshots after the skip are kept (the point shown)
@resilient.wrap(backend="gloo", hang_timeout=2, collective_check=args.check == "on", snapshot={"interval": 2})
def train(ctx: resilient.Context) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(dist.get_rank())
    ctx.track(model=model, optimizer=opt, data=data)
    for _ in ctx.steps(20):
        x = torch.randn(8, 4, generator=data)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():  # each gradient all-reduced on its own, all 4x4
            dist.all_reduce(prm.grad)
            prm.grad /= dist.get_world_size()
        opt.step()


if __name__ == "__main__":
    train()
