"""An Accelerate training loop, written as Accelerate's examples write one, under ``resilient.wrap``.

The same small GPT-2 as examples/train_hf_trainer.py (built from a config, dropout on), a shuffled
``DataLoader``, AdamW with a cosine schedule and warm-up, ``accelerator.accumulate`` over 2
micro-batches, DDP over 2 gloo ranks on CPU. What resilience adds: the decorator, ``ctx.track``
of what ``accelerator.prepare`` returned (through ``hf.trackable``, which makes each restorable),
and ``ctx.epochs``/``ctx.steps`` around the two loops (each micro-batch one step).

    pip install "resilient[hf]"
    torchrun --standalone --nproc-per-node 2 examples/train_accelerate.py --steps 48
    resilient launch --standalone --nproc-per-node 2 examples/train_accelerate.py --steps 48
"""

from __future__ import annotations

import argparse
import math

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_cosine_schedule_with_warmup

import resilient
from resilient.integrations import hf


class Tokens(Dataset):
    """Token sequences, item ``i`` the same on every rank and in every run."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=48, help="micro-batches in all (split over the epochs)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--world", type=int, default=2, help="ranks the data set is sized for")
    p.add_argument("--seedable", action="store_true", help="accelerate's seedable sampler (default: off)")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--config", default=None, help="the runtime's YAML config")
    p.add_argument("--ckpt-dir", default=None, help="the runtime's durable checkpoints here")
    p.add_argument("--ckpt-every", type=int, default=10)
    return p.parse_args()


def main() -> None:
    args = parse()
    overrides: dict[str, object] = {}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.ckpt_dir:
        overrides["checkpoint"] = {"dir": args.ckpt_dir, "interval": args.ckpt_every}
    per_epoch = math.ceil(args.steps / args.epochs)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=args.seq,
                     bos_token_id=0, eos_token_id=0)  # fmt: skip

    @resilient.wrap(config=args.config, **overrides)
    def train(ctx: resilient.Context) -> None:
        from accelerate import DataLoaderConfiguration

        accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            gradient_accumulation_steps=args.accum,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=args.seedable),
        )
        set_seed(0)
        model = GPT2LMHeadModel(cfg)  # dropout 0.1 on embeddings, attention and residuals
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
        data = Tokens(per_epoch * args.batch * args.world, args.seq, cfg.vocab_size)
        loader = DataLoader(data, batch_size=args.batch, shuffle=True, collate_fn=default_data_collator)
        updates = args.epochs * math.ceil(per_epoch / args.accum)
        scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, updates // 10), updates)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        ctx.track(**hf.trackable(model=model, optimizer=optimizer, loader=loader, scheduler=scheduler,
                                 accelerator=accelerator))  # fmt: skip
        for epoch in ctx.epochs(args.epochs):
            model.train()
            for batch in ctx.steps(loader):  # each micro-batch one step
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            if accelerator.is_main_process:
                print(f"epoch {epoch} step {ctx.step} loss {loss.item():.4f}", flush=True)

    train()


if __name__ == "__main__":
    main()
