"""A DDP epoch loop over a DataLoader, written the way the DDP tutorials write it.

``DataLoader`` + ``DistributedSampler`` (shuffled), ``sampler.set_epoch(epoch)`` every epoch, a
model with dropout, SGD with momentum; optionally worker processes with a random augmentation.
Made resilient with the README's lines: ``ctx.track(loader=...)`` keeps the loader's position,
``ctx.epochs`` / ``ctx.steps(loader)`` resume mid-epoch after the batches already consumed.
``--loader stateful``: torchdata's ``StatefulDataLoader`` instead (tracked the same way);
``--loop manual``: the other tutorial loop, ``for step in ctx.steps(n)`` with a new
``iter(loader)`` at each epoch's start.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp_epochs.py --epochs 3
    resilient launch --standalone --nproc-per-node 2 examples/train_ddp_epochs.py --num-workers 2
    torchrun --standalone --nproc-per-node 2 examples/train_ddp_epochs.py --loader stateful --loop manual
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import resilient


class Regression(Dataset):
    """A fixed random regression set (built from the global RNG, as tutorials do), with a random
    jitter on every read: the augmentation draws from the reading process's RNG."""

    def __init__(self, size: int) -> None:
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return x + 0.01 * torch.randn(20), y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--config", default=None, help="a resilient config file (configs/default.yaml)")
    p.add_argument("--loader", choices=("plain", "stateful"), default="plain",
                   help="stateful: torchdata's StatefulDataLoader (pip install torchdata)")  # fmt: skip
    p.add_argument("--loop", choices=("epochs", "manual"), default="epochs",
                   help="manual: ctx.steps(n) and a new iter(loader) at each epoch's start")  # fmt: skip
    args = p.parse_args()
    overrides: dict[str, object] = {}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.ckpt_dir:
        overrides["checkpoint"] = {"dir": args.ckpt_dir, "interval": args.ckpt_every}

    @resilient.wrap(config=args.config, **overrides)
    def train(ctx: resilient.Context) -> None:
        torch.manual_seed(0)
        dataset = Regression(args.size)
        sampler = DistributedSampler(dataset)
        if args.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader as Loader
        else:
            Loader = DataLoader
        loader = Loader(
            dataset, batch_size=args.batch, shuffle=False, sampler=sampler, num_workers=args.num_workers
        )
        net = torch.nn.Sequential(
            torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
        )
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        ctx.track(model=model, optimizer=opt, loader=loader)
        if args.loop == "manual":
            per, batches = len(loader), None
            for step in ctx.steps(args.epochs * per):
                if batches is None or step % per == 0:  # (an epoch's start, or the entry after a restore)
                    sampler.set_epoch(step // per)
                    batches = iter(loader)
                source, targets = next(batches)
                opt.zero_grad()
                loss = F.mse_loss(model(source), targets)
                ctx.observe(loss=loss)
                loss.backward()
                opt.step()
                if ctx.rank == 0 and step % per == per - 1:
                    print(f"epoch {step // per} step {step} loss {loss.item():.5f}", flush=True)
            return
        for epoch in ctx.epochs(args.epochs):
            sampler.set_epoch(epoch)
            for source, targets in ctx.steps(loader):
                opt.zero_grad()
                loss = F.mse_loss(model(source), targets)
                ctx.observe(loss=loss)  # a NaN or a spike in it rolls back (docs/recovery.md)
                loss.backward()
                opt.step()
            if ctx.rank == 0:
                print(f"epoch {epoch} step {ctx.step} loss {loss.item():.5f}", flush=True)

    train()


if __name__ == "__main__":
    main()
