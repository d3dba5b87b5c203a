"""A tiny transformer LM trained with DDP on synthetic tokens, made resilient by three lines.

Run (2 ranks, gloo, a few seconds):
    torchrun --standalone --nproc-per-node 2 examples/train_tiny.py --steps 40
Inject faults (kind@step[:rank], see chaos/inject.py):
    torchrun --standalone --nproc-per-node 2 examples/train_tiny.py \
        --fault exception@12:1,hang@25:0 --hang-timeout 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import resilient
from chaos import Injector, append_line


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2, seq: int = 16
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


class Tokens:
    """Synthetic data stream: a seeded generator, its position is its state (tracked)."""

    def __init__(self, seed: int, batch: int = 8, seq: int = 16, vocab: int = 64) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.batch, self.seq, self.vocab = batch, seq, vocab
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        # a learnable pattern: next token = (token + 1) mod vocab, with noise
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=self.gen)
        seq = (start + torch.arange(self.seq + 1)) % self.vocab
        noise = torch.rand(seq.shape, generator=self.gen) < 0.1
        seq = torch.where(noise, torch.randint(0, self.vocab, seq.shape, generator=self.gen), seq)
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self) -> dict[str, object]:
        return {"gen": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.gen.set_state(sd["gen"])  # type: ignore[arg-type]
        self.position = int(sd["position"])  # type: ignore[call-overload]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--fault", default=os.environ.get("RESILIENT_FAULT", ""), help="fault plan, see chaos/inject.py"
    )
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--collective-timeout", type=float, default=None)
    p.add_argument("--max-repeats", type=int, default=None)
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="pad each step to this duration (compute stand-in)"
    )
    p.add_argument(
        "--pad-at", default="tail", choices=["tail", "forward"],
        help="where the padding sleeps: after the optimizer step, or before the backward (where a real "
        "step spends its time)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write final model+optimizer state here (per rank)")
    p.add_argument("--dim", type=int, default=32, help="model width (benchmarks use a wider model)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--plain", action="store_true", help="run the same loop without resilient (baseline)")
    p.add_argument(
        "--engine", default=None, choices=["resilient", "nvrx"], help="nvrx: NVRx's in-process Wrapper"
    )
    p.add_argument(
        "--progress",
        type=Path,
        default=None,
        help="append a JSON line per completed step (time, step, rank, pid, launch attempt) here",
    )
    p.add_argument(
        "--backend", default="gloo", choices=["gloo", "nccl", "auto"], help="nccl: one GPU per rank"
    )
    p.add_argument(
        "--fault-attempt",
        type=int,
        default=None,
        help="inject only in this launch attempt (relaunches: 1, 2...; a process that replaced a "
        "dead rank counts as the next attempt)",
    )
    p.add_argument("--ckpt-dir", type=Path, default=None, help="durable checkpoints here (resume from them)")
    p.add_argument("--ckpt-every", default="10", help="checkpoint every N steps, or 'auto'")
    p.add_argument("--ckpt-keep", type=int, default=3)
    p.add_argument("--ckpt-writer", default="thread", choices=["thread", "process"])
    p.add_argument(
        "--plain-ckpt",
        default="torch",
        choices=["torch", "dcp-async"],
        help="--plain's checkpoints: torch.save per rank, or torch.distributed.checkpoint.async_save",
    )
    p.add_argument("--report", action="store_true", help="rank 0 prints a JSON line with loop timing")
    p.add_argument(
        "--prepare",
        action="store_true",
        help="build the model in resilient.wrap(prepare=...): a parked standby builds it before a fault",
    )
    return p.parse_args()


def _attempt() -> int:
    """This process's launch attempt. Read inside the wrapped function, where a rank's variables
    are: a `resilient launch` standby runs the top level before it knows whose rank it takes."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("RESILIENT_JOIN_GENERATION"):  # `resilient launch` replaced a dead rank with us
        attempt += 1
    return attempt


def main() -> None:
    args = parse()
    injectors: list[Injector] = []  # one per process, made at the first entry: outlives restarts

    def fault_plan() -> Injector:
        if not injectors:  # each fault fires as often as planned, in the planned attempt
            attempt = _attempt()
            planned = args.fault if args.fault_attempt is None or args.fault_attempt == attempt else ""
            injectors.append(Injector.parse(planned))
        return injectors[0]

    overrides: dict[str, object] = {}
    if args.hang_timeout is not None:
        overrides["hang_timeout"] = args.hang_timeout
    if args.collective_timeout is not None:
        overrides["collective_timeout"] = args.collective_timeout
    overrides["backend"] = args.backend
    if args.engine is not None:
        overrides["engine"] = args.engine
    if args.max_repeats is not None:
        overrides["restart"] = {"max_repeats": args.max_repeats}
    if args.ckpt_dir is not None:
        every = args.ckpt_every if args.ckpt_every == "auto" else int(args.ckpt_every)
        overrides["checkpoint"] = {
            "dir": args.ckpt_dir,
            "interval": every,
            "keep": args.ckpt_keep,
            "writer": args.ckpt_writer,
        }

    def build() -> tuple[TinyLM, float]:
        """The model, built without a rank (and when): ``--prepare`` hands it to resilient.wrap."""
        with torch.random.fork_rng():  # (built ahead in a standby: the run's random stream stays)
            torch.manual_seed(0)
            return TinyLM(dim=args.dim, seq=args.seq), time.time()

    def train(ctx: resilient.Context) -> None:
        rank, injector, attempt = dist.get_rank(), fault_plan(), _attempt()
        torch.manual_seed(0)
        device = ctx.device
        built, built_at = ctx.prepared if args.prepare else (TinyLM(dim=args.dim, seq=args.seq), None)
        model = DDP(built.to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
        )
        data = Tokens(seed=1000 + rank, seq=args.seq)
        ctx.track(model=model, optimizer=opt, scheduler=sched, data=data)  # (2) track state
        t_loop, cpu_loop = None, 0.0
        for step in ctx.steps(args.steps):  # (3) resumable steps
            if step == min(5, args.steps - 1):
                t_loop, cpu_loop = time.perf_counter(), time.process_time()
            t0 = time.perf_counter()
            x, y = (t.to(device) for t in data.next())
            injector.maybe_fire(rank, step, objects=[model])  # (desync: its gradient sync)
            logits = model(x)  # dropout draws from the (tracked) torch RNG
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            injector.maybe_fire(rank, step, "before_collective")
            if args.step_ms and args.pad_at == "forward":
                time.sleep(max(0.0, args.step_ms / 1e3 - (time.perf_counter() - t0)))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduce
            opt.step()
            sched.step()
            if rank == 0 and not args.report and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d} loss {loss.item():.4f} gen {ctx.generation}", flush=True)
            if args.step_ms and args.pad_at == "tail":
                time.sleep(max(0.0, args.step_ms / 1e3 - (time.perf_counter() - t0)))
            if args.progress is not None:
                # (the process's CPU time: what a step costs the worker, beside its wall time)
                line = {"t": time.time(), "step": step, "rank": rank, "pid": os.getpid(), "attempt": attempt}
                append_line(args.progress, {**line, "cpu": time.process_time()})
            if isinstance(ctx, _Plain):  # the plain baseline checkpoints by itself
                ctx.completed(step)
        if args.report and rank == 0 and t_loop is not None:
            n = args.steps - min(5, args.steps - 1)
            cpu_s = time.process_time() - cpu_loop  # every thread of this rank's process
            report = {"loop_s": time.perf_counter() - t_loop, "cpu_s": cpu_s, "steps": n}
            print(json.dumps(report), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": opt.state_dict(),
                    "fired": injector.counts(),
                    "built_at": built_at,
                },
                args.out / f"rank{rank}.pt",
            )

    if args.plain:  # the same loop with no runtime: the baseline, and torchrun's usual path
        # the same collective timeout the runtime would use (2 × hang timeout), else torch's 30 min
        ct = args.collective_timeout or (2 * args.hang_timeout if args.hang_timeout else 1800.0)
        timeout = datetime.timedelta(seconds=ct)
        # torchrun --standalone keeps one store across restarts: plain init_process_group() of a
        # relaunched job can read the dead attempt's gloo addresses (connectFullMesh to a closed
        # port, measured). The keys of each launch attempt get their own prefix.
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        attempt = _attempt()
        host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, host, timeout=timeout
        )
        prefixed = dist.PrefixStore(f"plain/attempt{attempt}", store)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=timeout)
        every = int(args.ckpt_every) if args.ckpt_dir else 0
        plain = (_PlainDcp if args.plain_ckpt == "dcp-async" else _Plain)(args.ckpt_dir, every)
        train(plain)  # type: ignore[arg-type]
        plain.close()
        dist.destroy_process_group()
    else:
        prepare = build if args.prepare else None
        resilient.wrap(config=args.config, prepare=prepare, **overrides)(train)()  # (1) decorate


class _Plain:
    """Stand-in context for --plain: no runtime. With --ckpt-dir it is the usual torchrun script:
    every rank torch.saves (and fsyncs) what it tracks every N steps, and a (re)started worker
    loads the newest step that every rank wrote."""

    generation = 0
    device = torch.device("cpu")

    def __init__(self, ckpt_dir: Path | None = None, every: int = 0) -> None:
        self.dir, self.every = ckpt_dir, every
        self.objects: dict[str, object] = {}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def track(self, **objects: object) -> None:
        self.objects.update(objects)

    def _path(self, step: int, rank: int) -> Path:
        assert self.dir is not None
        return self.dir / f"plain-step{step:08d}-rank{rank}.pt"

    def steps(self, total: int) -> range:
        start = 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            done = sorted({int(p.name[10:18]) for p in self.dir.glob("plain-step*-rank*.pt")}, reverse=True)
            for step in done:
                if all(self._path(step, r).exists() for r in range(self.world)):
                    state = torch.load(self._path(step, self.rank), weights_only=True)
                    for name, obj in self.objects.items():
                        obj.load_state_dict(state[name])  # type: ignore[attr-defined]
                    torch.set_rng_state(state["torch_rng"])
                    start = step
                    break
        return range(start, total)

    def completed(self, step: int) -> None:
        nxt = step + 1
        if self.dir is None or not self.every or nxt % self.every:
            return
        state = {name: obj.state_dict() for name, obj in self.objects.items()}  # type: ignore[attr-defined]
        state["torch_rng"] = torch.get_rng_state()
        tmp = self._path(nxt, self.rank).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(self._path(nxt, self.rank))

    def close(self) -> None:
        pass


class _PlainDcp(_Plain):
    """--plain with torch.distributed.checkpoint as its tutorial sets it up: ``get_state_dict`` /
    ``set_state_dict`` for the model and optimizer, ``dcp.async_save`` every N steps (one save in
    flight: the next waits for the last), and a restart loading the newest complete checkpoint.
    What differs per rank (its data position, its RNG) is saved under the rank's own key, since DCP
    keeps one copy of a key that every rank saves. The saves have a gloo group of their own, as
    DCP's docs advise: a background save's collectives on the training's group interleave with its
    all-reduces and deadlock."""

    def __init__(self, ckpt_dir: Path | None = None, every: int = 0) -> None:
        super().__init__(ckpt_dir, every)
        self.pending: Any = None
        self.group = dist.new_group(backend="gloo")

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, opt = self.objects["model"], self.objects["optimizer"]
        msd, osd = get_state_dict(model, opt)  # type: ignore[arg-type]
        own = {n: o.state_dict() for n, o in self.objects.items() if n not in ("model", "optimizer")}  # type: ignore[attr-defined]
        return {
            "model": msd,
            "optimizer": osd,
            f"rank{self.rank}": {**own, "torch_rng": torch.get_rng_state()},
        }

    def steps(self, total: int) -> range:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        assert self.dir is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        done = sorted(p for p in self.dir.glob("step*") if (p / ".metadata").exists())  # (complete ones)
        if not done:
            return range(0, total)
        state = self._state()
        dcp.load(state, checkpoint_id=done[-1], process_group=self.group)
        model, opt = self.objects["model"], self.objects["optimizer"]
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])  # type: ignore[arg-type]
        own = state[f"rank{self.rank}"]
        for name, obj in self.objects.items():
            if name in own:
                obj.load_state_dict(own[name])  # type: ignore[attr-defined]
        torch.set_rng_state(own["torch_rng"])
        return range(int(done[-1].name[4:]), total)

    def completed(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        nxt = step + 1
        if self.dir is None or not self.every or nxt % self.every:
            return
        if self.pending is not None:
            self.pending.result()
        step_dir = self.dir / f"step{nxt:08d}"
        self.pending = dcp.async_save(self._state(), checkpoint_id=step_dir, process_group=self.group)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()


if __name__ == "__main__":
    main()
