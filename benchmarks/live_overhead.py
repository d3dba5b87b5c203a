"""What live resume's per-step capture (with the replay verification's digest and the mirror)
costs a fault-free step, measured inside one run: blocks of
steps with the capture on and blocks with it off, alternated (ABBA) in the same processes, same
model, same group (resilient/runtime/steps/live.py: every RNG, the scheduler, a tracked generator,
the modules' buffers and the optimizers' hyperparameters copied; the tensors' versions summed),
and its mirror to a file in /dev/shm, which ``resilient launch`` adds for a replacement to resume
from (resilient/runtime/steps/handover.py), timed on its own (``mirror_ms``); the ABBA ratio is
what the step pays for both.

    python benchmarks/live_overhead.py [--pairs 30] [--block 20] [--dim 160]

The model is the bundled example's (examples/train_tiny.py) under DDP with AdamW and a cosine
scheduler; ``--dim`` widens it. Everything else the runtime does is in both arms and cancels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def worker(pairs: int, block: int, dim: int) -> None:
    """One rank: warm up, then ABBA blocks; rank 0 prints one JSON line."""
    import atexit
    import shutil
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_tiny import TinyLM

    import resilient
    from resilient.runtime.steps.handover import LiveMirror

    @resilient.wrap()
    def train(ctx: resilient.Context) -> dict[str, list[float]]:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1000 + dist.get_rank())
        vocab, seq = 64, 64
        model = DDP(TinyLM(dim=dim, seq=seq))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10**6)
        ctx.track(model=model, optimizer=opt, scheduler=sched, data=gen)
        live = ctx._rt.live  # type: ignore[attr-defined]  (the benchmark switches the capture)
        spent = {"s": 0.0, "n": 0}
        capture = live.capture

        def timed(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return capture(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - t0
                spent["n"] += 1

        live.capture = timed
        # the mirror resilient launch writes (a node's shared memory), timed on its own
        mirror_dir = Path(tempfile.mkdtemp(prefix="resilient-bench-", dir="/dev/shm"))
        atexit.register(shutil.rmtree, mirror_dir, True)  # (gone even if a step fails)
        handover = ctx._rt.handover  # type: ignore[attr-defined]
        handover.mirror = mirror = LiveMirror(mirror_dir)
        mirrored = {"s": 0.0, "n": 0}
        write = mirror.write

        def timed_mirror(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return write(*a, **k)
            finally:
                mirrored["s"] += time.perf_counter() - t0
                mirrored["n"] += 1

        mirror.write = timed_mirror
        # the replay verification's digest at each step's start (runtime/steps/replay.py)
        replay = ctx._rt.replay  # type: ignore[attr-defined]
        digested = {"s": 0.0, "n": 0}
        at_start = replay.at_start

        def timed_digest(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return at_start(*a, **k)
            finally:
                digested["s"] += time.perf_counter() - t0
                digested["n"] += 1

        replay.at_start = timed_digest

        def switch(on: bool) -> None:
            live.enabled = live.capturing = on
            replay.mode = "warn" if on else "off"
            handover.mirror = mirror if on else None

        def step() -> None:
            tokens = torch.randint(0, vocab, (8, seq + 1), generator=gen)
            loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        steps = ctx.steps(range(10**9))
        for _ in itertools.islice(steps, 2 * block):  # warm-up, the schedule's calibration
            step()
        out: dict[str, list[float]] = {"off": [], "on": [], "off_steps": [], "on_steps": []}
        spent.update(s=0.0, n=0)
        mirrored.update(s=0.0, n=0)
        digested.update(s=0.0, n=0)
        for arm in (["off", "on", "on", "off"] * ((pairs + 1) // 2))[: 2 * pairs]:
            switch(arm == "on")
            starts = []
            for _ in itertools.islice(steps, block):
                starts.append(time.perf_counter())
                step()
            starts.append(time.perf_counter())
            each = [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]
            out[arm].append(statistics.median(each))
            out[f"{arm}_steps"] += each
        switch(True)
        out["capture_ms"] = [1e3 * spent["s"] / max(1, spent["n"])]
        out["digest_ms"] = [1e3 * digested["s"] / max(1, digested["n"])]
        out["digest_every"] = [replay.every]
        out["mirror_ms"] = [1e3 * mirrored["s"] / max(1, mirrored["n"])]
        out["mirror_bytes"] = [max(p.stat().st_size for p in mirror.paths)]
        out["tensors"] = [sum(1 for _ in model.parameters())]
        return out

    got = train()
    if os.environ.get("RANK", "0") == "0":
        print("AB " + json.dumps(got), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=30, help="on/off block pairs (ABBA order)")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--dim", type=int, default=160)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.worker:
        return worker(a.pairs, a.block, a.dim)
    from chaos import results
    from chaos.harness import run_ranks

    st = results.begin(pairs=a.pairs)
    argv = [__file__, "--pairs", str(a.pairs), "--block", str(a.block), "--dim", str(a.dim), "--worker"]
    with tempfile.TemporaryDirectory() as d:
        res = run_ranks(argv, a.nproc, cwd=Path(d), timeout=1800)
        if not res.ok:
            raise SystemExit(res.describe())
        line = next(ln for ln in res.ranks[0].stdout.splitlines() if ln.startswith("AB "))
    ab = json.loads(line[3:])
    ratios = [on / off - 1 for off, on in zip(ab["off"], ab["on"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    off_ms = statistics.median(ab["off_steps"])
    result = {
        "dim": a.dim,
        "pairs": a.pairs,
        "block": a.block,
        "parameters": ab["tensors"][0],
        "off_ms": off_ms,
        "on_ms": statistics.median(ab["on_steps"]),
        "cost_pct_median_of_pairs": 100 * statistics.median(ratios),
        "cost_pct_iqr": [100 * q[0], 100 * q[2]],
        "capture_ms": ab["capture_ms"][0],
        "capture_pct_of_step": 100 * ab["capture_ms"][0] / off_ms,
        "mirror_ms": ab["mirror_ms"][0],
        "mirror_bytes": ab["mirror_bytes"][0],
        "capture_and_mirror_pct_of_step": 100 * (ab["capture_ms"][0] + ab["mirror_ms"][0]) / off_ms,
        "digest_ms": ab["digest_ms"][0],  # (replay verification; every digest_every steps)
        "digest_every": ab["digest_every"][0],
        "all_pct_of_step": 100 * (ab["capture_ms"][0] + ab["mirror_ms"][0] + ab["digest_ms"][0]) / off_ms,
    }
    for k, v in result.items():
        print(f"{k:28s} {v if not isinstance(v, float) else round(v, 3)}")
    out = a.out or ROOT / "benchmarks" / "results" / f"live_overhead_dim{a.dim}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, result, st)


if __name__ == "__main__":
    main()
