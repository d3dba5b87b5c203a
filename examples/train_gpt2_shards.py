"""A GPT-2 trainer in the shape of the popular single-file reproduction scripts, adapted from the
README alone: a hand-written loader over ``.npy`` token shards whose position lives in plain
attributes, gradient accumulation that sets DDP's ``require_backward_grad_sync`` at every
micro-step, bf16 autocast, a cosine schedule computed from the step, validation, sampling and a
checkpoint of its own every N steps, a log file opened with ``"w"``, a ``master_process`` global.

What the adaptation needed (docs/recovery.md#a-hand-written-loader):

- the loop in a function decorated with ``resilient.wrap`` (no ``init_process_group``;
  ``destroy_process_group()`` at its end stays: the runtime's group outlives it);
- ``DataLoaderLite`` given a ``state_dict``/``load_state_dict`` (ten lines) and tracked with the
  model and optimizer (``--untracked`` leaves it out, as the script was: the runtime names it
  within the first steps, and a fault then changes the run);
- ``for step in ctx.steps(max_steps)`` for ``for step in range(max_steps)``;
- the log opened ``"w"`` under ``ctx.job_start`` only (``"a"`` after any fault), so a
  restart never truncates it.

    resilient launch --standalone --nproc-per-node 2 examples/train_gpt2_shards.py
    resilient launch --standalone --nproc-per-node 2 --fault exception@23:1 examples/train_gpt2_shards.py
    chaos certify configs/chaos/script.yaml --steps 60 --out /tmp/cert -- examples/train_gpt2_shards.py
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient

master_process = True  # set in the training function (rank 0 logs, samples and saves)


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1  # type: ignore[assignment]
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "h": nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                "ln_f": nn.LayerNorm(config.n_embd),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02 * (2 * self.config.n_layer) ** -0.5 if hasattr(module, "NANOGPT_SCALE_INIT") else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = (
            None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        )
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8)


def prepare_shards(data_dir: Path, vocab: int, shards: int = 3, tokens: int = 6000) -> None:
    """Token shards as the popular scripts' data preparation writes them (``uint16`` ``.npy``):
    made once, deterministically; each rank writes its own temporary file and renames it, so
    concurrent ranks never read a half-written shard."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)
    for split in ("train", "val"):
        for i in range(shards if split == "train" else 1):
            path = data_dir / f"shard_{split}_{i:06d}.npy"
            toks = (np.cumsum(rng.integers(1, 7, size=tokens)) % vocab).astype(np.uint16)
            if not path.exists():
                tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
                np.save(tmp, toks)
                os.replace(tmp, path)


def load_tokens(filename: str) -> torch.Tensor:
    return torch.tensor(np.load(filename).astype(np.int32), dtype=torch.long)


class DataLoaderLite:
    def __init__(
        self, B: int, T: int, process_rank: int, num_processes: int, split: str, data_root: str
    ) -> None:
        self.B, self.T = B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        shards = sorted(s for s in os.listdir(data_root) if split in s and s.endswith(".npy"))
        self.shards = [os.path.join(data_root, s) for s in shards]
        assert len(self.shards) > 0, f"no shards found for split {split}"
        self.reset()

    def reset(self) -> None:
        self.current_shard = 0
        self.tokens = load_tokens(self.shards[self.current_shard])
        self.current_position = self.B * self.T * self.process_rank

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.B, self.T
        buf = self.tokens[self.current_position : self.current_position + B * T + 1]
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        self.current_position += B * T * self.num_processes
        if self.current_position + (B * T * self.num_processes + 1) > len(self.tokens):
            self.current_shard = (self.current_shard + 1) % len(self.shards)
            self.tokens = load_tokens(self.shards[self.current_shard])
            self.current_position = B * T * self.process_rank
        return x, y

    # what the runtime needs to restore it (docs/recovery.md#a-hand-written-loader)
    def state_dict(self) -> dict[str, int]:
        return {"current_shard": self.current_shard, "current_position": self.current_position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["current_shard"] != self.current_shard:
            self.tokens = load_tokens(self.shards[state["current_shard"]])
        self.current_shard = state["current_shard"]
        self.current_position = state["current_position"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--val-every", type=int, default=15)
    p.add_argument("--save-every", type=int, default=20, help="the script's own checkpoint (log dir)")
    p.add_argument("--log-dir", type=Path, default=Path("log_gpt2"))
    p.add_argument("--data-dir", type=Path, default=Path("gpt2_shards"))
    p.add_argument("--untracked", action="store_true", help="leave the loader untracked, as the script was")
    p.add_argument("--step-ms", type=float, default=0.0, help="pad each step (a bigger model's compute)")
    p.add_argument("--hang-timeout", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=None, help="the final model and optimizer per rank")
    args = p.parse_args()
    config = GPTConfig(block_size=args.seq)
    prepare_shards(args.data_dir, config.vocab_size)
    max_lr, min_lr, warmup_steps = 6e-3, 6e-4, 5

    def get_lr(it: int) -> float:
        if it < warmup_steps:
            return max_lr * (it + 1) / warmup_steps
        ratio = min(1.0, (it - warmup_steps) / max(1, args.steps - warmup_steps))
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)

    @resilient.wrap(hang_timeout=args.hang_timeout)
    def train(ctx: resilient.Context) -> None:
        global master_process
        ddp_rank, ddp_world_size = ctx.rank, ctx.world_size
        master_process = ddp_rank == 0
        device = ctx.device
        torch.manual_seed(1337)
        train_loader = DataLoaderLite(
            args.micro_batch, args.seq, ddp_rank, ddp_world_size, "train", str(args.data_dir)
        )
        val_loader = DataLoaderLite(
            args.micro_batch, args.seq, ddp_rank, ddp_world_size, "val", str(args.data_dir)
        )
        model = DDP(GPT(config).to(device))
        raw_model = model.module
        optimizer = raw_model.configure_optimizers(weight_decay=0.1, learning_rate=max_lr)
        if args.untracked:
            ctx.track(model=model, optimizer=optimizer)
        else:
            ctx.track(model=model, optimizer=optimizer, train_loader=train_loader)
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = args.log_dir / "log.txt"
        with open(log_file, "w" if ctx.job_start else "a") as f:  # (a restart appends)
            for step in ctx.steps(args.steps):
                t0 = time.time()
                last_step = step == args.steps - 1
                if step % args.val_every == 0 or last_step:
                    validate(model, val_loader, device, step, f)
                saving = (step > 0 and step % args.save_every == 0) or last_step
                if saving and master_process:
                    ckpt = {"model": raw_model.state_dict(), "config": config, "step": step}
                    torch.save(ckpt, args.log_dir / f"model_{step:05d}.pt")
                if step % args.val_every == 0 and step > 0:
                    sample(model, device, ddp_rank, config)
                model.train()
                optimizer.zero_grad()
                loss_accum = torch.zeros((), device=device)
                for micro_step in range(args.grad_accum):
                    x, y = train_loader.next_batch()
                    x, y = x.to(device), y.to(device)
                    model.require_backward_grad_sync = micro_step == args.grad_accum - 1
                    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                        _, loss = model(x, y)
                    loss = loss / args.grad_accum
                    loss_accum += loss.detach()
                    loss.backward()
                dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)
                loss_accum /= ddp_world_size
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                lr = get_lr(step)
                for param_group in optimizer.param_groups:
                    param_group["lr"] = lr
                optimizer.step()
                if args.step_ms:
                    time.sleep(max(0.0, args.step_ms / 1e3 - (time.time() - t0)))
                if master_process:
                    msg = f"step {step:5d} | loss {loss_accum.item():.6f} | lr {lr:.4e} | norm {norm:.4f}"
                    print(msg, flush=True)
                    f.write(f"{step} train {loss_accum.item():.6f}\n")
                    f.flush()
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, args.out / f"rank{ddp_rank}.pt")
        dist.destroy_process_group()

    train()


def validate(model: nn.Module, val_loader: DataLoaderLite, device: torch.device, step: int, f) -> None:  # type: ignore[no-untyped-def]
    model.eval()
    val_loader.reset()
    with torch.no_grad():
        val_loss_accum = torch.zeros((), device=device)
        val_loss_steps = 4
        for _ in range(val_loss_steps):
            x, y = val_loader.next_batch()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                _, loss = model(x.to(device), y.to(device))
            val_loss_accum += loss.detach() / val_loss_steps
    dist.all_reduce(val_loss_accum, op=dist.ReduceOp.SUM)
    val_loss_accum /= dist.get_world_size()
    if master_process:
        print(f"validation loss: {val_loss_accum.item():.4f}", flush=True)
        f.write(f"{step} val {val_loss_accum.item():.4f}\n")


def sample(model: nn.Module, device: torch.device, ddp_rank: int, config: GPTConfig) -> None:
    model.eval()
    xgen = torch.zeros((2, 1), dtype=torch.long, device=device)
    sample_rng = torch.Generator(device=device)
    sample_rng.manual_seed(42 + ddp_rank)
    while xgen.size(1) < 12:
        with torch.no_grad():
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                logits, _ = model(xgen)
            probs = F.softmax(logits[:, -1, :].float(), dim=-1)
            topk_probs, topk_indices = torch.topk(probs, 8, dim=-1)
            ix = torch.multinomial(topk_probs, 1, generator=sample_rng)
            xgen = torch.cat((xgen, torch.gather(topk_indices, -1, ix)), dim=1)
    if master_process:
        print(f"rank {ddp_rank} sample: {xgen[0].tolist()}", flush=True)


if __name__ == "__main__":
    main()
