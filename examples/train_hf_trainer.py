"""A Hugging Face ``Trainer`` script, written as its docs write one, made resilient by one line.

A small GPT-2 built from a config (nothing downloaded, dropout on), a shuffled synthetic token set,
AdamW with a cosine schedule and warm-up, gradient accumulation, DDP over 2 gloo ranks on CPU,
the Trainer's own logging (and checkpoints with ``--hf-save-every``). The one added line is
``@hf.wrap(...)`` on the function that builds the Trainer and calls ``trainer.train()``.

    pip install "resilient[hf]"
    torchrun --standalone --nproc-per-node 2 examples/train_hf_trainer.py --steps 40
    resilient launch --standalone --nproc-per-node 2 examples/train_hf_trainer.py --steps 40

Everything that needs a rank (``TrainingArguments`` reads it, the Trainer sets up DDP) is inside
the decorated function; the top level only imports and parses arguments, which a parked standby
of ``resilient launch`` does before any fault (docs/hf.md).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from resilient.integrations import hf


class Tokens(Dataset):
    """Token sequences, item ``i`` the same on every rank and in every run."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)  # (iterating the set, as the length-grouped sampler does, ends here)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (TrainingArguments.max_steps)")
    p.add_argument("--epochs", type=int, default=2, help="the data set is sized for this many epochs")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-batch")
    p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--world", type=int, default=2, help="ranks the data set is sized for")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--hf-save-every", type=int, default=0, help="the Trainer's own checkpoints (0: none)")
    p.add_argument("--output-dir", type=Path, default=Path("hf_out"))
    p.add_argument("--resume-from-checkpoint", default=None, help="a Trainer checkpoint to start from")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument(
        "--sampler",
        choices=("seedable", "random", "group_by_length"),
        default="seedable",
        help="accelerate's seedable sampler (the Trainer's default), a RandomSampler with accelerate's "
        "synchronized generator, or the Trainer's length-grouped sampler",
    )
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
    per_epoch = math.ceil(args.steps / args.epochs) * args.accum * args.batch * args.world
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=args.seq,
                     bos_token_id=0, eos_token_id=0)  # fmt: skip

    @hf.wrap(config=args.config, **overrides)  # the one line: every trainer.train() inside recovers
    def train() -> None:
        training_args = TrainingArguments(
            output_dir=str(args.output_dir),
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=args.batch,
            gradient_accumulation_steps=args.accum,
            learning_rate=2e-3,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.steps // 10),
            weight_decay=0.01,
            seed=0,
            bf16=args.bf16,
            dataloader_num_workers=args.workers,
            train_sampling_strategy="group_by_length" if args.sampler == "group_by_length" else "random",
            accelerator_config={"use_seedable_sampler": args.sampler == "seedable"},
            logging_steps=5,
            eval_strategy="steps" if args.eval_every else "no",
            eval_steps=args.eval_every or None,
            save_strategy="steps" if args.hf_save_every else "no",
            save_steps=args.hf_save_every or 500,
            report_to="none",
            disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(),  # (the Trainer runs DDP on CPU only when told)
        )
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)  # dropout 0.1 on embeddings, attention and residuals
        evaluated = Tokens(4 * args.batch * args.world, args.seq, cfg.vocab_size)
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=Tokens(per_epoch, args.seq, cfg.vocab_size),
            eval_dataset=evaluated if args.eval_every else None,
        )
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)

    train()


if __name__ == "__main__":
    main()
