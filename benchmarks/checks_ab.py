"""What the step checks cost a fault-free step, measured inside one run: blocks of steps with the
checks on and blocks with them off, alternated (ABBA) in the same processes, same model, same group.

The checks: the guard (each tracked optimizer's gradient norm before its step, the spike window,
the watch on ``clip_grad_norm_``; resilient/detectors/guard.py) and the replica digests at
``sdc.interval: auto`` (resilient/detectors/replicas.py: a digest wherever state is kept and at least
every 100 steps, posted with the collective count). Both arms run inside ``ctx.steps``, so
everything else the runtime does (snapshots, the collective count) is in both and cancels.

    python benchmarks/checks_ab.py [--model tiny|fsdp2] [--pairs 30] [--block 20]

``tiny``: the bundled example's model under DDP (examples/train_tiny.py, wider: dim 160, seq 64);
``fsdp2``: examples/train_fsdp2.py's model, ``fully_shard`` per block, bf16 autocast, clipping.
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


def worker(model_name: str, pairs: int, block: int) -> None:
    """One rank: warm up, then ABBA blocks; rank 0 prints one JSON line."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import resilient

    @resilient.wrap()
    def train(ctx: resilient.Context) -> dict[str, list[float]]:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1000 + dist.get_rank())
        if model_name == "tiny":
            from torch.nn.parallel import DistributedDataParallel as DDP
            from train_tiny import TinyLM

            vocab, seq = 64, 64
            model: torch.nn.Module = DDP(TinyLM(dim=160, seq=seq))
            clip = False
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from train_fsdp2 import LM, VOCAB

            vocab, seq = VOCAB, 32
            mesh = init_device_mesh("cpu", (ctx.world_size,))
            model = LM(64, 2, 4, seq, dropout=0.1)
            for b in model.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(model, mesh=mesh)
            clip = True
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ctx.track(model=model, optimizer=opt, data=gen)
        loop = ctx._rt  # type: ignore[attr-defined]  (the benchmark switches the checks)
        guard, sdc = loop.guard, loop.sdc

        def step() -> None:
            tokens = torch.randint(0, vocab, (8, seq + 1), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=model_name == "fsdp2"):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        spent = {"guard": 0.0, "digests": 0.0, "digest_calls": 0}  # their own time, in the on blocks

        def timed(fn, key):  # type: ignore[no-untyped-def]
            def run(*a, **k):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[key] += time.perf_counter() - t0
                    if key == "digests":
                        spent["digest_calls"] += 1

            return run

        guard.check = timed(guard.check, "guard")
        if sdc is not None:
            sdc.digests = timed(sdc.digests, "digests")

        def checks(on: bool) -> None:
            guard.detach()
            guard.clips.uninstall()
            loop.sdc = sdc if on else None
            if on:
                guard.attach("optimizer", opt)
                guard.clips.install()

        steps = ctx.steps(range(10**9))
        for _ in itertools.islice(steps, 2 * block):  # warm-up, the schedule's calibration
            step()
        out: dict[str, list[float]] = {"off": [], "on": [], "off_steps": [], "on_steps": []}
        checks_before = guard.checks
        spent.update(guard=0.0, digests=0.0, digest_calls=0)
        for arm in (["off", "on", "on", "off"] * ((pairs + 1) // 2))[: 2 * pairs]:
            checks(arm == "on")
            starts = []
            for _ in itertools.islice(steps, block):
                starts.append(time.perf_counter())
                step()
            starts.append(time.perf_counter())
            each = [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]
            out[arm].append(statistics.median(each))
            out[f"{arm}_steps"] += each
        out["checks"] = [guard.checks - checks_before]
        out["guard_ms_per_check"] = [1e3 * spent["guard"] / max(1, guard.checks - checks_before)]
        out["digest_ms_per_window"] = [1e3 * spent["digests"] / max(1, spent["digest_calls"])]
        out["digest_windows"] = [spent["digest_calls"]]
        return out

    got = train()
    if os.environ.get("RANK", "0") == "0":
        print("AB " + json.dumps(got), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=["tiny", "fsdp2"])
    ap.add_argument("--pairs", type=int, default=60, help="on/off block pairs (ABBA order)")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.worker:
        return worker(a.model, a.pairs, a.block)
    from chaos import results
    from chaos.harness import run_ranks

    st = results.begin(pairs=a.pairs)
    argv = [__file__, "--model", a.model, "--pairs", str(a.pairs), "--block", str(a.block), "--worker"]
    with tempfile.TemporaryDirectory() as d:
        res = run_ranks(argv, a.nproc, cwd=Path(d), timeout=1800)
        if not res.ok:
            raise SystemExit(res.describe())
        line = next(ln for ln in res.ranks[0].stdout.splitlines() if ln.startswith("AB "))
    ab = json.loads(line[3:])
    ratios = [on / off - 1 for off, on in zip(ab["off"], ab["on"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    result = {
        "model": a.model,
        "pairs": a.pairs,
        "block": a.block,
        "off_ms": statistics.median(ab["off_steps"]),
        "on_ms": statistics.median(ab["on_steps"]),
        "cost_pct_median_of_pairs": 100 * statistics.median(ratios),
        "cost_pct_iqr": [100 * q[0], 100 * q[2]],
        "checks_in_on_blocks": ab["checks"][0],
        "guard_ms_per_check": ab["guard_ms_per_check"][0],
        "guard_pct_of_step": 100 * ab["guard_ms_per_check"][0] / statistics.median(ab["off_steps"]),
        "digest_windows_in_on_blocks": ab["digest_windows"][0],
        "digest_ms_per_window": ab["digest_ms_per_window"][0],
    }
    for k, v in result.items():
        print(f"{k:28s} {v if not isinstance(v, float) else round(v, 3)}")
    out = a.out or ROOT / "benchmarks" / "results" / f"checks_ab_{a.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, result, st)


if __name__ == "__main__":
    main()
