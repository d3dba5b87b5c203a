"""A user-style script on Hugging Face ``transformers``: a small GPT-2 built from a config (nothing
downloaded), DDP, a DataLoader with a ``DistributedSampler`` and dropout, epochs, under
``resilient.wrap``.

    pip install "resilient[hf]"    # transformers
    resilient launch --nproc-per-node 2 examples/train_hf.py --steps 200 --epochs 2

The top level only imports (``transformers`` takes seconds) and parses its arguments; everything
that needs a rank is inside ``train``. That is the contract a ``resilient launch`` standby relies
on: it runs this top level before any rank is lost and waits in the ``resilient.wrap`` call, so a
replacement does not pay for the imports (docs/launcher.md).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

import resilient
from chaos import append_line  # (the benchmarks' --progress lines)


class Tokens(Dataset):
    """Token sequences, item ``i`` the same on every rank and every run (no download)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, self.vocab, (self.seq,), generator=g)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps in all (split evenly over the epochs)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=0.0, help="pad every step to this long")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--config", default=None, help="the runtime's YAML config")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="durable checkpoints here")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--progress", type=Path, default=None, help="append a JSON line per completed step")
    p.add_argument("--out", type=Path, default=None, help="each rank's final state: <out>/rank<R>.pt")
    p.add_argument("--layers", type=int, default=2, help="GPT-2 blocks")
    p.add_argument("--width", type=int, default=64, help="GPT-2 embedding width")
    p.add_argument(
        "--prepare",
        action="store_true",
        help="build the model in resilient.wrap(prepare=...): a parked standby builds it before a fault",
    )
    return p.parse_args()


def main() -> None:
    args = parse()
    overrides: dict[str, object] = {}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.ckpt_dir is not None:
        overrides["checkpoint"] = {"dir": args.ckpt_dir, "interval": args.ckpt_every}

    cfg = GPT2Config(n_layer=args.layers, n_head=2, n_embd=args.width, vocab_size=512, n_positions=args.seq,
                     bos_token_id=0, eos_token_id=0)  # fmt: skip

    def build() -> GPT2LMHeadModel:
        """The model, built without a rank: ``--prepare`` hands it to resilient.wrap, and a parked
        standby builds it before it is promoted (its weights are then the restored ones)."""
        with torch.random.fork_rng():  # (built ahead in a standby: the run's random stream stays)
            torch.manual_seed(0)
            return GPT2LMHeadModel(cfg)

    @resilient.wrap(config=args.config, prepare=build if args.prepare else None, **overrides)
    def train(ctx: resilient.Context) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = DDP((ctx.prepared if args.prepare else GPT2LMHeadModel(cfg)).to(ctx.device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        per_epoch = math.ceil(args.steps / args.epochs)
        data = Tokens(per_epoch * args.batch * world, args.seq, cfg.vocab_size)
        loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, seed=0))
        ctx.track(model=model, optimizer=opt, loader=loader)
        for epoch in ctx.epochs(args.epochs):
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            for batch in ctx.steps(loader):
                t0 = time.perf_counter()
                batch = batch.to(ctx.device)
                loss = model(input_ids=batch, labels=batch).loss  # dropout: the tracked RNG
                ctx.observe(loss=loss)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if args.step_ms:
                    time.sleep(max(0.0, args.step_ms / 1e3 - (time.perf_counter() - t0)))
                if args.progress is not None:
                    append_line(
                        args.progress, {"t": time.time(), "step": ctx.step, "rank": rank, "pid": os.getpid()}
                    )
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict()}
            torch.save(state, args.out / f"rank{rank}.pt")

    train()


if __name__ == "__main__":
    main()
