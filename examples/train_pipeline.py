"""A small decoder trained with pipeline parallelism (``torch.distributed.pipelining``), made
resilient with the README's three lines.

Written the way pipeline scripts usually are: the model is built whole from one seed and each
rank keeps its stages' layers (the embedding on the first stage, the head on the last: the whole
model's parameter names, torchtitan's manual split), a ``PipelineStage`` per stage, a microbatch
schedule (``Schedule1F1B``, ``ScheduleGPipe``, or ``ScheduleInterleaved1F1B`` with several stages
per rank), an optimizer and an LR scheduler per stage, dropout, a ``DataLoader``; with ``--dp``
each pipeline is replicated on a ``DeviceMesh`` (``pp`` x ``dp``) and each stage is data-parallel
over ``dp`` (DDP, or FSDP2 with ``--dp-mode fsdp``). The loss exists only on the last stage.

    torchrun --standalone --nproc-per-node 2 examples/train_pipeline.py --steps 40     # 2 stages, 1F1B
    torchrun --standalone --nproc-per-node 4 examples/train_pipeline.py --stages-per-rank 2 --layers 8
                                                                  # 8 stages, interleaved 1F1B
    resilient launch --standalone --nproc-per-node 4 examples/train_pipeline.py --dp 2
                                                                  # 2 stages x 2 DDP replicas

What a pipeline script does for the runtime (docs/training-stacks.md#pipeline-parallelism):

- build the stages (``PipelineStage``) and the schedule **inside** the wrapped function: after a
  fault the function runs again on the new generation's process group, and a stage built on the
  old one would send on dead connections (they hold no training state: nothing is lost);
- give each ``PipelineStage`` its microbatch shapes (``input_args``/``output_args``, here
  :func:`stage_shapes`): a stage that infers them runs its module once at its first step (under
  DDP outside ``no_sync``), so a stage built again after a restart starts from other gradients
  than the one it replaces (measured ~1e-5 apart), and the run no longer ends bit for bit;
- track each stage's module, optimizer and scheduler (and the loader) by a name that is the same
  on every entry; keep the whole model's parameter names in each stage, so that a checkpoint says
  which layers each rank held (a checkpoint written under another layout is refused, naming both).

Faults to try it with come from the chaos harness (docs/chaos.md), inside a microbatch too:
``CHAOS_PLAN=exception@12:1/backward2`` (rank 1 raises in microbatch 2's backward),
``hang@12:0/forward1``, ``p2p_skip@12:0/forward1`` (stage 0 never sends microbatch 1).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

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


class Decoder(nn.Module):
    """The whole model; a stage is a copy with the layers it does not own set to None
    (torchtitan's manual split), so its parameter names are the whole model's."""

    def __init__(self, dim: int, layers: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, dim)
        self.pos: nn.Parameter | None = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads, dropout) for i in range(layers)})
        self.norm: nn.Module | None = nn.LayerNorm(dim)
        self.head: nn.Module | None = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:  # the first stage: tokens in
            assert self.pos is not None
            x = self.drop(self.embed(x) + self.pos[: x.shape[1]])
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:  # the last stage: logits out
            assert self.norm is not None
            x = self.head(self.norm(x))
        return x


def stage_module(whole: Decoder, stage: int, stages: int) -> Decoder:
    """Stage ``stage`` of ``stages``: its share of the blocks, the embedding first, the head last."""
    m = copy.deepcopy(whole)
    per = len(whole.blocks) // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(m.blocks):
        if name not in keep:
            del m.blocks[name]
    if stage != 0:
        m.embed, m.pos = None, None
    if stage != stages - 1:
        m.norm, m.head = None, None
    return m


def stage_shapes(idx: int, stages: int, mb: int, seq: int, dim: int, device: torch.device) -> dict[str, Any]:
    """Stage ``idx``'s microbatch inputs and outputs, given up front (``PipelineStage``'s static
    metadata). Without them a new stage infers them at its first step by running its module
    (``DDP.forward`` outside ``no_sync``): a stage built again after a restart then computes its
    first step's gradients differently from the stage it replaces (measured: ~1e-5 apart with
    DDP over 2 replicas), and the run no longer ends bit for bit where a fault-free run ends."""
    hidden = torch.empty(mb, seq, dim, device=device)
    inputs = (torch.zeros(mb, seq, dtype=torch.long, device=device),) if idx == 0 else (hidden,)
    outputs = (torch.empty(mb, seq, VOCAB, device=device),) if idx == stages - 1 else (hidden,)
    shapes: dict[str, Any] = {"input_args": inputs, "output_args": outputs}
    shapes["input_grads"] = (None,) if idx == 0 else (hidden,)
    if idx != stages - 1:
        shapes["output_grads"] = (hidden,)
    return shapes


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    p.add_argument("--stages-per-rank", type=int, default=1, help="stages per rank (>1: interleaved 1F1B)")
    p.add_argument(
        "--schedule", default=None, choices=["gpipe", "1f1b", "interleaved"],
        help="default: 1f1b, interleaved with --stages-per-rank > 1",
    )  # fmt: skip
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4, help="decoder blocks, split evenly over the stages")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="per replica, split into --microbatches")
    p.add_argument("--samples", type=int, default=256, help="dataset size (an epoch: samples/dp/batch steps)")
    p.add_argument("--dp-mode", default="ddp", choices=["ddp", "fsdp"], help="how a stage is replicated")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per rank")
    p.add_argument("--config", default=None, help="a resilient config file (configs/default.yaml)")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="durable checkpoints (each rank's stages)")
    p.add_argument("--ckpt-every", type=int, default=10)
    return p.parse_args()


def main() -> None:
    args = parse()
    overrides: dict[str, Any] = {"backend": args.backend}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.ckpt_dir is not None:
        overrides["checkpoint"] = {"dir": args.ckpt_dir, "interval": args.ckpt_every}

    def train(ctx: Any) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        assert world % args.dp == 0, f"{world} ranks do not split into {args.dp} replicas"
        pp = world // args.dp
        stages = pp * args.stages_per_rank
        assert args.layers % stages == 0, f"--layers {args.layers} do not split into {stages} stages"
        schedule = args.schedule or ("interleaved" if args.stages_per_rank > 1 else "1f1b")
        # ranks r*dp .. r*dp+dp-1 hold pipeline rank r: a stage's replicas are neighbours
        device = ctx.device  # (cuda:<local rank> on NCCL)
        mesh = init_device_mesh(device.type, (pp, args.dp), mesh_dim_names=("pp", "dp"))
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        pp_group = mesh.get_group("pp")

        with torch.random.fork_rng():  # every rank builds the same whole model, keeps its stages
            torch.manual_seed(0)
            whole = Decoder(args.dim, args.layers, 4, args.seq, dropout=0.1)
        torch.manual_seed(1 + rank)  # this rank's dropout stream (tracked by the runtime)
        ids = [pp_rank + v * pp for v in range(args.stages_per_rank)]  # interleaved: loop placement
        modules, pipeline_stages, opts, scheds = [], [], [], []
        for idx in ids:
            m: nn.Module = stage_module(whole, idx, stages).to(device)
            if args.dp > 1 and args.dp_mode == "ddp":
                m = DDP(m, process_group=mesh.get_group("dp"))
            elif args.dp > 1:
                from torch.distributed.fsdp import fully_shard

                fully_shard(m, mesh=mesh["dp"])
            assert args.batch % args.microbatches == 0, "--batch must split into --microbatches"
            mb = args.batch // args.microbatches
            shapes = stage_shapes(idx, stages, mb, args.seq, args.dim, device)
            st = PipelineStage(m, idx, stages, device, group=pp_group, **shapes)
            opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
            modules.append(m)
            pipeline_stages.append(st)
            opts.append(opt)
            scheds.append(sched)
        del whole

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

        n_mb = args.microbatches
        if schedule == "interleaved":
            pipe: Any = ScheduleInterleaved1F1B(pipeline_stages, n_microbatches=n_mb, loss_fn=loss_fn)
        else:
            kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            assert args.stages_per_rank == 1, f"{schedule} runs one stage per rank"
            pipe = kind(pipeline_stages[0], n_microbatches=n_mb, loss_fn=loss_fn)

        # the data: every rank of a pipeline reads its replica's batches (the first stage the
        # tokens, the last the targets), shuffled per epoch
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, VOCAB, (args.samples, 1), generator=g)
        tokens = (start + torch.arange(args.seq + 1)) % VOCAB  # next token = token + 1
        noise = torch.rand(tokens.shape, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
        dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        sampler = DistributedSampler(dataset, num_replicas=args.dp, rank=dp_rank, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)

        ctx.track(
            **{f"stage{v}": m for v, m in enumerate(modules)},
            **{f"optimizer{v}": o for v, o in enumerate(opts)},
            **{f"scheduler{v}": s for v, s in enumerate(scheds)},
            loader=loader,
        )
        first, last = 0 in ids, stages - 1 in ids
        per, batches = len(loader), None
        for step in ctx.steps(args.steps):
            if batches is None or step % per == 0:  # an epoch's start, or the entry after a restore
                sampler.set_epoch(step // per)
                batches = iter(loader)
            x, y = (t.to(device) for t in next(batches))
            for o in opts:
                o.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if first and last:  # (interleaved: this rank holds the first and the last stage)
                pipe.step(x, target=y, losses=losses)
            elif first:
                pipe.step(x)
            elif last:
                pipe.step(target=y, losses=losses)
            else:
                pipe.step()
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
            if last and dp_rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                loss = torch.stack(losses).mean().item()
                print(f"step {step:4d} loss {loss:.4f} gen {ctx.generation} (rank {rank})", flush=True)

    resilient.wrap(config=args.config, **overrides)(train)()


if __name__ == "__main__":
    main()
