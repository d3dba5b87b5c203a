"""A single-file GPT trainer in the style many people start from (globals for its config, a
configurator exec'd from its own directory, token files read with np.memmap, the next batch
prefetched inside the step, a best validation loss kept between evaluations), adapted to the
runtime as the README says: the loop in a decorated function, no ``init_process_group``, its state
tracked, ``ctx.steps`` for the iterations, and the values it carries between steps in
``ctx.carry`` (``carry = False`` keeps them in locals, as the script was: a fault then silently
changes the run; docs/recovery.md#what-the-runtime-cannot-see).

    python prepare.py                                   # data/train.bin, data/val.bin
    resilient launch --standalone --nproc-per-node 2 train.py config/tiny.py
    chaos certify ../../configs/chaos/cpu.yaml --classes exception,sigkill -- train.py config/tiny.py

Run it from this directory: its configurator and data are found by relative paths.
"""

import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient

# -----------------------------------------------------------------------------
# default config values
out_dir = "out"
eval_interval = 20
eval_iters = 4
always_save_checkpoint = False
data_dir = "data"
gradient_accumulation_steps = 1
batch_size = 8
block_size = 32
vocab_size = 128
n_layer = 2
n_head = 2
n_embd = 64
dropout = 0.1
learning_rate = 3e-3
max_iters = 60
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
warmup_iters = 10
min_lr = 3e-4
step_ms = 0.0  # pad each iteration to this long (a stand-in for a bigger model's compute)
carry = True  # the prefetched batch and the best loss in ctx.carry (False: in locals)
hang_timeout = 10.0
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, int | float | bool | str)]
exec(open("configurator.py").read())  # overrides from the command line or a config file
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    # recreate np.memmap every batch to avoid a memory leak, as the original does
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (learning_rate - min_lr)


@resilient.wrap(hang_timeout=hang_timeout)
def train(ctx: resilient.Context) -> None:
    master_process = dist.get_rank() == 0
    torch.manual_seed(1337)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(beta1, beta2),
                                  weight_decay=weight_decay)  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # (float16 only)
    if dist.get_world_size() > 1:
        model = DDP(model)
    raw_model = model.module if isinstance(model, DDP) else model
    ctx.track(model=model, optimizer=optimizer, scaler=scaler)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                x, y = get_batch(split)
                _, loss = model(x, y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    if carry:  # the values carried from one iteration to the next, restored with the rest
        kept = ctx.carry(batch=get_batch("train"), best_val_loss=1e9)
    else:
        X, Y = get_batch("train")  # fetch the very first batch
        best_val_loss = 1e9
    t0 = time.time()
    for iter_num in ctx.steps(max_iters + 1):
        started = time.perf_counter()
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0:
            losses = estimate_loss()
            if master_process:
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            best = kept.best_val_loss if carry else best_val_loss
            if losses["val"] < best or always_save_checkpoint:
                if carry:
                    kept.best_val_loss = losses["val"]
                else:
                    best_val_loss = losses["val"]
                if iter_num > 0 and master_process:
                    checkpoint = {"model": raw_model.state_dict(), "iter_num": iter_num, "config": config}
                    os.makedirs(out_dir, exist_ok=True)
                    torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
        for micro_step in range(gradient_accumulation_steps):
            if isinstance(model, DDP):
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            x, y = kept.batch if carry else (X, Y)
            _, loss = model(x, y)
            loss = loss / gradient_accumulation_steps
            # immediately async prefetch next batch while model is doing the forward pass
            if carry:
                kept.batch = get_batch("train")
            else:
                X, Y = get_batch("train")
            if step_ms:  # (the compute a bigger model would spend here, before its backward)
                time.sleep(max(0.0, step_ms / 1e3 - (time.perf_counter() - started)))
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if master_process and iter_num % 10 == 0:
            print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, "
                  f"{(time.time() - t0) * 1000:.0f} ms")  # fmt: skip
            t0 = time.time()


if __name__ == "__main__":
    train()
