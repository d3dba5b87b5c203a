"""An FSDP2 transformer LM made resilient with the README's three lines.

Written the way FSDP2 scripts usually are: ``fully_shard`` on every block and then on the root,
AdamW, ``clip_grad_norm_``, bf16 autocast, dropout, a cosine schedule. The runtime keeps each
rank's local shards (model and optimizer) and restores them into the rebuilt sharded model.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp2.py --steps 40
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp2.py --hsdp   # 2-D mesh (HSDP)
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp2.py --tp     # 2-D mesh (FSDP + TP)
    resilient launch --standalone --nproc-per-node 2 examples/train_fsdp2.py --steps 40
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import resilient

VOCAB = 128


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> None:
    """clip_grad_norm_ for FSDP + TP: its gradients live on two meshes, which torch's refuses to stack."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(
        torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms])
    )
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    for g in grads:
        g.mul_(coef)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hsdp", action="store_true", help="a 2-D mesh: replicas of 2-way shards (HSDP)")
    p.add_argument("--tp", action="store_true", help="a 2-D mesh: 2-way tensor parallel MLPs, FSDP across")
    p.add_argument("--config", default=None, help="a resilient config file (configs/default.yaml)")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--ckpt-dir", default=None, help="durable checkpoints (each rank's shards) here")
    p.add_argument("--ckpt-every", type=int, default=10)
    args = p.parse_args()
    overrides: dict[str, object] = {}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.ckpt_dir:
        overrides["checkpoint"] = {"dir": args.ckpt_dir, "interval": args.ckpt_every}

    @resilient.wrap(config=args.config, **overrides)
    def train(ctx: resilient.Context) -> None:
        torch.manual_seed(0)  # every rank builds the same initial weights, then keeps its shard
        if args.hsdp:  # shard within groups of 2, replicate across them
            mesh = init_device_mesh(
                ctx.device.type, (ctx.world_size // 2, 2), mesh_dim_names=("replicate", "shard")
            )
        elif args.tp:  # FSDP across the first dimension, tensor parallel within pairs
            mesh2d = init_device_mesh(ctx.device.type, (ctx.world_size // 2, 2), mesh_dim_names=("dp", "tp"))
            mesh = mesh2d["dp"]
        else:
            mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        model = LM(args.dim, args.layers, 4, args.seq, dropout=0.1)
        for block in model.blocks:
            if args.tp:
                plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
                parallelize_module(block, mesh2d["tp"], plan)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
        # ranks of one HSDP shard group, or of one tensor-parallel pair, read the same tokens
        replica = ctx.rank // 2 if args.hsdp or args.tp else ctx.rank
        data = torch.Generator().manual_seed(1000 + replica)  # this rank's token stream
        ctx.track(model=model, optimizer=opt, scheduler=sched, data=data)
        for step in ctx.steps(args.steps):
            tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=data)
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            if args.tp:
                clip_grad_norm(list(model.parameters()), 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if ctx.rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)

    train()


if __name__ == "__main__":
    main()
