"""Worker of benchmarks/relaunch.py: a ~1 GB training state (Linear layers + Adam moments).

    --mode resilient   under `resilient launch`: resilient.wrap; relaunched workers restore from
                       the shared-memory snapshot the launcher kept
    --mode plain       under `torchrun --max-restarts`: torch.save + fsync every --every steps,
                       torch.load of that file at start (the usual disk path)

Each completed step appends {"attempt", "step", "t", "pid"} to --progress (the driver's clock);
the built model appends {"built": true, "t", "pid"} (what the restore costs is measured after it).
The model is built at the top level, which needs no rank: a parked standby of `resilient launch`
has built it before it is promoted.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def build(gb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 2048
    layers = max(1, round(gb * 1e9 / (width * width * 4 * 3)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=False)
    model(torch.randn(2, model[0].in_features)).sum().backward()
    opt.step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["resilient", "plain"], required=True)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--progress", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, default=None)
    args = p.parse_args()

    def report(s: int) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # (a rank's: read once it has one)
        with open(args.progress, "a") as f:
            f.write(json.dumps({"attempt": attempt, "step": s, "t": time.time(), "pid": os.getpid()}) + "\n")

    model, opt = build(args.gb)
    step(model, opt)  # Adam's moments exist: the state is its full size from the start
    with open(args.progress, "a") as f:
        f.write(json.dumps({"built": True, "t": time.time(), "pid": os.getpid()}) + "\n")
    if args.mode == "resilient":
        import resilient

        @resilient.wrap(backend="gloo", snapshot={"interval": args.every}, hang_timeout=120)
        def train(ctx: resilient.Context) -> None:
            ctx.track(model=model, optimizer=opt)
            for s in ctx.steps(args.steps):
                step(model, opt)
                report(s)

        train()
        return
    start = 0
    if args.ckpt is not None and args.ckpt.exists():
        sd = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        start = int(sd["step"])
    for s in range(start, args.steps):
        step(model, opt)
        report(s)
        if args.ckpt is not None and (s + 1) % args.every == 0:
            tmp = args.ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": s + 1}, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, args.ckpt)


if __name__ == "__main__":
    main()
