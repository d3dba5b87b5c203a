"""A DDP loop with the usual furniture, made resilient with the README's three lines.

Each micro-batch of a ``DataLoader`` is one step; the optimizer steps every ``--accum`` of them
(``no_sync`` on the others), under fp16 autocast with a ``GradScaler`` (or bf16 autocast), with
activation checkpointing on every block, dropout, gradient clipping and a warm-up schedule;
``--compile`` runs the model through ``torch.compile``. A fault in the middle of an accumulation
window restores the gradients accumulated so far with the rest of the state.

    torchrun --standalone --nproc-per-node 2 examples/train_accum.py --epochs 2
    torchrun --standalone --nproc-per-node 2 examples/train_accum.py --amp bf16 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import resilient


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    def __init__(self, dim: int, depth: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:  # recomputed in backward; dropout replays its RNG draws
            h = checkpoint(block, h, use_reentrant=False)
        return self.out(h)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--amp", choices=["fp16", "bf16", "off"], default="fp16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--config", default=None, help="a resilient config file (configs/default.yaml)")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--ckpt-dir", default=None, help="durable checkpoints here (resume from them)")
    p.add_argument("--ckpt-every", type=int, default=10)
    args = p.parse_args()
    overrides: dict[str, object] = {}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.ckpt_dir:
        overrides["checkpoint"] = {"dir": args.ckpt_dir, "interval": args.ckpt_every}

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
    dataset = TensorDataset(x, y)

    @resilient.wrap(config=args.config, **overrides)
    def train(ctx: resilient.Context) -> None:
        torch.manual_seed(0)
        model = DDP(Net(args.dim, args.depth, classes=3).to(ctx.device))
        net = torch.compile(model) if args.compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "off": None}[args.amp]
        amp_dtype = dtype or torch.float32
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp == "fp16")
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
        ctx.track(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader)
        t0 = time.perf_counter()
        for epoch in ctx.epochs(args.epochs):
            sampler.set_epoch(epoch)
            for xb, yb in ctx.steps(loader):
                step = ctx.step
                last = (step + 1) % args.accum == 0
                sync = contextlib.nullcontext() if last else model.no_sync()
                with sync:
                    with torch.autocast(ctx.device.type, dtype=amp_dtype, enabled=dtype is not None):
                        loss = F.cross_entropy(net(xb.to(ctx.device)).float(), yb.to(ctx.device))
                    scaler.scale(loss / args.accum).backward()
                if last:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
                    sched.step()
                if ctx.rank == 0 and step == 0:
                    print(f"first step {time.perf_counter() - t0:.2f} s", flush=True)
                if ctx.rank == 0 and step % 20 == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    train()


if __name__ == "__main__":
    main()
