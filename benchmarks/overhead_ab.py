"""The runtime's cost per fault-free step, measured inside one run: blocks of plain steps and blocks
of ``ctx.steps`` steps, alternated (ABBA) in the same processes, on the same model and group.

``benchmarks/overhead.py`` compares separate runs; on a shared machine their run-to-run spread
(a few percent) is larger than the effect. Here each wrapped block has plain neighbours a second
away, so drift and placement cancel. What it measures: everything ``ctx.steps`` adds to a step
(heartbeat, collective count, snapshots at the auto interval, the schedule, hooks) and its effect
on the ranks' synchronisation. What it cannot: the runtime's background threads run in both arms;
their own CPU time per step is reported separately (read per thread from /proc), and so is the
process's CPU per step in plain blocks next to a run without the runtime (gloo's polling threads
included, which makes that pair noisy).

    python benchmarks/overhead_ab.py [--pairs 40] [--block 20] [--launch]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def worker(pairs: int, block: int, dim: int, seq: int, max_overhead: float | None) -> None:
    """One rank: warm up, then ABBA blocks; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_tiny import TinyLM, Tokens

    import resilient

    overrides = {"snapshot": {"max_overhead": max_overhead}} if max_overhead is not None else {}

    @resilient.wrap(**overrides)
    def train(ctx: resilient.Context) -> dict[str, list[float]]:
        torch.manual_seed(0)
        model = DDP(TinyLM(dim=dim, seq=seq))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = Tokens(seed=1000 + dist.get_rank(), seq=seq)
        ctx.track(model=model, optimizer=opt, data=data)

        def step() -> None:
            x, y = data.next()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in ctx.steps(range(2 * block)):  # warm-up, and the schedule's calibration samples
            step()
        for _ in range(block):
            step()
        threads_before = _python_thread_ticks()
        out: dict[str, list[float]] = {"plain": [], "wrapped": [], "plain_cpu": [], "plain_steps": [],
                                       "wrapped_steps": []}  # fmt: skip
        order = ["plain", "wrapped", "wrapped", "plain"] * ((pairs + 1) // 2)
        for arm in order[: 2 * pairs]:
            c0 = time.process_time()
            starts = []
            for _ in ctx.steps(range(block)) if arm == "wrapped" else range(block):
                starts.append(time.perf_counter())  # start to start: what ctx.steps adds between steps too
                step()
            starts.append(time.perf_counter())
            each = [(b - a) * 1e3 for a, b in itertools.pairwise(starts)]
            out[arm].append(statistics.median(each))
            out[f"{arm}_steps"] += each
            if arm == "plain":
                out["plain_cpu"].append((time.process_time() - c0) / block * 1e3)
        ticks = _python_thread_ticks()
        spent = sum(t - threads_before.get(k, 0) for k, t in ticks.items())
        out["threads_ms_per_step"] = [spent * 1e3 / os.sysconf("SC_CLK_TCK") / (2 * pairs * block)]
        return out

    got = train()
    if os.environ.get("RANK", "0") == "0":
        print("AB " + json.dumps(got), flush=True)


def _python_thread_ticks() -> dict[int, int]:
    """CPU ticks (user + system) of each Python thread but the main one: the runtime's monitor,
    listener and heartbeat threads (gloo's own threads are not Python threads)."""
    import threading

    out = {}
    for t in threading.enumerate():
        if t is threading.main_thread() or t.native_id is None:
            continue
        try:
            raw = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
        except OSError:
            continue
        stat = raw.rsplit(")", 1)[1].split()
        out[t.native_id] = int(stat[11]) + int(stat[12])
    return out


def plain_cpu(block: int, dim: int, seq: int, steps: int) -> None:
    """The same loop with no runtime at all (env:// ranks): CPU ms per step of the process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from train_tiny import TinyLM, Tokens

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(TinyLM(dim=dim, seq=seq))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = Tokens(seed=1000 + dist.get_rank(), seq=seq)
    cpu = []
    for i in range(steps):
        c0 = time.process_time()
        x, y = data.next()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= block:
            cpu.append((time.process_time() - c0) * 1e3)
    if dist.get_rank() == 0:
        print("CPU " + json.dumps(statistics.mean(cpu)), flush=True)
    dist.destroy_process_group()


def _run(argv: list[str], launch: bool, nproc: int) -> str:
    from chaos.harness import run_ranks

    with tempfile.TemporaryDirectory() as d:
        if launch:
            cmd = [sys.executable, "-m", "resilient.cli", "launch", "--standalone",
                   "--nproc-per-node", str(nproc), "--events-dir", str(Path(d) / "runs"),
                   __file__, *argv]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            out = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
            return out.stdout
        res = run_ranks([__file__, *argv], nproc, cwd=Path(d), timeout=1800)
        if not res.ok:
            raise RuntimeError(res.describe())
        return res.ranks[0].stdout


def _line(stdout: str, tag: str) -> str:
    for ln in stdout.splitlines():
        if ln.startswith(tag):
            return ln[len(tag) :]
    raise RuntimeError(f"no {tag.strip()} line in the output:\n{stdout[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=40, help="wrapped/plain block pairs (ABBA order)")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=160)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--launch", action="store_true", help="under `resilient launch` (else env:// ranks)")
    ap.add_argument(
        "--max-overhead", type=float, default=None, help="snapshot.max_overhead (default: the config's)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain-cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overhead_ab.json")
    a = ap.parse_args()
    if a.worker:
        return worker(a.pairs, a.block, a.dim, a.seq, a.max_overhead)
    if a.plain_cpu:
        return plain_cpu(a.block, a.dim, a.seq, a.pairs * a.block)
    from chaos import results

    st = results.begin(pairs=a.pairs)
    common = ["--pairs", str(a.pairs), "--block", str(a.block), "--dim", str(a.dim), "--seq", str(a.seq)]
    if a.max_overhead is not None:
        common += ["--max-overhead", str(a.max_overhead)]
    ab = json.loads(_line(_run([*common, "--worker"], a.launch, a.nproc), "AB "))
    bare_cpu = json.loads(_line(_run([*common, "--plain-cpu"], False, a.nproc), "CPU "))
    ratios = [w / p - 1 for p, w in zip(ab["plain"], ab["wrapped"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    result = {
        "mode": "launch" if a.launch else "torchrun (env://)",
        "max_overhead": a.max_overhead,
        "pairs": a.pairs,
        "block": a.block,
        "plain_ms": statistics.median(ab["plain_steps"]),
        "wrapped_ms": statistics.median(ab["wrapped_steps"]),
        "overhead_pct_median_of_steps": 100
        * (statistics.median(ab["wrapped_steps"]) / statistics.median(ab["plain_steps"]) - 1),
        "mean_ms": [statistics.mean(ab["plain_steps"]), statistics.mean(ab["wrapped_steps"])],
        "overhead_pct_median_of_pairs": 100 * statistics.median(ratios),
        "overhead_pct_iqr": [100 * q[0], 100 * q[2]],
        "runtime_threads_cpu_ms_per_step": ab["threads_ms_per_step"][0],
        "process_cpu_ms_per_step": [bare_cpu, statistics.median(ab["plain_cpu"])],
    }
    for k, v in result.items():
        print(f"{k:32s} {v if not isinstance(v, float) else round(v, 3)}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(a.out, result, st)


if __name__ == "__main__":
    main()
